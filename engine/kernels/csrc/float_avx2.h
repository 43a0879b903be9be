// Float vector operations on AVX2: 8 floats per register, the V that decode_attention.h and silu.h are
// written against (one source for each algorithm, one struct per instruction set).
#pragma once

#include "avx2.h"

#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

namespace tern::floats {

struct Avx2 {
  using Reg = __m256;
  using Mask = __m256i;
  static constexpr int64_t kLanes = 8;
  static constexpr int64_t kAccumulators = 12;  // registers of sums weigh_values keeps (of 16)

  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const uint16_t* p) { return avx2::load8(p, 0, true); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Mask tail_mask(int64_t n) {  // lanes [0, n) of 8
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Reg load_masked(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static void store_masked(float* p, Mask m, Reg v) { _mm256_maskstore_ps(p, m, v); }
  static Reg blend(Mask m, Reg outside, Reg inside) { return _mm256_blendv_ps(outside, inside, _mm256_castsi256_ps(m)); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_add(Reg v) { return avx2::reduce_add(v); }
  static float reduce_max(Reg v) { return avx2::reduce_max(v); }
  // v's low 4 lanes to low[0, n), its high 4 to high[0, n) (n <= 4; high written last where the two are one)
  static void store_half(float* low, float* high, int64_t n, Reg v) {
    const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(n)), _mm_setr_epi32(0, 1, 2, 3));
    _mm_maskstore_ps(low, mask, _mm256_castps256_ps128(v));
    _mm_maskstore_ps(high, mask, _mm256_extractf128_ps(v, 1));
  }
  // lane i of the result = the sum of v[i]'s 8 lanes: 8 horizontal sums in 7 adds of shuffled pairs.
  static Reg sum_each(const Reg (&v)[8]) {
    Reg pairs[4], quads[2];
    for (int i = 0; i < 4; ++i)  // each 128-bit half: v[2i] and v[2i+1]'s lanes {0+2, 1+3} of that half
      pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  // each half: v[4i .. 4i+3], each summed over its lanes of that half
      quads[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                               _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }

  static Reg round_to_bf16(Reg value) {  // to nearest, ties to even, kept as fp32
    const __m256i bits = _mm256_castps_si256(value);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  // exp(x) to ~1 ulp (Cephes' expf polynomial), +inf above ~88.72 as expf. x is clamped to [-87.3, 89]: below, the
  // result would not be a normal float (a softmax's exp(s - max) there is 0 to it); above, it is +inf already.
  static Reg exp(Reg x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(89.0f));
    const Reg n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    Reg y = _mm256_set1_ps(1.9875691500e-4f);
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
      y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    // y * 2^n as y * 2^half * 2^(n - half): n reaches 128, whose 2^n has no float, where y * 2^n overflows to +inf
    // as it should. Each factor is a normal float and the first product exact, so below that it is y * 2^n.
    const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    const auto power_of_two = [](__m256i e) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    };
    return _mm256_mul_ps(_mm256_mul_ps(y, power_of_two(half)), power_of_two(_mm256_sub_epi32(whole, half)));
  }
};

}  // namespace tern::floats
