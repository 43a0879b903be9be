// Activations to int8 per block (kernels.h: quantize_rows_avx2), for the int8 and int4 kernels of every
// instruction set: its operations are exact, so any implementation gives the same bits.
#include "avx2.h"
#include "kernels.h"

namespace tern {
namespace {

// 32 int32 values (4 registers) -> 32 int8, in order; the values are within [-127, 127].
inline __m256i narrow(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);  // int16, 128-bit lanes interleaved
  const __m256i bytes = _mm256_packs_epi16(ab, cd);
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline int32_t reduce_add(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
}

}  // namespace

void quantize_rows_avx2(const void* x, bool bf16, int64_t m0, int64_t m1, const QuantizedRows& q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < q.blocks; ++b) {
      const int64_t base = m * q.K + b * q.block;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t i = 0; i < q.block; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, avx2::load8(x, base + i, bf16)));
      const float absmax = avx2::reduce_max(amax);
      // cvtps_epi32 rounds to nearest even in the default MXCSR mode, as torch.round does.
      const __m256 inv = _mm256_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t i = 0; i < q.block; i += 32) {
        __m256i v[4], sum32 = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(avx2::load8(x, base + i + 8 * j, bf16), inv));
          sum32 = _mm256_add_epi32(sum32, v[j]);
        }
        sum = _mm256_add_epi32(sum, sum32);
        if (q.sums32) q.sums32[(base + i) / 32] = static_cast<int16_t>(reduce_add(sum32));
        if (q.sums16) {
          q.sums16[(base + i) / 16] = static_cast<int16_t>(reduce_add(_mm256_add_epi32(v[0], v[1])));
          q.sums16[(base + i) / 16 + 1] = static_cast<int16_t>(reduce_add(_mm256_add_epi32(v[2], v[3])));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.values + base + i), narrow(v[0], v[1], v[2], v[3]));
      }
      q.sums[m * q.blocks + b] = reduce_add(sum);
      q.scales[m * q.blocks + b] = absmax / 127.f;
      q.sum_scales[m * q.blocks + b] = q.scales[m * q.blocks + b] * static_cast<float>(q.sums[m * q.blocks + b]);
      if (q.q4_offsets)  // at most 8 * 32 * 127 = 32,512 in magnitude: an int16
        q.q4_offsets[m * q.blocks + b] = static_cast<uint16_t>(static_cast<int16_t>(-8 * q.sums[m * q.blocks + b]));
    }
}

}  // namespace tern
