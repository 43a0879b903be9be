// int8 x int8 matmul on AVX512-VNNI CPUs, registered as torch.ops.tern.int8_vnni_mm.
// Build with -ffp-contract=off: a fused multiply-add would round differently from its PyTorch twin.
//
//   y[M, N] = sum_k xq[m, k] * w[n, k] * x_scale[m, k / block] * w_scale[n]
//
// The weight is int8 with one scale per output row (engine/quant.py's int8 mode). The activations are quantized
// here to int8 with one scale per block of up to 256 values, as llama.cpp does for its k-quant dot products
// (Q8_K), so 64 weights cost one vpdpbusd instead of a float conversion each. One kernel serves every batch
// size: a group's weights stay in L1 while all the rows pass them, 4 at a time (prefill runs at ~2x oneDNN's
// int8 GEMM through torch._int_mm here, decode near the memory's speed), and each row's result is the same alone
// or in any batch.
//
// `pack` (engine/cpu_kernels.py) stores each group of 16 weight rows as [K/4][16][4]: one 64-byte load holds 4
// consecutive values of 16 rows, and vpdpbusd against 4 activation bytes broadcast to every lane adds them into
// 16 outputs at once, one per lane. No horizontal sums: each output is its own lane from start to end, so a
// batch of rows costs little more than its vpdpbusds, and a thread reads its weights as one sequential stream.
// vpdpbusd multiplies unsigned by signed bytes: the packed weight holds w + 128 as uint8, and each block's
// accumulator starts at -128 * sum(xq over the block), which cancels the offset exactly.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "int8_vnni.cpp needs AVX512F, AVX512BW and AVX512-VNNI (built with -march=native)"
#endif

namespace {

constexpr int64_t kChunk = 64;      // activation blocks are whole multiples of 64 values
constexpr int64_t kGroupRows = 16;  // weight rows per packed group: one int32 lane each
constexpr int64_t kQuad = 4;        // activation bytes per vpdpbusd lane
constexpr int kTileRows = 4;        // activation rows sharing each weight load

inline __m512 load_floats(const void* base, int64_t index, bool bf16) {
  if (!bf16) return _mm512_loadu_ps(static_cast<const float*>(base) + index);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One block of `block` activations from x[base...], quantized to out[0..block) (scale = absmax / 127, rounded to
// nearest even as torch.round does: cvtps_epi32 in the default MXCSR mode). Returns the block's absmax.
inline float quantize_block(const void* x, int64_t base, int64_t block, bool bf16, int8_t* out) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < block; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_floats(x, base + i, bf16)));
  const float absmax = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
  for (int64_t i = 0; i < block; i += 16) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load_floats(x, base + i, bf16), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(qi));
  }
  return absmax;
}

// The activations, quantized: int8 values [M, K], and per row and block its scale and its accumulators' start
// (-128 * the sum of the block's values).
struct QuantizedRows {
  int64_t K, block, blocks;
  std::vector<int8_t> values;
  std::vector<int32_t> starts;
  std::vector<float> scales;

  QuantizedRows(const void* x, int64_t M, int64_t K, int64_t block, bool bf16)
      : K(K), block(block), blocks(K / block), values(M * K), starts(M * blocks), scales(M * blocks) {
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < blocks; ++b) {
          int8_t* q = values.data() + m * K + b * block;
          scales[m * blocks + b] = quantize_block(x, m * K + b * block, block, bf16, q) / 127.f;
          int32_t sum = 0;
          for (int64_t i = 0; i < block; ++i) sum += q[i];
          starts[m * blocks + b] = -128 * sum;
        }
    });
  }
};

// Round to nearest even, as torch's float -> bfloat16 conversion does (finite values).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

// out[m, 16 rows of group] for MB activation rows against one packed group. Each block's dot product is an
// exact integer; the float steps after it (acc += dot * x_scale, one block after another, then * w_scale, no
// fused multiply-add) are the ones cpu_kernels.int8_reference takes, so the two agree bit for bit.
template <int MB>
inline void group_rows(const QuantizedRows& q, int64_t m0, const uint8_t* w, __m512 w_scale, void* out, int64_t N,
                       bool bf16, const uint8_t* prefetch) {
  const int64_t K = q.K, quads_per_block = q.block / kQuad;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < q.blocks; ++b) {
    // At most 256 * 255 * 127 per lane (< 2^24): exact as an int32 and as a float.
    __m512i dot[MB];
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      dot[m] = _mm512_set1_epi32(q.starts[(m0 + m) * q.blocks + b]);
      x[m] = reinterpret_cast<const int32_t*>(q.values.data() + (m0 + m) * K + b * q.block);
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
  for (int m = 0; m < MB; ++m) {
    const __m512 y = _mm512_mul_ps(acc[m], w_scale);
    if (bf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + (m0 + m) * N), to_bf16(y));
    else _mm512_storeu_ps(static_cast<float*>(out) + (m0 + m) * N, y);
  }
}

// Activations share one scale per block of up to 256 values (as llama.cpp's Q8_K): the largest of 256, 192,
// 128, 64 that divides K. Fewer scalings per weight is what makes a batch of rows cheaper than int8pack.
int64_t activation_block_chunks(int64_t K) {
  for (int64_t chunks : {4, 3, 2}) if (K % (chunks * kChunk) == 0) return chunks;
  return 1;
}

at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale) {
  TORCH_CHECK(x.dim() == 2 && w_packed.dim() == 2 && x.size(1) == w_packed.size(1),
              "int8_vnni_mm: x must be [M, K] and w_packed [N, K]");
  TORCH_CHECK(w_packed.scalar_type() == at::kByte && w_packed.is_contiguous(), "int8_vnni_mm: w_packed must be packed uint8");
  TORCH_CHECK((w_scale.scalar_type() == at::kFloat || w_scale.scalar_type() == at::kBFloat16) &&
              w_scale.is_contiguous() && w_scale.numel() == w_packed.size(0),
              "int8_vnni_mm: w_scale must be float32 or bfloat16 [N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "int8_vnni_mm: x must be bfloat16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0);
  TORCH_CHECK(K % kChunk == 0 && N % kGroupRows == 0, "int8_vnni_mm: K must be a multiple of 64 and N of 16");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;

  const QuantizedRows q(xc.data_ptr(), M, K, activation_block_chunks(K) * kChunk, bf16);
  const uint8_t* w = w_packed.data_ptr<uint8_t>();
  const void* ws = w_scale.data_ptr();
  const bool bf16_scales = w_scale.scalar_type() == at::kBFloat16;
  void* o = out.data_ptr();
  at::parallel_for(0, N / kGroupRows, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * kGroupRows * K;
      const __m512 scale = load_floats(ws, g * kGroupRows, bf16_scales);  // the group's 16 row scales
      void* og = bf16 ? static_cast<void*>(static_cast<uint16_t*>(o) + g * kGroupRows)
                      : static_cast<void*>(static_cast<float*>(o) + g * kGroupRows);
      // The group's weights (16 x K bytes) stay in L1 while every tile of activation rows uses them, and the
      // first tile asks for the next group's, so reading memory overlaps the arithmetic.
      const uint8_t* next = g + 1 < g1 ? wg + kGroupRows * K : nullptr;
      for (int64_t m = 0; m < M; m += kTileRows, next = nullptr) {
        switch (std::min<int64_t>(kTileRows, M - m)) {
          case 1: group_rows<1>(q, m, wg, scale, og, N, bf16, next); break;
          case 2: group_rows<2>(q, m, wg, scale, og, N, bf16, next); break;
          case 3: group_rows<3>(q, m, wg, scale, og, N, bf16, next); break;
          default: group_rows<kTileRows>(q, m, wg, scale, og, N, bf16, next); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tern, m) { m.def("int8_vnni_mm(Tensor x, Tensor w_packed, Tensor w_scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(tern, CPU, m) { m.impl("int8_vnni_mm", &int8_vnni_mm); }
