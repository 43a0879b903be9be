// q6k (kernels.h: GGUF's Q6_K) on Intel AMX-INT8 (kernels.h: q6k_groups_amx) for batches of 16 activation rows
// and more: q6k_avx512.cpp's integers and float step, with each sub-block's dots made by tile multiplies.
//
// Per pair of groups (16 weight rows) and tile of 16 activation rows, in steps of one block of 32 columns, a tile
// multiply per sub-block of 16 columns (amx_tiles.h: tile_steps): A is the activation rows' 16 int8s of the
// sub-block (straight from QuantizedRows), B the 16 weight rows' 6-bit values centred on zero (q - 32, signed
// bytes: tdpbssd), made as the AVX512 loop makes its registers `lo` and `hi` (B's rows 2k and 2k + 1 are nibble
// register 2h + k's), so each dot comes out as sum((q - 32) * xq): the integer the AVX512 loop's vpdpbusd chain
// reaches from -32 * sums16. Read back, each row adds s_j * dot_j in int32 (vpmulld) and, per super-block, takes
// the AVX512 loop's float step: the same bits. The first tile of activation rows unpacks the weights for all of K,
// the others reuse them.
//
// Why per sub-block: Q6_K's scales are int8 per 16 values, and neither they nor the 6-bit values times a part of
// them fit a byte, so no tile can sum more than a sub-block (q4k by scale parts, int4_amx.cpp, cannot be done here).
#include "amx_tiles.h"
#include "avx512.h"
#include "kernels.h"
#include "prefetch.h"
#include "q6k_avx512.h"

#include <immintrin.h>

namespace tern {
namespace {

using amx::kTileRows;

constexpr int64_t kSubBlockCols = 16;
constexpr int64_t kSubBlockTileBytes = kSubBlockCols / 4 * 64;  // tile B: a sub-block's 16 weight rows x 16 columns
constexpr amx::TileShape kSubBlockTiles{kSubBlockCols, kSubBlockCols / 4, kSubBlockTileBytes / kSubBlockCols};

// Block c's 16 weight rows (groups at wa and wb, c counted over all of K) as two B tiles, one per sub-block, each
// value q - 32 as a signed byte.
inline void weight_rows(const uint8_t* wa, const uint8_t* wb, int64_t c, uint8_t* out) {
  const int64_t at = c / 8 * kQ6KSuperBytes + kQ6KHeaderBytes + c % 8 * kQ6KBlockBytes;
  const uint8_t* ca = wa + at;
  const uint8_t* cb = wb + at;
  const __m512i centre = _mm512_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {  // sub-block 2c + h: nibble registers 2h and 2h + 1, top-bit register h
    const __m512i highs = avx512::two_groups(ca + 128 + 32 * h, cb + 128 + 32 * h);
    uint8_t(*rows)[64] = reinterpret_cast<uint8_t(*)[64]>(out + h * kSubBlockTileBytes);
    for (int k = 0; k < 2; ++k) {
      const int i = 2 * h + k;
      __m512i lo, hi;
      q6k::register_values(ca, cb, highs, i, lo, hi);
      _mm512_storeu_si512(rows[2 * k], _mm512_sub_epi8(lo, centre));
      _mm512_storeu_si512(rows[2 * k + 1], _mm512_sub_epi8(hi, centre));
    }
  }
}

// out[m0..m0+15, rows n0..n0+15] against groups wa and wb, q6k_avx512.cpp's pair_rows at 16 rows.
void q6k_tile(const Q6KProblem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, uint8_t* weights, bool unpack,
              int64_t n0) {
  const QuantizedRows& q = *p.x;
  const int64_t group_stride = wb - wa;
  alignas(64) float result[kTileRows][16] = {};
  __m512i isum[kTileRows];
  for (int m = 0; m < kTileRows; ++m) isum[m] = _mm512_setzero_si512();
  auto unpack_step = [&](int64_t c) {  // step c: block c, as the AVX512 loop prefetches it
    prefetch_pair_stream<kQ6KGroupBytes>(wa + c * kQ6KGroupBytes, wa + group_stride, group_stride);
    prefetch_pair_stream<kQ6KGroupBytes>(wb + c * kQ6KGroupBytes, wb + group_stride, group_stride);
    weight_rows(wa, wb, c, weights + c * 2 * kSubBlockTileBytes);
  };
  amx::tile_steps<amx::WeightBytes::kSigned, kSubBlockCols>(
      q, q.values + m0 * q.K, weights, unpack, unpack_step, [&](int64_t c, const int32_t (*dots)[kTileRows][16]) {
        const int64_t s = c / 8;
        const uint8_t* sa = wa + s * kQ6KSuperBytes;
        const uint8_t* sb = wb + s * kQ6KSuperBytes;
        for (int h = 0; h < 2; ++h) {
          const int j = static_cast<int>(c % 8) * 2 + h;
          const __m512i scale = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 16 + 8 * j)),
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 16 + 8 * j))));
          for (int m = 0; m < kTileRows; ++m)
            isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_load_si512(dots[h][m]), scale));
        }
        if (c % 8 == 7) {  // the super-block's last block: its float step
          const __m512 d = avx512::two_fp16_rows(sa, sb);
          for (int m = 0; m < kTileRows; ++m) {
            const __m512 x_scale = _mm512_set1_ps(q.scales[(m0 + m) * q.blocks + s]);
            _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]),
                                                     _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, x_scale))));
            isum[m] = _mm512_setzero_si512();
          }
        }
      });
  for (int m = 0; m < kTileRows; ++m)
    avx512::store16(p.out, (m0 + m) * p.N + n0, _mm512_load_ps(result[m]), p.out_bf16);
}

}  // namespace

void q6k_groups_amx(const Q6KProblem& p, int64_t g0, int64_t g1) {
  amx::groups(p, g0, g1, p.x->blocks * kQ6KSuperBytes, q6k_tile, q6k_pairs_avx512, q6k_groups_avx2, kSubBlockTiles);
}

}  // namespace tern
