// 5-bit weights (GGUF's Q5_K, kernels.h: q5k_groups_avx2) times int8 activations on AVX2: one group of 8 rows in 8
// int32 lanes (q5k_rows.h). vpmaddubsw multiplies the unsigned 5-bit values by the signed activations in int16
// pairs; a register's low and high halves' pairs sum to at most 4 * 31 * 127 = 15,748 in int16 (q4k's sum of a
// whole sub-block's 8 halves would pass 32,767 with 5-bit values), then vpmaddwd widens. The integers and float
// steps are q5k_avx512.cpp's: both kernels give the same bits.
#include "kernels.h"
#include "q5k_rows.h"

#include <algorithm>

namespace tern {
namespace {

constexpr int kTileRows = 4;  // activation rows sharing each weight load

struct Avx2 {
  // The nibbles with their fifth bits: each source holds this register's at bit 4 of every byte.
  static void five_bits(__m256i packed, __m256i lo_fifth, __m256i hi_fifth, __m256i& lo, __m256i& hi) {
    const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(_mm256_and_si256(packed, low), _mm256_and_si256(lo_fifth, fifth));
    hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), _mm256_and_si256(hi_fifth, fifth));
  }
  static __m256i dot(__m256i acc, __m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};

}  // namespace

void q5k_groups_avx2(const Q5KProblem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kQ5KSuperBytes;  // 8 rows, all of K
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = p.w + g * group_stride;
    bool first = true;
    for (int64_t m = 0; m < p.M; m += kTileRows, first = false) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: q5k::group_rows<Avx2, 1>(p, m, wg, g * kInt4GroupRows, first); break;
        case 2: q5k::group_rows<Avx2, 2>(p, m, wg, g * kInt4GroupRows, first); break;
        case 3: q5k::group_rows<Avx2, 3>(p, m, wg, g * kInt4GroupRows, first); break;
        default: q5k::group_rows<Avx2, kTileRows>(p, m, wg, g * kInt4GroupRows, first); break;
      }
    }
  }
}

}  // namespace tern
