// bf16 x bf16 matmul on AVX512-BF16 CPUs (kernels.h: bf16_groups_avx512).
//
//   y[M, N] = x[M, K] @ w[N, K].T, accumulated in fp32, rounded once to bf16 (nearest even)
//
// Batch-1 decode is bound by reading the weights, and aten's bf16 matmul reads them at about half this
// machine's bandwidth. The weight here is stored as layouts.pack_rows lays it out: each group of 4 rows
// chunk-major, [N/4][K/32][4][32], so a thread reads one sequential stream (the int8 kernel's layout, in bf16).
// Each output is one chain of vdpbf16ps over its row in K order, then a fixed reduction of the 16 lanes, so a
// row of x gets the same bits whatever else is in the batch: prefill and decode steps agree, and a sequence's
// tokens do not depend on who shares its step. One kernel serves every batch size: rows of x are taken 32 at a
// time so they stay in cache while a thread's weight groups stream past, which keeps prefill within ~10-20% of
// oneDNN's GEMM while decode runs 2-4x faster.
#include "bf16_fma.h"  // the layout's constants and the final fold, shared with the FMA kernels

#include <immintrin.h>

#include <algorithm>

namespace tern {
namespace {

using bf16_fma::kChunk;
constexpr int kRows = bf16_fma::kGroupRows;
constexpr int64_t kRowTile = 32;   // rows of x kept in cache while a thread's weight groups stream past

// [sum(a0), sum(a1), sum(a2), sum(a3)]: the same additions in the same order for every output.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  using bf16_fma::Avx512;
  return bf16_fma::sum_lanes(Avx512::fold(&a0), Avx512::fold(&a1), Avx512::fold(&a2), Avx512::fold(&a3));
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

}  // namespace

void bf16_groups_avx512(const Bf16Problem& p, int64_t g0, int64_t g1) {
  const int64_t M = p.M, K = p.K, N = p.N;
  for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
    const int64_t m1 = std::min(M, m0 + kRowTile);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = m0; m < m1; m += 4) {
        const uint16_t* xm = p.x + m * K;
        const uint16_t* wg = p.w + g * kRows * K;
        uint16_t* om = p.out + m * N + g * kRows;
        switch (std::min<int64_t>(4, m1 - m)) {
          case 1: group<1>(xm, K, wg, om, N); break;
          case 2: group<2>(xm, K, wg, om, N); break;
          case 3: group<3>(xm, K, wg, om, N); break;
          default: group<4>(xm, K, wg, om, N); break;
        }
      }
  }
}

}  // namespace tern
