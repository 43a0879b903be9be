// The q5k matmul's loop over one group of 8 weight rows in 256-bit registers (kernels.h: q5k): the AVX2 kernel
// (q5k_avx2.cpp) at every row count, and the odd group the AVX512 pair loop (q5k_avx512.cpp) leaves. `Isa` supplies
// the two instruction-set steps: a nibble register's 5-bit values (five_bits) and the integer dot of 4 activation
// bytes with them (dot); they give the integers the AVX512 kernel gives, so both kernels give the same bits. The
// scales, minimums and float steps are q4k's (int4_avx2.cpp, kquant_avx2.h): per super-block the dots, each row's
// isum += s_j * dot_j in integers and one float step; then the minimums as vpmaddwd over int16 pairs and the second
// float step.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "avx2.h"
#include "kernels.h"
#include "kquant_avx2.h"
#include "prefetch.h"

namespace tern::q5k {

// out[m, rows n0..n0+7] for MB activation rows against one group; `prefetch`: whether to prefetch (the first tile of
// rows reads the weights from memory, the next ones from the cache). The prefetch steps 176 bytes a sub-block (a
// super-block's 1408 / 8), not the 160 of its values, so that each super-block's 128 header bytes are asked for too.
template <class Isa, int MB>
inline void group_rows(const Q5KProblem& p, int64_t m0, const uint8_t* w, int64_t n0, bool prefetch) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks, q.sums32 (int16) per 32 values
  const int64_t per_row = q.K / kInt4GroupCols;
  const __m256i fifteen = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3);
  alignas(32) float result[MB][8] = {};
  for (int64_t s = 0; s < q.blocks; ++s) {
    const uint8_t* super = w + s * kQ5KSuperBytes;
    const __m256i top_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 32));  // s_j: 2j, m_j: 16 + 2j
    __m256i top = top_bits;
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      if (prefetch) prefetch_near<kQ5KGroupBytes>(super + j * kQ5KGroupBytes);
      const __m256i lows = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 64 + 8 * j)));
      const __m256i scale = _mm256_or_si256(_mm256_and_si256(lows, fifteen),
                                            _mm256_slli_epi32(_mm256_and_si256(top, three), 4));
      top = _mm256_srli_epi32(top, 2);
      const uint8_t* wc = super + kQ5KHeaderBytes + j * kQ5KBlockBytes;
      // Register r's fifth bits sit at bit r (low nibbles) and 4 + r (high): each source moves them to bit 4, then
      // one position on per register. 16-bit shifts by at most 4 keep every byte's bits in their byte.
      const __m256i fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 128));
      __m256i lo_fifth = _mm256_slli_epi16(fifth, 4), hi_fifth = fifth;
      __m256i dot[MB];
      const int32_t* x[MB];
      for (int m = 0; m < MB; ++m) {
        dot[m] = _mm256_setzero_si256();
        x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + (s * 8 + j) * kInt4GroupCols);
      }
      for (int r = 0; r < 4; ++r) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * r));
        __m256i lo, hi;
        Isa::five_bits(packed, lo_fifth, hi_fifth, lo, hi);
        lo_fifth = _mm256_srli_epi16(lo_fifth, 1);
        hi_fifth = _mm256_srli_epi16(hi_fifth, 1);
        for (int m = 0; m < MB; ++m)
          dot[m] = Isa::dot(dot[m], lo, hi, _mm256_set1_epi32(x[m][2 * r]), _mm256_set1_epi32(x[m][2 * r + 1]));
      }
      for (int m = 0; m < MB; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(dot[m], scale));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super)));
    // The minimums: per pair of sub-blocks (2k, 2k + 1) a lane's m_2k | m_2k+1 << 16 against the activations' two
    // int16 sums, one vpmaddwd.
    __m256i pairs[4];
    for (int k = 0; k < 4; ++k) pairs[k] = kquant::minimum_pair(super, top_bits, k);
    kquant::finish_super_block<MB>(result, isum, d, pairs, kquant::negative_dmin(super), q.scales + m0 * q.blocks + s,
                                   q.blocks, q.sums32 + m0 * per_row + s * 8, per_row);
  }
  for (int m = 0; m < MB; ++m) avx2::store8(p.out, (m0 + m) * p.N + n0, _mm256_load_ps(result[m]), p.out_bf16);
}

}  // namespace tern::q5k
