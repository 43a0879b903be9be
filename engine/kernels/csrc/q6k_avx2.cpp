// 6-bit weights (GGUF's Q6_K, kernels.h: q6k_groups_avx2) times int8 activations on AVX2: one group of 8 rows in 8
// int32 lanes. The values and integers are q6k_avx512.cpp's; vpmaddubsw multiplies the unsigned 6-bit values by
// the signed activations in int16 pairs (two registers' pairs sum to at most 4 * 63 * 127 = 32,004: no
// saturation), vpmaddwd widens, and the float step per super-block is the same: both kernels give the same bits.
#include "avx2.h"
#include "kernels.h"

#include <algorithm>

namespace tern {
namespace {

constexpr int kTileRows = 4;  // activation rows sharing each weight load
// The weights are prefetched kPrefetchBytes ahead, 210 bytes (a super-block's 1680 / 8) a block of 32 columns, as
// q6k_avx512.cpp does; a group's last blocks prefetch the next group's first (groups lie one after the other).
constexpr int64_t kPrefetchBytes = 4 * kQ6KSuperBytes / 8;

template <bool kOdd>
inline void six_bits(__m256i packed, __m256i highs, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  lo = _mm256_and_si256(packed, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
  if constexpr (kOdd) {
    lo = _mm256_or_si256(lo, _mm256_and_si256(highs, top));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(highs, 2), top));
  } else {
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(highs, 4), top));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(highs, 2), top));
  }
}

// out[m, rows n0..n0+7] for MB activation rows against one group; `prefetch`: whether to prefetch (the first tile of
// rows reads the weights from memory, the next ones from the cache).
template <int MB>
inline void group_rows(const Q6KProblem& p, int64_t m0, const uint8_t* w, int64_t n0, bool prefetch) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks, q.sums16 (int16) per 16 values
  const int64_t per_row = q.K / 16;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float result[MB][8] = {};
  for (int64_t s = 0; s < q.blocks; ++s) {
    const uint8_t* super = w + s * kQ6KSuperBytes;
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int c = 0; c < 8; ++c) {
      const uint8_t* wc = super + kQ6KHeaderBytes + c * kQ6KBlockBytes;
      if (prefetch)
        for (int line = 0; line < 256; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(super + kPrefetchBytes + c * kQ6KSuperBytes / 8 + line), _MM_HINT_T0);
      const int32_t* x[MB];
      for (int m = 0; m < MB; ++m)
        x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + s * kQ6KSuperCols + c * 32);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        const __m256i highs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 128 + 32 * h));
        __m256i dot[MB];
        for (int m = 0; m < MB; ++m) dot[m] = _mm256_set1_epi32(-32 * q.sums16[(m0 + m) * per_row + s * 16 + j]);
        for (int k = 0; k < 2; ++k) {
          const int i = 2 * h + k;
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * i));
          __m256i lo, hi;
          if (k == 0) six_bits<false>(packed, highs, lo, hi);
          else six_bits<true>(packed, highs, lo, hi);
          for (int m = 0; m < MB; ++m) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[m][2 * i])),
                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[m][2 * i + 1])));
            dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pairs, ones));
          }
        }
        const __m256i scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 16 + 8 * j)));
        for (int m = 0; m < MB; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(dot[m], scale));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super)));
    for (int m = 0; m < MB; ++m) {
      const __m256 x_scale = _mm256_set1_ps(q.scales[(m0 + m) * q.blocks + s]);
      _mm256_store_ps(result[m], _mm256_add_ps(_mm256_load_ps(result[m]),
                                               _mm256_mul_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, x_scale))));
    }
  }
  for (int m = 0; m < MB; ++m) avx2::store8(p.out, (m0 + m) * p.N + n0, _mm256_load_ps(result[m]), p.out_bf16);
}

}  // namespace

void q6k_groups_avx2(const Q6KProblem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kQ6KSuperBytes;  // 8 rows, all of K
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = p.w + g * group_stride;
    bool first = true;
    for (int64_t m = 0; m < p.M; m += kTileRows, first = false) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: group_rows<1>(p, m, wg, g * kInt4GroupRows, first); break;
        case 2: group_rows<2>(p, m, wg, g * kInt4GroupRows, first); break;
        case 3: group_rows<3>(p, m, wg, g * kInt4GroupRows, first); break;
        default: group_rows<kTileRows>(p, m, wg, g * kInt4GroupRows, first); break;
      }
    }
  }
}

}  // namespace tern
