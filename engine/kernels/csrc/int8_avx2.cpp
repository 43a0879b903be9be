// int8 x int8 matmul on AVX2 (kernels.h: int8_groups_avx2), the same arithmetic as int8_avx512.cpp.
//
// The weight layout is the AVX512 kernel's: each group of 16 rows stored 4 columns at a time, as w + 128, so one
// 64-byte line holds 4 values of 16 rows: two registers of 8 rows here. Each output stays in its own int32 lane
// from start to end (no horizontal sums), against 4 activation bytes broadcast to every lane.
// AVX2 has no vpdpbusd; vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16, which would
// saturate for (w + 128) * x. So, as llama.cpp does: |w| times x carrying w's sign (both at most 127: a pair sums
// to at most 32,258), then vpmaddwd against ones adds the pairs into int32. The block's dot product is the same
// exact integer as VNNI's, and the float steps after it are the same, so both kernels give the same bits.
#include "avx2.h"
#include "kernels.h"

#include <algorithm>

namespace tern {
namespace {

constexpr int64_t kQuad = 4;  // activation bytes per lane and step
constexpr int kTileRows = 4;  // activation rows sharing each weight load

template <int MB>
inline void group_rows(const Int8Problem& p, int64_t m0, const uint8_t* w, const __m256 w_scale[2], int64_t n0,
                       const uint8_t* prefetch) {
  const QuantizedRows& q = *p.x;
  const int64_t quads_per_block = q.block / kQuad;
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < q.blocks; ++b) {
    // At most 256 * 127 * 127 per lane (< 2^24): exact as an int32 and as a float.
    __m256i dot[MB][2];
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      dot[m][0] = dot[m][1] = _mm256_setzero_si256();
      x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + b * q.block);
    }
    const uint8_t* wb = w + b * quads_per_block * 64;
    for (int64_t i = 0; i < quads_per_block; ++i) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + (b * quads_per_block + i) * 64), _MM_HINT_T0);
      __m256i ws[2], wa[2];
      for (int h = 0; h < 2; ++h) {
        ws[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32)), offset);
        wa[h] = _mm256_abs_epi8(ws[h]);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = _mm256_set1_epi32(x[m][i]);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(wa[h], _mm256_sign_epi8(xv, ws[h]));
          dot[m][h] = _mm256_add_epi32(dot[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 x_scale = _mm256_set1_ps(q.scales[(m0 + m) * q.blocks + b]);
      for (int h = 0; h < 2; ++h)
        acc[m][h] = _mm256_add_ps(acc[m][h], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][h]), x_scale));
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h)
      avx2::store8(p.out, (m0 + m) * p.N + n0 + 8 * h, _mm256_mul_ps(acc[m][h], w_scale[h]), p.out_bf16);
}

}  // namespace

void int8_groups_avx2(const Int8Problem& p, int64_t g0, int64_t g1) {
  const int64_t K = p.x->K;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kInt8GroupRows;
    const uint8_t* wg = p.w + n0 * K;
    const __m256 scale[2] = {avx2::load8(p.w_scale, n0, p.w_scale_bf16), avx2::load8(p.w_scale, n0 + 8, p.w_scale_bf16)};
    // The group's weights (16 x K bytes) stay in L1 while every tile of activation rows uses them, and the first
    // tile asks for the next group's, so reading memory overlaps the arithmetic.
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
