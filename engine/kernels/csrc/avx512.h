// Small AVX512 helpers shared by the *_avx512.cpp matmul kernels: 16 results stored as float32 or bfloat16.
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

}  // namespace tern::avx512
