// bf16 x bf16 matmul on AVX512-BF16 CPUs, registered as torch.ops.tern.bf16_packed_mm.
//
//   y[M, N] = x[M, K] @ w[N, K].T, accumulated in fp32, rounded once to bf16 (nearest even)
//
// Batch-1 decode is bound by reading the weights, and aten's bf16 matmul reads them at about half this
// machine's bandwidth. The weight here is stored as cpu_kernels.pack_rows lays it out: each group of 4 rows
// chunk-major, [N/4][K/32][4][32], so a thread reads one sequential stream (the int8 kernel's layout, in bf16).
// Each output is one chain of vdpbf16ps over its row in K order, then a fixed reduction of the 16 lanes, so a
// row of x gets the same bits whatever else is in the batch: prefill and decode steps agree, and a sequence's
// tokens do not depend on who shares its step. One kernel serves every batch size: rows of x are taken 32 at a
// time so they stay in cache while a thread's weight groups stream past, which keeps prefill within ~10-20% of
// oneDNN's GEMM while decode runs 2-4x faster.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>

#ifdef __AVX512BF16__

namespace {

constexpr int64_t kChunk = 32;     // bf16 values per zmm register
constexpr int kRows = 4;           // weight rows per packed group
constexpr int64_t kRowTile = 32;   // rows of x kept in cache while a thread's weight groups stream past

// [sum(a0), sum(a1), sum(a2), sum(a3)]: the same additions in the same order for every output.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto half = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[m, 0..3] for MB rows of x against one packed group of 4 weight rows.
template <int MB>
inline void group(const uint16_t* x, int64_t K, const uint16_t* w, uint16_t* out, int64_t N) {
  __m512 acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / kChunk; ++c) {
    __m512bh wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (c * kRows + r) * kChunk);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + c * kChunk);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m) {
    const __m128bh rounded = _mm_cvtneps_pbh(reduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + m * N), (__m128i)rounded);
  }
}

at::Tensor bf16_packed_mm(const at::Tensor& x, const at::Tensor& w_packed) {
  TORCH_CHECK(x.dim() == 2 && w_packed.dim() == 2 && x.size(1) == w_packed.size(1),
              "bf16_packed_mm: x must be [M, K] and w_packed [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous(),
              "bf16_packed_mm: x and w_packed must be bfloat16, w_packed contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0);
  TORCH_CHECK(K % kChunk == 0 && N % kRows == 0, "bf16_packed_mm: K must be a multiple of 32 and N of 4");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto* xs = static_cast<const uint16_t*>(xc.data_ptr());
  const auto* w = static_cast<const uint16_t*>(w_packed.data_ptr());
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, N / kRows, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t m1 = std::min(M, m0 + kRowTile);
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t m = m0; m < m1; m += 4) {
          const uint16_t* xm = xs + m * K;
          const uint16_t* wg = w + g * kRows * K;
          uint16_t* om = o + m * N + g * kRows;
          switch (std::min<int64_t>(4, m1 - m)) {
            case 1: group<1>(xm, K, wg, om, N); break;
            case 2: group<2>(xm, K, wg, om, N); break;
            case 3: group<3>(xm, K, wg, om, N); break;
            default: group<4>(xm, K, wg, om, N); break;
          }
        }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tern, m) { m.def("bf16_packed_mm(Tensor x, Tensor w_packed) -> Tensor"); }
TORCH_LIBRARY_IMPL(tern, CPU, m) { m.impl("bf16_packed_mm", &bf16_packed_mm); }

#endif  // __AVX512BF16__: without it the op is not registered, and bf16 weights stay with aten's matmul
