// 5-bit weights (GGUF's Q5_K, kernels.h: q5k_groups_avx512) times int8 activations on AVX512-VNNI. Each nibble half
// gets its fifth bits in one vpternlogd, and vpdpbusd adds the exact products of 4 unsigned 5-bit values and 4
// signed activation bytes into each row's int32 lane: the integers of the AVX2 kernel (q5k_avx2.cpp), so both give
// the same bits. Two groups of 8 rows side by side in 512-bit registers, 8 activation rows a tile, at every row count
// (pair_rows, q4k's pair loop with the fifth bits): with the far prefetch (prefetch.h) the pairs read faster than
// one group at a time even at one row (engine/kernels/README.md).
#include "avx512.h"
#include "kernels.h"
#include "kquant_minimums_avx512.h"
#include "prefetch.h"

#include <immintrin.h>

#include <algorithm>

namespace tern {
namespace {

// out[m, rows n0..n0+15] for MB activation rows against groups wa (rows n0..n0+7) and wb (n0+8..n0+15): q5k_rows.h's
// steps in 16 lanes. The results wait in memory during the dots, which leaves registers for 8 rows a tile.
template <int MB>
inline void pair_rows(const Q5KProblem& p, const uint8_t* tile, const uint8_t* wa, const uint8_t* wb, int64_t m0,
                      int64_t n0) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks
  const int64_t group_stride = q.blocks * kQ5KSuperBytes;
  const __m512i low = _mm512_set1_epi8(0x0F), fifth_bit = _mm512_set1_epi8(0x10);
  const __m512i fifteen = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3);
  alignas(64) float result[MB][16] = {};
  for (int64_t s = 0; s < q.blocks; ++s) {
    const uint8_t* sa = wa + s * kQ5KSuperBytes;
    const uint8_t* sb = wb + s * kQ5KSuperBytes;
    const SuperBlockTiles::Unit<MB> x(tile, s);
    const __m512i top_bits = avx512::two_groups(sa + 32, sb + 32);  // a row's top bits: s_j at 2j, m_j at 16 + 2j
    __m512i top = top_bits;
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      // 8 steps a super-block, as q5k_rows.h's
      prefetch_pair_stream<kQ5KGroupBytes>(sa + j * kQ5KGroupBytes, wa + group_stride, group_stride);
      prefetch_pair_stream<kQ5KGroupBytes>(sb + j * kQ5KGroupBytes, wb + group_stride, group_stride);
      const __m512i lows = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 64 + 8 * j)),
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 64 + 8 * j))));
      const __m512i scale = _mm512_or_si512(_mm512_and_si512(lows, fifteen),
                                            _mm512_slli_epi32(_mm512_and_si512(top, three), 4));
      top = _mm512_srli_epi32(top, 2);
      const uint8_t* ca = sa + kQ5KHeaderBytes + j * kQ5KBlockBytes;
      const uint8_t* cb = sb + kQ5KHeaderBytes + j * kQ5KBlockBytes;
      const __m512i fifth = avx512::two_groups(ca + 128, cb + 128);
      __m512i lo_fifth = _mm512_slli_epi16(fifth, 4), hi_fifth = fifth;
      __m512i dot[MB];
      for (int m = 0; m < MB; ++m) dot[m] = _mm512_setzero_si512();
      for (int r = 0; r < 4; ++r) {
        const __m512i packed = avx512::two_groups(ca + 32 * r, cb + 32 * r);
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(packed, low), lo_fifth, fifth_bit, 0xF8);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low), hi_fifth,
                                                     fifth_bit, 0xF8);
        lo_fifth = _mm512_srli_epi16(lo_fifth, 1);
        hi_fifth = _mm512_srli_epi16(hi_fifth, 1);
        for (int m = 0; m < MB; ++m) {
          dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x.x(m)[8 * j + 2 * r]));
          dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x.x(m)[8 * j + 2 * r + 1]));
        }
      }
      for (int m = 0; m < MB; ++m) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(dot[m], scale));
    }
    const __m512 d = avx512::two_fp16_rows(sa, sb);
    for (int m = 0; m < MB; ++m) {
      const __m512 x_scale = _mm512_set1_ps(x.scales()[m]);
      _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]),
                                               _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, x_scale))));
    }
    add_pair_minimums<MB>(x, sa, sb, top_bits, result);
  }
  for (int m = 0; m < MB; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, _mm512_load_ps(result[m]), p.out_bf16);
}

}  // namespace

void q5k_groups_avx512(const Q5KProblem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kQ5KSuperBytes;  // 8 rows, all of K
  if (g0 + 1 < g1) {
    const uint8_t* tiles = super_block_tiles(*p.x, 0, p.M);
    for (; g0 + 1 < g1; g0 += 2) {
      const uint8_t* wa = p.w + g0 * group_stride;
      for_each_tile(0, p.M, [&](auto rows, int64_t m) {
        pair_rows<decltype(rows)::value>(p, tiles + SuperBlockTiles::tile_bytes(*p.x, m), wa, wa + group_stride, m,
                        g0 * kInt4GroupRows);
      });
    }
  }
  if (g0 < g1) q5k_groups_avx2(p, g0, g1);  // an odd group left: the AVX2 kernel, the same bits
}

}  // namespace tern
