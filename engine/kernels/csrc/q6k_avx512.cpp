// 6-bit weights (GGUF's Q6_K, kernels.h: q6k_groups_avx512) times int8 activations on AVX512-VNNI: two groups of 8
// rows at a time in 16 int32 lanes, as the 4-bit kernels (int4_avx512.cpp).
//
// Each block of 32 columns is 4 nibble registers and 2 registers of top bits (layouts.pack_q6k); a value is its
// nibble | its 2 top bits << 4, in 0..63, unsigned as vpdpbusd wants it. Per sub-block of 16 columns (2 nibble
// registers) the dot starts at -32 * sums16, so it ends at the exact sum((q - 32) * xq); each row then adds
// s_j * dot in integers (vpmulld), and one float step per super-block follows: llama.cpp's Q6_K x Q8_K.
#include "activation_tiles.h"
#include "avx512.h"
#include "kernels.h"
#include "prefetch.h"
#include "q6k_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace tern {
namespace {

// q6k's activations per super-block of 256 (activation_tiles.h): the integer each of its 16 sub-blocks' dots starts
// from, -32 * the sum of its 16 int8s.
using Q6KTiles = TileLayout<kQ6KSuperCols, 16 * 4>;

const uint8_t* q6k_tiles(const QuantizedRows& q, int64_t m0, int64_t M) {
  return Q6KTiles::interleave(q, m0, M, [&](int64_t row, int64_t s, uint8_t* out) {
    for (int j = 0; j < 16; ++j) {
      const int32_t start = -32 * q.sums16[row * (q.K / 16) + s * 16 + j];
      std::memcpy(out + 4 * j, &start, 4);
    }
  });
}

// out[m, rows n0..n0+15] for MB activation rows (m0.., the tile at `tile`) against groups wa (rows n0..n0+7) and wb
// (n0+8..n0+15).
template <int MB>
inline void pair_rows(const Q6KProblem& p, const uint8_t* tile, const uint8_t* wa, const uint8_t* wb, int64_t m0,
                      int64_t n0) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks
  const int64_t group_stride = q.blocks * kQ6KSuperBytes;
  alignas(64) float result[MB][16] = {};
  for (int64_t s = 0; s < q.blocks; ++s) {
    const uint8_t* sa = wa + s * kQ6KSuperBytes;
    const uint8_t* sb = wb + s * kQ6KSuperBytes;
    const Q6KTiles::Unit<MB> x(tile, s);
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const uint8_t* ca = sa + kQ6KHeaderBytes + c * kQ6KBlockBytes;
      const uint8_t* cb = sb + kQ6KHeaderBytes + c * kQ6KBlockBytes;
      prefetch_pair_stream<kQ6KGroupBytes>(sa + c * kQ6KGroupBytes, wa + group_stride, group_stride);  // as q6k_rows.h
      prefetch_pair_stream<kQ6KGroupBytes>(sb + c * kQ6KGroupBytes, wb + group_stride, group_stride);
      for (int h = 0; h < 2; ++h) {  // sub-block j = 2c + h: nibble registers 2h and 2h + 1, top-bit register h
        const int j = 2 * c + h;
        const __m512i highs = avx512::two_groups(ca + 128 + 32 * h, cb + 128 + 32 * h);
        __m512i dot[MB];
        for (int m = 0; m < MB; ++m) dot[m] = _mm512_set1_epi32(x.template extras<int32_t>(m)[j]);
        for (int k = 0; k < 2; ++k) {
          const int i = 2 * h + k;
          __m512i lo, hi;
          q6k::register_values(ca, cb, highs, i, lo, hi);
          for (int m = 0; m < MB; ++m) {
            dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x.x(m)[8 * c + 2 * i]));
            dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x.x(m)[8 * c + 2 * i + 1]));
          }
        }
        const __m512i scale = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 16 + 8 * j)),
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 16 + 8 * j))));
        for (int m = 0; m < MB; ++m) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(dot[m], scale));
      }
    }
    const __m512 d = avx512::two_fp16_rows(sa, sb);
    for (int m = 0; m < MB; ++m) {
      const __m512 x_scale = _mm512_set1_ps(x.scales()[m]);
      _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]),
                                               _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, x_scale))));
    }
  }
  for (int m = 0; m < MB; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, _mm512_load_ps(result[m]), p.out_bf16);
}

}  // namespace

void q6k_pairs_avx512(const Q6KProblem& p, int64_t m0, int64_t g0, int64_t g1) {
  if (g0 + 1 >= g1) return;
  const int64_t group_stride = p.x->blocks * kQ6KSuperBytes;  // 8 rows, all of K
  const uint8_t* tiles = q6k_tiles(*p.x, m0, p.M);
  for (; g0 + 1 < g1; g0 += 2) {
    const uint8_t* wa = p.w + g0 * group_stride;
    for_each_tile(m0, p.M, [&](auto rows, int64_t m) {
      pair_rows<decltype(rows)::value>(p, tiles + Q6KTiles::tile_bytes(*p.x, m - m0), wa, wa + group_stride, m,
                                       g0 * kInt4GroupRows);
    });
  }
}

void q6k_groups_avx512(const Q6KProblem& p, int64_t g0, int64_t g1) {
  const int64_t paired_end = g0 + (g1 - g0) / 2 * 2;
  q6k_pairs_avx512(p, 0, g0, paired_end);
  if (paired_end < g1) q6k_groups_avx2(p, paired_end, g1);  // an odd group left: the AVX2 kernel, the same bits
}

}  // namespace tern
