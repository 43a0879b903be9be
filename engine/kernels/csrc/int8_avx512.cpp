// int8 x int8 matmul on AVX512-VNNI (kernels.h: int8_groups_avx512).
//
//   y[M, N] = sum_k xq[m, k] * w[n, k] * x_scale[m, k / block] * w_scale[n]
//
// The weight is int8 with one scale per output row (engine/quant.py's int8 mode). The activations come quantized
// to int8 with one scale per block of up to 256 values, as llama.cpp does for its k-quant dot products (Q8_K), so
// 64 weights cost one vpdpbusd instead of a float conversion each. One kernel serves every batch size: a group's
// weights stay in L1 while all the rows pass them, 4 at a time (prefill runs at ~2x oneDNN's int8 GEMM through
// torch._int_mm here, decode near the memory's speed), and each row's result is the same alone or in any batch.
//
// The packed layout stores each group of 16 weight rows as [K/4][16][4]: one 64-byte load holds 4 consecutive
// values of 16 rows, and vpdpbusd against 4 activation bytes broadcast to every lane adds them into 16 outputs at
// once, one per lane. No horizontal sums: each output is its own lane from start to end, so a batch of rows costs
// little more than its vpdpbusds, and a thread reads its weights as one sequential stream.
// vpdpbusd multiplies unsigned by signed bytes: the packed weight holds w + 128 as uint8, and each block's
// accumulator starts at -128 * sum(xq over the block), which cancels the offset exactly.
#include "avx512.h"
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>

namespace tern {
namespace {

constexpr int64_t kQuad = 4;  // activation bytes per vpdpbusd lane
constexpr int kTileRows = 4;  // activation rows sharing each weight load

inline __m512 load_floats(const void* base, int64_t index, bool bf16) {
  if (!bf16) return _mm512_loadu_ps(static_cast<const float*>(base) + index);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// out[m, 16 rows of group] for MB activation rows against one packed group. Each block's dot product is an
// exact integer; the float steps after it (acc += dot * x_scale, one block after another, then * w_scale, no
// fused multiply-add) are the ones the tests' PyTorch reference takes, so the two agree bit for bit.
template <int MB>
inline void group_rows(const Int8Problem& p, int64_t m0, const uint8_t* w, __m512 w_scale, int64_t n0,
                       const uint8_t* prefetch) {
  const QuantizedRows& q = *p.x;
  const int64_t quads_per_block = q.block / kQuad;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < q.blocks; ++b) {
    // At most 256 * 255 * 127 per lane (< 2^24): exact as an int32 and as a float.
    __m512i dot[MB];
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      dot[m] = _mm512_set1_epi32(-128 * q.sums[(m0 + m) * q.blocks + b]);
      x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + b * q.block);
    }
    const uint8_t* wb = w + b * quads_per_block * 64;
    for (int64_t i = 0; i < quads_per_block; ++i) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + (b * quads_per_block + i) * 64), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(wb + i * 64);
      for (int m = 0; m < MB; ++m) dot[m] = _mm512_dpbusd_epi32(dot[m], wv, _mm512_set1_epi32(x[m][i]));
    }
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m]),
                                                   _mm512_set1_ps(q.scales[(m0 + m) * q.blocks + b])));
  }
  for (int m = 0; m < MB; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, _mm512_mul_ps(acc[m], w_scale), p.out_bf16);
}

}  // namespace

void int8_groups_avx512(const Int8Problem& p, int64_t g0, int64_t g1) {
  const int64_t K = p.x->K;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kInt8GroupRows;
    const uint8_t* wg = p.w + n0 * K;
    const __m512 scale = load_floats(p.w_scale, n0, p.w_scale_bf16);  // the group's 16 row scales
    // The group's weights (16 x K bytes) stay in L1 while every tile of activation rows uses them, and the
    // first tile asks for the next group's, so reading memory overlaps the arithmetic.
    const uint8_t* next = g + 1 < g1 ? wg + kInt8GroupRows * K : nullptr;
    for (int64_t m = 0; m < p.M; m += kTileRows, next = nullptr) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: group_rows<1>(p, m, wg, scale, n0, next); break;
        case 2: group_rows<2>(p, m, wg, scale, n0, next); break;
        case 3: group_rows<3>(p, m, wg, scale, n0, next); break;
        default: group_rows<kTileRows>(p, m, wg, scale, n0, next); break;
      }
    }
  }
}

}  // namespace tern
