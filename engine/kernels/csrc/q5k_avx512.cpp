// 5-bit weights (GGUF's Q5_K, kernels.h: q5k_groups_avx512) times int8 activations with AVX512-VNNI's vpdpbusd in
// 256-bit registers (AVX512-VL): one group of 8 rows at a time (q5k_rows.h), as q4k's and q6k's one- and two-row
// loops, here for every batch size. Each nibble half gets its fifth bits in one vpternlogd; vpdpbusd adds the
// exact products of 4 unsigned 5-bit values and 4 signed activation bytes into each row's int32 lane: the integers
// of the AVX2 kernel (q5k_avx2.cpp), so both give the same bits.
#include "kernels.h"
#include "q5k_rows.h"

#include <immintrin.h>

#include <algorithm>

namespace tern {
namespace {

constexpr int kTileRows = 4;  // activation rows sharing each weight load

struct Vnni256 {
  static void five_bits(__m256i packed, __m256i lo_fifth, __m256i hi_fifth, __m256i& lo, __m256i& hi) {
    const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    // a | (b & c): one vpternlogd (0xF8)
    lo = _mm256_ternarylogic_epi32(_mm256_and_si256(packed, low), lo_fifth, fifth, 0xF8);
    hi = _mm256_ternarylogic_epi32(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), hi_fifth, fifth, 0xF8);
  }
  static __m256i dot(__m256i acc, __m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, lo, x_lo), hi, x_hi);
  }
};

}  // namespace

void q5k_groups_avx512(const Q5KProblem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kQ5KSuperBytes;  // 8 rows, all of K
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = p.w + g * group_stride;
    bool first = true;
    for (int64_t m = 0; m < p.M; m += kTileRows, first = false) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: q5k::group_rows<Vnni256, 1>(p, m, wg, g * kInt4GroupRows, first); break;
        case 2: q5k::group_rows<Vnni256, 2>(p, m, wg, g * kInt4GroupRows, first); break;
        case 3: q5k::group_rows<Vnni256, 3>(p, m, wg, g * kInt4GroupRows, first); break;
        default: q5k::group_rows<Vnni256, kTileRows>(p, m, wg, g * kInt4GroupRows, first); break;
      }
    }
  }
}

}  // namespace tern
