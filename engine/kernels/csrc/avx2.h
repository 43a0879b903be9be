// Small AVX2 helpers shared by the *_avx2.cpp kernels: 8 floats per register, loaded from float32 or bfloat16.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tern::avx2 {

// 8 values from base[index...], float32 or bfloat16 (its bits are the top half of a float32).
inline __m256 load8(const void* base, int64_t index, bool bf16) {
  if (!bf16) return _mm256_loadu_ps(static_cast<const float*>(base) + index);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (finite values): 8 bf16 in 128 bits.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane: [0..3, 0..3]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // lanes 0 and 2: [0..3, 4..7]
}

// 8 results to out[index...], float32 or bfloat16.
inline void store8(void* out, int64_t index, __m256 v, bool bf16) {
  if (bf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + index), to_bf16(v));
  else _mm256_storeu_ps(static_cast<float*>(out) + index, v);
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace tern::avx2
