// The K-quant loops' shared steps on AVX2 (int4_avx2.cpp's q4k, q5k_rows.h, q6k_avx2.cpp): Q4_K's and Q5_K's
// minimums and dmin from a super-block's header, and a super-block's float step for one activation row.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tern::kquant {

// Sub-blocks 2k and 2k + 1's minimums in each row's lane as int16 halves, m_2k | m_2k+1 << 16 (one vpmaddwd against
// the activations' two int16 sums): their low 4 bits are the high nibbles of header bytes 64 + 16k and 72 + 16k,
// their top 2 bits at 16 + 4k and 18 + 4k of top_bits (the header's bytes 32..63).
inline __m256i minimum_pair(const uint8_t* super, __m256i top_bits, int k) {
  const __m256i three = _mm256_set1_epi32(3);
  const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 64 + 16 * k)));
  const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 72 + 16 * k)));
  const __m256i m_first = _mm256_or_si256(_mm256_srli_epi32(first, 4),
      _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(top_bits, _mm_cvtsi32_si128(16 + 4 * k)), three), 4));
  const __m256i m_second = _mm256_or_si256(_mm256_srli_epi32(second, 4),
      _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(top_bits, _mm_cvtsi32_si128(18 + 4 * k)), three), 4));
  return _mm256_or_si256(m_first, _mm256_slli_epi32(m_second, 16));
}

// The 8 rows' -dmin (header bytes 16..31, fp16).
inline __m256 negative_dmin(const uint8_t* super) {
  return _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 16))),
                       _mm256_set1_ps(-0.0f));
}

// sums + isum * (scale * x_scale): a super-block's float step for a row's 8 sums.
inline __m256 scaled(__m256 sums, __m256i isum, __m256 scale, __m256 x_scale) {
  return _mm256_add_ps(sums, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(scale, x_scale)));
}

// The end of a Q4_K or Q5_K super-block for MB activation rows: each row's minimums (pairs[k], sub-blocks 2k and
// 2k + 1, against its two int16 sums of them), then its two float steps in the order of kernels.h (scales, then
// minimums) on its sums loaded and stored once. x_scales and x_sums are the first row's at this super-block, rows
// `blocks` scales and `per_row` sums apart: passed in, as after a store through a vector type (which may alias
// anything) the compiler would read the strides from QuantizedRows again for every row.
template <int MB>
inline void finish_super_block(float (*result)[8], const __m256i (&isum)[MB], __m256 d, const __m256i (&pairs)[4],
                               __m256 negative_dmin, const float* x_scales, int64_t blocks, const int16_t* x_sums,
                               int64_t per_row) {
  for (int m = 0; m < MB; ++m) {
    const int32_t* sums = reinterpret_cast<const int32_t*>(x_sums + m * per_row);  // int16 pairs
    __m256i msum = _mm256_madd_epi16(pairs[0], _mm256_set1_epi32(sums[0]));
    for (int k = 1; k < 4; ++k) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(pairs[k], _mm256_set1_epi32(sums[k])));
    const __m256 x_scale = _mm256_set1_ps(x_scales[m * blocks]);
    const __m256 first = scaled(_mm256_load_ps(result[m]), isum[m], d, x_scale);
    _mm256_store_ps(result[m], scaled(first, msum, negative_dmin, x_scale));
  }
}

// result (a row's 8 sums) += isum * (scale * x_scale), in memory.
inline void add_scaled(float* result, __m256i isum, __m256 scale, float x_scale) {
  _mm256_store_ps(result, scaled(_mm256_load_ps(result), isum, scale, _mm256_set1_ps(x_scale)));
}

}  // namespace tern::kquant
