// int8 weights with a scale per 32 values (GGUF's Q8_0) times int8 activations on AVX512-VNNI
// (kernels.h: q8_groups_avx512): the int4 AVX512 kernel's loop with bytes for nibbles, and the same integers and
// float steps as q8_avx2.cpp.
//
// Each 512-bit register holds one 32-byte register of group g (low half) and the same one of group g + 1 (high
// half): 16 rows, one per int32 lane, 4 columns each, stored as q + 128. vpdpbusd multiplies those unsigned bytes
// by 4 signed activation bytes broadcast to every lane; subtracting 128 * sum(xq) then leaves sum(q * xq), exact
// (at most 32 * 255 * 127 before the subtraction).
#include "activation_tiles.h"
#include "avx512.h"
#include "kernels.h"
#include "prefetch.h"

#include <immintrin.h>

#include <algorithm>

namespace tern {
namespace {

// out[m, rows n0..n0+15] for MB activation rows (m0.., the tile at `tile`) against groups wa (rows n0..n0+7) and
// wb (n0+8..n0+15).
template <int MB>
inline void pair_rows(const Q8Problem& p, int64_t m0, const uint8_t* tile, const uint8_t* wa, const uint8_t* wb,
                      int64_t n0) {
  const QuantizedRows& q = *p.x;
  const int64_t group_stride = q.blocks * kQ8GroupBytes;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < q.blocks; ++c) {
    const uint8_t* ca = wa + c * kQ8GroupBytes;
    const uint8_t* cb = wb + c * kQ8GroupBytes;
    prefetch_pair_stream<kQ8GroupBytes>(ca, wa + group_stride, group_stride);
    prefetch_pair_stream<kQ8GroupBytes>(cb, wb + group_stride, group_stride);
    const Per32Tiles::Unit<MB> x(tile, c);
    __m512i dot[MB];
    for (int m = 0; m < MB; ++m) dot[m] = _mm512_set1_epi32(*x.template extras<int32_t>(m));
    for (int j = 0; j < 8; ++j) {
      const __m512i w = avx512::two_groups(ca + 32 * j, cb + 32 * j);
      for (int m = 0; m < MB; ++m) dot[m] = _mm512_dpbusd_epi32(dot[m], w, _mm512_set1_epi32(x.x(m)[j]));
    }
    const __m512 d = avx512::two_fp16_rows(ca + 256, cb + 256);
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(x.scales()[m]))));
  }
  for (int m = 0; m < MB; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, acc[m], p.out_bf16);
}

}  // namespace

void q8_pairs_avx512(const Q8Problem& p, int64_t m0, int64_t g0, int64_t g1) {
  if (g0 + 1 >= g1) return;
  const int64_t group_stride = p.x->blocks * kQ8GroupBytes;  // one group of 8 rows, all of K
  const uint8_t* tiles = per32_tiles(*p.x, m0, p.M, -128);
  for (; g0 + 1 < g1; g0 += 2) {
    const uint8_t* wa = p.w + g0 * group_stride;
    for_each_tile(m0, p.M, [&](auto rows, int64_t m) {
      pair_rows<decltype(rows)::value>(p, m, tiles + Per32Tiles::tile_bytes(*p.x, m - m0), wa, wa + group_stride,
                                       g0 * kQ8GroupRows);
    });
  }
}

void q8_groups_avx512(const Q8Problem& p, int64_t g0, int64_t g1) {
  const int64_t paired_end = g0 + (g1 - g0) / 2 * 2;
  q8_pairs_avx512(p, 0, g0, paired_end);
  if (paired_end < g1) q8_groups_avx2(p, paired_end, g1);  // an odd group left: the AVX2 kernel, the same bits
}

}  // namespace tern
