// bf16 x bf16 -> bf16 matmul for CPUs without AVX512-BF16 (bf16_fma_avx2.cpp, bf16_fma_avx512.cpp; kernels.h:
// bf16_fma_groups_*), on the weights bf16_avx512.cpp reads: layouts.pack_bf16's [N/4][K/32][4][32].
//
//   y[M, N] = x[M, K] @ w[N, K].T, accumulated in fp32, rounded once to bf16 (nearest even)
//
// Why a kernel where aten has a bf16 matmul: aten's GEMM gives a row other bits at another batch size, and in bf16
// those differences grow through the layers into ~0.2-0.3 nats between a token's logprob as a prompt token and as a
// generated one (engine/README.md). Here each output is one fixed chain over its row, so a row gets the same bits
// in any batch and prompts can prefill as decode rows, as on AVX512-BF16 CPUs.
//
// The chain is vdpbf16ps's as Intel's SDM defines it, in fp32 FMAs: for each 64-byte chunk of K (16 pairs of bf16),
// lane i adds the product of the odd pair members, then of the even ones (a product of two bf16 is exact in fp32,
// so each FMA rounds once, as the instruction does), then a fixed tree folds the 16 lanes. A lane of AVX2 holds half
// as many pairs: it keeps two accumulators per output, lanes 0-7 and 8-15 of AVX512's one, so both instruction sets
// give the same bits (tests hold both to one PyTorch twin). Unlike vdpbf16ps, subnormal inputs are not read as zero.
//
// The activations are split once per tile of rows into fp32 (each chunk: its 16 odd values, then its 16 even ones),
// so the inner loop's FMAs read them from cache as they are and only the weights are split in registers.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace tern::bf16_fma {

constexpr int64_t kChunk = 32;    // bf16 values per 64-byte chunk: 16 pairs
constexpr int64_t kPairs = kChunk / 2;
constexpr int kGroupRows = 4;     // weight rows per packed group
// Rows of x split and kept in cache while a thread's weight groups stream past: as many as fit 512 KB of fp32, up
// to 64 (a prefill step of 256 rows then reads the weights from memory 4 times, not 16).
constexpr int64_t kSplitBytes = 512 << 10, kMaxRowTile = 64;

struct Avx2 {
  using Reg = __m256;
  using Raw = __m256i;
  static constexpr int64_t kLanes = 8;
  static constexpr int kRowsPerPass = 4;    // x rows per pass over a group: 4 x 1 weight row x 2 halves = 8 sums
  static constexpr int kWeightRowsPerPass = 1;
  static Raw load_raw(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Reg odd(Raw v) {  // the high bf16 of each 32-bit lane, as fp32: its bits with the low half cleared
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static Reg even(Raw v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold(const Reg* halves) { return _mm256_add_ps(halves[0], halves[1]); }  // pairs i and 8 + i
};

#ifdef __AVX512F__
struct Avx512 {
  using Reg = __m512;
  using Raw = __m512i;
  static constexpr int64_t kLanes = 16;
  static constexpr int kRowsPerPass = 4;  // 4 x rows x 4 weight rows = 16 sums
  static constexpr int kWeightRowsPerPass = 4;
  static Raw load_raw(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Reg odd(Raw v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static Reg even(Raw v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold(const Reg* whole) {  // pairs i and 8 + i: the register's two 256-bit halves
    return _mm256_add_ps(_mm512_castps512_ps256(whole[0]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(whole[0]), 1)));
  }
};
#endif

// [sum(h0), sum(h1), sum(h2), sum(h3)] of 8 lanes each: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m128 sum_lanes(__m256 h0, __m256 h1, __m256 h2, __m256 h3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(h0, h1), _mm256_hadd_ps(h2, h3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Rows [0, rows) of x (bf16, row stride K) as fp32 in xs: per row and chunk, the 16 odd members, then the 16 even.
template <class V>
inline void split_rows(const uint16_t* x, int64_t rows, int64_t K, float* xs) {
  constexpr int64_t kHalves = kPairs / V::kLanes;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < K / kChunk; ++c) {
      float* out = xs + (m * (K / kChunk) + c) * kChunk;
      for (int64_t h = 0; h < kHalves; ++h) {
        const typename V::Raw raw = V::load_raw(x + m * K + c * kChunk + h * 2 * V::kLanes);
        V::store(out + h * V::kLanes, V::odd(raw));
        V::store(out + kPairs + h * V::kLanes, V::even(raw));
      }
    }
}

// out[m, r0 .. r0 + RB) for MB split rows of x against weight rows r0 .. r0 + RB of one packed group.
template <class V, int MB, int RB>
inline void rows_against_group(const float* xs, int64_t chunks, const uint16_t* w, int r0, uint16_t* out,
                               int64_t N) {
  constexpr int64_t kHalves = kPairs / V::kLanes;
  typename V::Reg acc[MB][RB][kHalves];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r)
      for (int64_t h = 0; h < kHalves; ++h) acc[m][r][h] = V::zero();
  for (int64_t c = 0; c < chunks; ++c)
    for (int r = 0; r < RB; ++r)
      for (int64_t h = 0; h < kHalves; ++h) {
        const typename V::Raw raw = V::load_raw(w + (c * kGroupRows + r0 + r) * kChunk + h * 2 * V::kLanes);
        const typename V::Reg odd = V::odd(raw), even = V::even(raw);
        for (int m = 0; m < MB; ++m) {
          const float* xc = xs + (m * chunks + c) * kChunk + h * V::kLanes;
          acc[m][r][h] = V::fmadd(odd, V::load(xc), acc[m][r][h]);
          acc[m][r][h] = V::fmadd(even, V::load(xc + kPairs), acc[m][r][h]);
        }
      }
  for (int m = 0; m < MB; ++m) {
    __m256 folded[4];
    for (int r = 0; r < 4; ++r) folded[r] = V::fold(acc[m][r % RB]);  // rows past RB: computed, not stored
    alignas(16) float sums[4];
    _mm_store_ps(sums, sum_lanes(folded[0], folded[1], folded[2], folded[3]));
    for (int r = 0; r < RB; ++r) out[m * N + r0 + r] = round_to_bf16_bits(sums[r]);
  }
}

template <class V>
void groups(const Bf16Problem& p, int64_t g0, int64_t g1) {
  constexpr int MB = V::kRowsPerPass, RB = V::kWeightRowsPerPass;
  const int64_t M = p.M, K = p.K, N = p.N, chunks = K / kChunk;
  const int64_t row_tile = std::clamp<int64_t>(kSplitBytes / (K * 4), MB, kMaxRowTile);  // 4 bytes a float
  thread_local std::vector<float> split;  // this thread's tile of x in fp32, kept between calls
  for (int64_t m0 = 0; m0 < M; m0 += row_tile) {
    const int64_t rows = std::min(row_tile, M - m0);
    if (split.size() < static_cast<size_t>(rows * K)) split.resize(rows * K);
    split_rows<V>(p.x + m0 * K, rows, K, split.data());
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = 0; m < rows; m += MB) {
        const float* xs = split.data() + m * K;
        const uint16_t* wg = p.w + g * kGroupRows * K;
        uint16_t* om = p.out + (m0 + m) * N + g * kGroupRows;
        if (rows - m == 1) {  // one row (decode): all 4 weight rows at once, so 4 sums chain side by side
          rows_against_group<V, 1, kGroupRows>(xs, chunks, wg, 0, om, N);
          continue;
        }
        for (int r0 = 0; r0 < kGroupRows; r0 += RB) switch (std::min<int64_t>(MB, rows - m)) {
            case 2: rows_against_group<V, 2, RB>(xs, chunks, wg, r0, om, N); break;
            case 3: rows_against_group<V, 3, RB>(xs, chunks, wg, r0, om, N); break;
            default: rows_against_group<V, MB, RB>(xs, chunks, wg, r0, om, N); break;
          }
      }
  }
}

}  // namespace tern::bf16_fma
