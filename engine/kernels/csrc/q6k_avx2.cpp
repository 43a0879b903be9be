// 6-bit weights (GGUF's Q6_K, kernels.h: q6k_groups_avx2) times int8 activations on AVX2: one group of 8 rows in 8
// int32 lanes. The values and integers are q6k_avx512.cpp's; vpmaddubsw multiplies the unsigned 6-bit values by
// the signed activations in int16 pairs (two registers' pairs sum to at most 4 * 63 * 127 = 32,004: no
// saturation), vpmaddwd widens, and the float step per super-block is the same: both kernels give the same bits.
#include "kernels.h"
#include "q6k_rows.h"

#include <algorithm>

namespace tern {
namespace {

constexpr int kTileRows = 4;  // activation rows sharing each weight load

// vpmaddubsw's int16 pairs of a nibble register's low and high halves summed (at most 32,004), then vpmaddwd.
struct Avx2 {
  static void six_bits(__m256i packed, __m256i highs, bool odd, __m256i& lo, __m256i& hi) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    lo = _mm256_and_si256(packed, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    const __m256i lo_top = odd ? highs : _mm256_slli_epi16(highs, 4);
    const __m256i hi_top = odd ? _mm256_srli_epi16(highs, 2) : _mm256_slli_epi16(highs, 2);
    lo = _mm256_or_si256(lo, _mm256_and_si256(lo_top, top));
    hi = _mm256_or_si256(hi, _mm256_and_si256(hi_top, top));
  }
  static __m256i dot(__m256i acc, __m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};

}  // namespace

void q6k_groups_avx2(const Q6KProblem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kQ6KSuperBytes;  // 8 rows, all of K
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = p.w + g * group_stride;
    bool first = true;
    for (int64_t m = 0; m < p.M; m += kTileRows, first = false) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: q6k::group_rows<Avx2, 1>(p, m, wg, g * kInt4GroupRows, first); break;
        case 2: q6k::group_rows<Avx2, 2>(p, m, wg, g * kInt4GroupRows, first); break;
        case 3: q6k::group_rows<Avx2, 3>(p, m, wg, g * kInt4GroupRows, first); break;
        default: q6k::group_rows<Avx2, kTileRows>(p, m, wg, g * kInt4GroupRows, first); break;
      }
    }
  }
}

}  // namespace tern
