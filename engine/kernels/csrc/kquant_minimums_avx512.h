// The minimums' pass of the AVX512 pair loops of q4k and q5k (int4_avx512.cpp, q5k_avx512.cpp): both layouts start
// each super-block with Q4_K's header (the rows' d and dmin, then the 6-bit scales' and minimums' bits), so the
// pass is one. Per pair of sub-blocks (2k, 2k + 1) a lane's m_2k | m_2k+1 << 16 against the activations' two int16
// sums, one vpmaddwd; then the second float step, result[m] += msum * (-dmin) * x_scale.
#pragma once

#include "activation_tiles.h"
#include "avx512.h"
#include "kernels.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tern {

// q4k's and q5k's activations per super-block of 256 (activation_tiles.h): each row's 8 int16 sums of 32 values.
using SuperBlockTiles = TileLayout<kQ4KSuperCols, 16>;

inline const uint8_t* super_block_tiles(const QuantizedRows& q, int64_t m0, int64_t M) {
  return SuperBlockTiles::interleave(q, m0, M, [&](int64_t row, int64_t s, uint8_t* out) {
    std::memcpy(out, q.sums32 + row * (q.K / kInt4GroupCols) + s * 8, 16);
  });
}

// The two groups' minimums of super-block s as int16 pairs, m_2k | m_2k+1 << 16 in pairs[k] (sa, sb: the groups'
// super-block; top_bits: their top bits, avx512::two_groups(sa + 32, sb + 32)).
inline void pair_minimums(const uint8_t* sa, const uint8_t* sb, __m512i top_bits, __m512i* pairs) {
  const __m512i three = _mm512_set1_epi32(3);
  for (int k = 0; k < 4; ++k) {
    const __m512i first = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 64 + 16 * k)),
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 64 + 16 * k))));
    const __m512i second = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 72 + 16 * k)),
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 72 + 16 * k))));
    const __m512i m_first = _mm512_or_si512(_mm512_srli_epi32(first, 4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(top_bits, _mm_cvtsi32_si128(16 + 4 * k)), three), 4));
    const __m512i m_second = _mm512_or_si512(_mm512_srli_epi32(second, 4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(top_bits, _mm_cvtsi32_si128(18 + 4 * k)), three), 4));
    pairs[k] = _mm512_or_si512(m_first, _mm512_slli_epi32(m_second, 16));
  }
}

// -dmin of the two groups' super-block, in the lanes of their rows.
inline __m512 negative_dmin(const uint8_t* sa, const uint8_t* sb) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(avx512::two_fp16_rows(sa + 16, sb + 16)),
                                              _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// result[m] (row R0 + m of the tile, rows R0..R0 + R - 1) += msum * (-dmin * x_scale), msum = sum_k pairs[k] x the
// row's sums of 32 (x: super-block s of the activations' tile, its int16 sums first in each row's extras).
template <int MB, int R0, int R, typename Unit>
inline void add_minimums(const Unit& x, const __m512i* pairs, __m512 negative_dmin, float (*result)[16]) {
  for (int m = 0; m < R; ++m) {
    const int32_t* sums = x.template extras<int32_t>(R0 + m);  // int16 pairs
    __m512i msum = _mm512_madd_epi16(pairs[0], _mm512_set1_epi32(sums[0]));
    for (int k = 1; k < 4; ++k) msum = _mm512_dpwssd_epi32(msum, pairs[k], _mm512_set1_epi32(sums[k]));
    const __m512 x_scale = _mm512_set1_ps(x.scales()[R0 + m]);
    _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]),
        _mm512_mul_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(negative_dmin, x_scale))));
  }
}

template <int MB, int R0 = 0, int R = MB>
inline void add_pair_minimums(const SuperBlockTiles::Unit<MB>& x, const uint8_t* sa, const uint8_t* sb,
                              __m512i top_bits, float (*result)[16]) {
  __m512i pairs[4];
  pair_minimums(sa, sb, top_bits, pairs);
  add_minimums<MB, R0, R>(x, pairs, negative_dmin(sa, sb), result);
}

}  // namespace tern
