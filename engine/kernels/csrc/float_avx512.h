// Float vector operations on AVX512: 16 floats per register, the V that decode_attention.h and silu.h are
// written against (one source for each algorithm, one struct per instruction set).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

namespace tern::floats {

struct Avx512 {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static constexpr int64_t kAccumulators = 24;  // registers of sums weigh_values keeps (of 32)

  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const uint16_t* p) {  // bf16 -> fp32: the bits, shifted into the top half
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Mask tail_mask(int64_t n) { return static_cast<Mask>((1u << n) - 1); }  // lanes [0, n) of 16
  static Reg load_masked(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_masked(float* p, Mask m, Reg v) { _mm512_mask_storeu_ps(p, m, v); }
  static Reg blend(Mask m, Reg outside, Reg inside) { return _mm512_mask_blend_ps(m, outside, inside); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(Reg v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(Reg v) { return _mm512_reduce_max_ps(v); }
  // v's low 8 lanes to low[0, n), its high 8 to high[0, n) (n <= 8; high written last where the two are one)
  static void store_half(float* low, float* high, int64_t n, Reg v) {
    const __mmask8 mask = static_cast<__mmask8>((1u << n) - 1);
    _mm256_mask_storeu_ps(low, mask, _mm512_castps512_ps256(v));
    _mm256_mask_storeu_ps(high, mask, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  // lane i of the result = the sum of v[i]'s 16 lanes: 16 horizontal sums in 15 adds of shuffled pairs (a
  // reduce_add each would take 4 shuffles and 4 adds of one register at a time).
  static Reg sum_each(const Reg (&v)[16]) {
    Reg pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i)  // 128-bit block b: v[2i] and v[2i+1]'s lanes {0+2, 1+3} of that block
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // block b: v[4i .. 4i+3], each summed over its lanes of that block
      quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)  // blocks {v[8i..8i+3] of blocks 0+1, 2+3; v[8i+4..8i+7] of blocks 0+1, 2+3}
      halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
  }

  static Reg round_to_bf16(Reg value) {  // to nearest, ties to even, kept as fp32
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  // exp(x) to ~1 ulp (Cephes' expf polynomial, scaled by 2^n with vscalefps), +inf above ~88.72 as expf. x is
  // clamped to [-88, 89]: below, the result would not be a normal float (a softmax's exp(s - max) there is 0 to
  // it); above, it is +inf already.
  static Reg exp(Reg x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(89.0f));
    const Reg n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    Reg y = _mm512_set1_ps(1.9875691500e-4f);
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
      y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
  }
};

}  // namespace tern::floats
