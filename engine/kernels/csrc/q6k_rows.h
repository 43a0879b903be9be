// The q6k matmul's loop over one group of 8 weight rows in 256-bit registers (kernels.h: q6k): the AVX2 kernel
// (q6k_avx2.cpp) at every row count, and the odd group the AVX512 pair loop (q6k_avx512.cpp) leaves. `Isa` supplies
// the two instruction-set steps: the 6-bit values of a nibble register (six_bits) and the integer dot of 4 activation
// bytes with them (dot); they give the integers the AVX512 kernel gives, so both kernels give the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "avx2.h"
#include "kernels.h"

namespace tern::q6k {

// The weights are prefetched kPrefetchBytes ahead, 210 bytes (a super-block's 1680 / 8) a block of 32 columns:
// stepping by a block's 192 bytes of values would skip each super-block's 144 header bytes, whose lines then
// missed. A group's last blocks prefetch the next group's first (groups lie one after the other).
constexpr int64_t kPrefetchBytes = 4 * kQ6KSuperBytes / 8;

// out[m, rows n0..n0+7] for MB activation rows against one group; `prefetch`: whether to prefetch (the first tile of
// rows reads the weights from memory, the next ones from the cache).
template <class Isa, int MB>
inline void group_rows(const Q6KProblem& p, int64_t m0, const uint8_t* w, int64_t n0, bool prefetch) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks, q.sums16 (int16) per 16 values
  const int64_t per_row = q.K / 16;
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
      for (int h = 0; h < 2; ++h) {  // sub-block j = 2c + h: nibble registers 2h and 2h + 1, top-bit register h
        const int j = 2 * c + h;
        const __m256i highs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 128 + 32 * h));
        __m256i dot[MB];
        for (int m = 0; m < MB; ++m) dot[m] = _mm256_set1_epi32(-32 * q.sums16[(m0 + m) * per_row + s * 16 + j]);
        for (int k = 0; k < 2; ++k) {
          const int i = 2 * h + k;
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * i));
          __m256i lo, hi;
          Isa::six_bits(packed, highs, k == 1, lo, hi);
          for (int m = 0; m < MB; ++m)
            dot[m] = Isa::dot(dot[m], lo, hi, _mm256_set1_epi32(x[m][2 * i]), _mm256_set1_epi32(x[m][2 * i + 1]));
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

}  // namespace tern::q6k
