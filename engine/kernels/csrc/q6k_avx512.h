// Q6_K's 6-bit values on AVX512 (the q6k layout, kernels.h), shared by the AVX512 and AMX kernels
// (q6k_avx512.cpp, q6k_amx.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "avx512.h"

namespace tern::q6k {

// Nibble register i's 6-bit values, its low and high nibbles: the top bits of an even i sit at bits 0-1 (low) and
// 2-3 (high) of the top-bit register's bytes, of an odd i at 4-5 and 6-7; each pair goes to bits 4-5.
template <bool kOdd>
inline void six_bits(__m512i packed, __m512i highs, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  lo = _mm512_and_si512(packed, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
  // lo | (shifted & top): one vpternlogd (0xF8: a | (b & c))
  if constexpr (kOdd) {
    lo = _mm512_ternarylogic_epi32(lo, highs, top, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi16(highs, 2), top, 0xF8);
  } else {
    lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(highs, 4), top, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi16(highs, 2), top, 0xF8);
  }
}

// Nibble register i of the block at ca (group a) and cb (group b) as 6-bit values, lo and hi, with `highs` the
// top-bit register of its sub-block (i / 2).
inline void register_values(const uint8_t* ca, const uint8_t* cb, __m512i highs, int i, __m512i& lo, __m512i& hi) {
  const __m512i packed = avx512::two_groups(ca + 32 * i, cb + 32 * i);
  if (i % 2 == 0) six_bits<false>(packed, highs, lo, hi);
  else six_bits<true>(packed, highs, lo, hi);
}

}  // namespace tern::q6k
