// Small AVX512 helpers shared by the *_avx512.cpp matmul kernels: 16 results stored as float32 or bfloat16, and
// the block layouts' (int4, q8) two groups of 8 rows side by side in one register.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tern::avx512 {

// Round to nearest even, as torch's float -> bfloat16 conversion does (finite values).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

// 16 results to out[index...], float32 or bfloat16.
inline void store16(void* out, int64_t index, __m512 v, bool bf16) {
  if (bf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + index), to_bf16(v));
  else _mm512_storeu_ps(static_cast<float*>(out) + index, v);
}

// One 32-byte register of group a (low half) and the same one of group b (high half): 16 rows, one per int32 lane.
inline __m512i two_groups(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// The 8 fp16 values of group a and the 8 of group b as 16 floats, in the lanes of their rows.
inline __m512 two_fp16_rows(const uint8_t* a, const uint8_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

}  // namespace tern::avx512
