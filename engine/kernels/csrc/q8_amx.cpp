// q8 (kernels.h: int8 weights with an fp16 scale per 32 values of a row, GGUF's Q8_0) on Intel AMX-INT8
// (kernels.h: q8_groups_amx) for batches of 16 activation rows and more: q8_avx512.cpp's integers and float steps,
// with each block's dots made by a tile multiply.
//
// q8's layout already is tile B's: a group's 32-byte register j (8 weight rows, one per int32 lane, columns
// 4j..4j+3) beside the same register of the next group is B's row j. So a block's 16 weight rows go into tile B
// as 8 rows of two 32-byte copies, the stored q + 128 turned back into q (xor 0x80: signed bytes, tdpbssd), and
// each dot comes out as sum(q * xq), the integer the AVX512 loop's vpdpbusd chain reaches from -128 * sum(xq).
// Read back, each block takes that loop's float step (acc += dot * (d * x_scale)): the same bits. The first tile
// of activation rows copies the weights for all of K, the others reuse them; the pipeline and the walk over pairs
// and tiles are amx_tiles.h's.
#include "amx_tiles.h"
#include "avx512.h"
#include "kernels.h"
#include "prefetch.h"

#include <immintrin.h>

namespace tern {
namespace {

using amx::kTileRows;

constexpr int64_t kBlockTileBytes = 8 * 64;  // tile B: a block's 16 weight rows x 32 columns as bytes
constexpr amx::TileShape kBlockTiles{kQ8GroupCols, 8, kBlockTileBytes / kQ8GroupCols};

// Block c's 16 weight rows (groups at wa and wb) as tile B's 8 rows of signed bytes.
inline void weight_rows(const uint8_t* ca, const uint8_t* cb, uint8_t (*rows)[64]) {
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int j = 0; j < 8; ++j)
    _mm512_storeu_si512(rows[j], _mm512_xor_si512(avx512::two_groups(ca + 32 * j, cb + 32 * j), sign));
}

// out[m0..m0+15, rows n0..n0+15] against groups wa and wb, q8_avx512.cpp's pair_rows at 16 rows.
void q8_tile(const Q8Problem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, uint8_t* weights, bool unpack,
             int64_t n0) {
  const QuantizedRows& q = *p.x;
  const int64_t group_stride = wb - wa;
  __m512 acc[kTileRows];
  for (int m = 0; m < kTileRows; ++m) acc[m] = _mm512_setzero_ps();
  auto unpack_step = [&](int64_t t) {  // step t: blocks 2t and 2t + 1, prefetched as the AVX512 loop does
    for (int64_t c = 2 * t; c < 2 * t + 2; ++c) {
      const uint8_t* ca = wa + c * kQ8GroupBytes;
      const uint8_t* cb = wb + c * kQ8GroupBytes;
      prefetch_pair_stream<kQ8GroupBytes>(ca, wa + group_stride, group_stride);
      prefetch_pair_stream<kQ8GroupBytes>(cb, wb + group_stride, group_stride);
      weight_rows(ca, cb, reinterpret_cast<uint8_t(*)[64]>(weights + c * kBlockTileBytes));
    }
  };
  amx::tile_steps<amx::WeightBytes::kSigned, kQ8GroupCols>(
      q, q.values + m0 * q.K, weights, unpack, unpack_step, [&](int64_t step, const int32_t (*dots)[kTileRows][16]) {
        for (int h = 0; h < 2; ++h) {
          const int64_t c = 2 * step + h;
          const __m512 d = avx512::two_fp16_rows(wa + c * kQ8GroupBytes + 256, wb + c * kQ8GroupBytes + 256);
          for (int m = 0; m < kTileRows; ++m) {
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(q.scales[(m0 + m) * q.blocks + c]));
            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[h][m])), scale));
          }
        }
      });
  for (int m = 0; m < kTileRows; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, acc[m], p.out_bf16);
}

}  // namespace

void q8_groups_amx(const Q8Problem& p, int64_t g0, int64_t g1) {
  // The tiles take blocks two at a time; an odd count (K = 32 * odd) stays on AVX512, the same bits.
  if (p.x->blocks % 2) return q8_groups_avx512(p, g0, g1);
  amx::groups(p, g0, g1, p.x->blocks * kQ8GroupBytes, q8_tile, q8_pairs_avx512, q8_groups_avx2, kBlockTiles);
}

}  // namespace tern
