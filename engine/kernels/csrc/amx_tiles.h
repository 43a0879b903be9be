// The Intel AMX-INT8 machinery the tile kernels share (int4_amx.cpp: q4, q4k; q6k_amx.cpp: q6k): the tile
// configuration, the pipeline of tile multiplies over K for one tile of 16 activation rows against one pair of
// weight groups (16 weight rows), and the walk over the pairs and tiles of a matmul. Each kernel brings its own
// unpacking of the weights into tile B's bytes and its own read-back of the dots, which are its AVX512 loop's
// integers: the tile kernels give their AVX512 loops' bits.
//
// A tile load waits for the stores it reads until they retire, so the work is pipelined: a step's weights are
// unpacked a step before their tile loads, its dots stored a step after its multiplies and read back a step after
// that. Without it the AMX kernels were no faster than the AVX512 ones.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace tern::amx {

constexpr int kTileRows = 16;  // activation rows a tile multiply takes (AMX's most)

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 to 3 the dots (16 activation rows x 16 int32), 4 and 5 the activations (16 rows x `activation_cols`
// int8), 6 and 7 the weights (`weight_rows` rows of 16 x 4 bytes). By blocks (tile_steps): a step's two blocks' dots
// (even steps in 0 and 1, odd ones in 2 and 3), activations of one block each, weights of one block each. q4k by
// scale parts lays them out its own way (int4_amx.cpp).
struct TileShape {
  int activation_cols, weight_rows;
  int64_t weight_bytes_per_column;  // of the unpacked weights a pair of groups keeps for all of K
};

inline void configure_tiles(const TileShape& shape) {
  alignas(64) TileConfig config;
  for (int t = 0; t < 4; ++t) config.rows[t] = kTileRows, config.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) config.rows[t] = kTileRows, config.colsb[t] = shape.activation_cols;
  for (int t = 6; t < 8; ++t) config.rows[t] = shape.weight_rows, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// How a kernel's weights sit in tile B: as unsigned bytes (tdpbsud: signed activations times unsigned weights) or
// signed ones (tdpbssd), e.g. centred on zero so that a dot comes out of the tile with no correction to add.
enum class WeightBytes { kUnsigned, kSigned };

// Tile `dots` += tile `activations` x tile `weights`, the weights' bytes as kBytes says. A macro: GCC's tile
// intrinsics paste their operands into the instruction's text, so they take literal tile numbers only.
#define TERN_TILE_DOT(dots, activations, weights)                                                \
  do {                                                                                            \
    if constexpr (kBytes == WeightBytes::kSigned) _tile_dpbssd(dots, activations, weights);      \
    else _tile_dpbsud(dots, activations, weights);                                                \
  } while (0)

// The tile pipeline over all of K for one tile of activation rows (x: its first, row stride K) against one pair of
// groups, in steps of two blocks of kBlockCols columns, a block's weights kBlockCols / 4 rows of tile B (16 weight
// rows x 4 bytes each). Step t calls unpack_step(t + 1) to put step t + 1's weights at `weights` (when `unpack`;
// else they are there: an earlier tile of activation rows unpacked them), multiplies its own, stores step t - 1's
// dots and calls read_back(t - 2, dots): dots[h][m][i] is block 2 (t - 2) + h's dot of activation row m and weight
// row i.
template <WeightBytes kBytes, int64_t kBlockCols, class UnpackStep, class ReadBack>
inline void tile_steps(const QuantizedRows& q, const int8_t* x, const uint8_t* weights, bool unpack,
                       UnpackStep&& unpack_step, ReadBack&& read_back) {
  constexpr int64_t kBlockTileBytes = kBlockCols / 4 * 64;
  alignas(64) int32_t dots[2][2][kTileRows][16];  // [step % 2][block of the step]
  const int64_t steps = q.K / (2 * kBlockCols);
  if (unpack) unpack_step(0);
  for (int64_t t = 0; t <= steps + 1; ++t) {
    if (unpack && t + 1 < steps) unpack_step(t + 1);
    if (t < steps) {  // step t's multiplies: into tiles 0, 1 (even steps) or 2, 3 (odd)
      const int8_t* xt = x + t * 2 * kBlockCols;
      const uint8_t* bt = weights + t * 2 * kBlockTileBytes;
      _tile_loadd(4, xt, q.K);
      _tile_loadd(6, bt, 64);
      _tile_loadd(5, xt + kBlockCols, q.K);
      _tile_loadd(7, bt + kBlockTileBytes, 64);
      if (t % 2 == 0) {
        _tile_zero(0);
        TERN_TILE_DOT(0, 4, 6);
        _tile_zero(1);
        TERN_TILE_DOT(1, 5, 7);
      } else {
        _tile_zero(2);
        TERN_TILE_DOT(2, 4, 6);
        _tile_zero(3);
        TERN_TILE_DOT(3, 5, 7);
      }
    }
    if (t >= 1 && t - 1 < steps) {  // step t - 1's dots, done by now, into memory
      if ((t - 1) % 2 == 0) {
        _tile_stored(0, dots[0][0], 64);
        _tile_stored(1, dots[0][1], 64);
      } else {
        _tile_stored(2, dots[1][0], 64);
        _tile_stored(3, dots[1][1], 64);
      }
    }
    if (t >= 2) read_back(t - 2, dots[t % 2]);
  }
}

#undef TERN_TILE_DOT

using TileFn = void (*)(const Int4Problem&, int64_t, const uint8_t*, const uint8_t*, uint8_t*, bool, int64_t);
using PairsFn = void (*)(const Int4Problem&, int64_t, int64_t, int64_t);
using GroupsFn = void (*)(const Int4Problem&, int64_t, int64_t);

// Groups [g0, g1) of 8 weight rows: pairs by `tile` (p, m0, wa, wb, weights, unpack, n0) for every full tile of 16
// activation rows, the rows past them by `pairs` (AVX512), an odd group by `odd` (AVX2).
inline void groups(const Int4Problem& p, int64_t g0, int64_t g1, int64_t group_stride, TileFn tile, PairsFn pairs,
                   GroupsFn odd, const TileShape& shape) {
  const int64_t paired_end = g0 + (g1 - g0) / 2 * 2, full_tiles = p.M / kTileRows * kTileRows;
  if (full_tiles > 0 && g0 < paired_end) {
    configure_tiles(shape);  // the tile configuration is per thread
    // A pair's weights as tile rows: unpacked by its first tile of activation rows, for all of them.
    thread_local std::vector<uint8_t> weights;
    weights.resize(p.x->K * shape.weight_bytes_per_column);
    for (int64_t g = g0; g < paired_end; g += 2) {
      const uint8_t* wa = p.w + g * group_stride;
      const uint8_t* wb = wa + group_stride;
      for (int64_t m = 0; m < full_tiles; m += kTileRows)
        tile(p, m, wa, wb, weights.data(), m == 0, g * kInt4GroupRows);
    }
    _tile_release();
  }
  if (full_tiles < p.M && g0 < paired_end) pairs(p, full_tiles, g0, paired_end);  // rows past the tiles
  if (paired_end < g1) odd(p, paired_end, g1);  // an odd group left: the AVX2 kernel, the same bits
}

}  // namespace tern::amx
