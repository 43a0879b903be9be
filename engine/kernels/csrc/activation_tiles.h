// The activations of the AVX512 pair loops (int4_avx512.cpp: int4, q4, q4k; q8_avx512.cpp; q5k_avx512.cpp;
// q6k_avx512.cpp), tile by tile as the loops read them.
//
// A loop takes a tile of up to 8 activation rows against two groups of 8 weight rows, one unit of columns at a time
// (the block its weights are scaled by: 32 columns, or a super-block of 256). Per unit a tile of r rows holds the
// rows' int8s (row after row), then their r scales, then each row's kExtraBytes of what its kernel adds per unit
// (the integer each dot starts from, the activations' sums). The loops read every row off one pointer at fixed
// offsets, where eight row pointers and their sums took more registers than a loop has: the compiler spilled them
// and issued ~1.5 instructions of addressing per vpdpbusd (a 16-row step of a 1B model's q4 layers: 9.2 -> 7.1 ms on
// a 2-core Zen 5 VM). The integers and float steps are the same, so the bits are too.
#pragma once

#include "decoding.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tern {

constexpr int kTileRows = 8;  // activation rows sharing each weight load

template <int64_t kCols, int64_t kExtraBytes>
struct TileLayout {
  static constexpr int64_t kRowBytes = kCols + 4 + kExtraBytes;  // one row's part of a unit

  // Bytes of a tile of `rows` rows over all of K (units of kCols).
  static int64_t tile_bytes(const QuantizedRows& q, int64_t rows) { return rows * (q.K / kCols) * kRowBytes; }

  // Rows [m0, M) of q in tiles of kTileRows, in this thread's buffer (every weight pair the thread takes reads all
  // of them); the tile starting at row m begins tile_bytes(q, m - m0) bytes in. extras(row, unit, out) writes a
  // row's kExtraBytes for a unit.
  template <typename Extras>
  static const uint8_t* interleave(const QuantizedRows& q, int64_t m0, int64_t M, Extras extras) {
    thread_local std::vector<uint8_t> buffer;
    const int64_t units = q.K / kCols;
    buffer.resize(tile_bytes(q, M - m0));
    for (int64_t t = m0; t < M; t += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, M - t);
      uint8_t* tile = buffer.data() + tile_bytes(q, t - m0);
      for (int64_t u = 0; u < units; ++u) {
        uint8_t* unit = tile + u * rows * kRowBytes;
        float* scales = reinterpret_cast<float*>(unit + rows * kCols);
        for (int64_t m = 0; m < rows; ++m) {
          std::memcpy(unit + m * kCols, q.values + (t + m) * q.K + u * kCols, kCols);
          scales[m] = q.scales[(t + m) * q.blocks + u * kCols / q.block];
          extras(t + m, u, unit + rows * (kCols + 4) + m * kExtraBytes);
        }
      }
    }
    return buffer.data();
  }

  // Unit u of a tile of MB rows.
  template <int MB>
  struct Unit {
    const uint8_t* base;
    Unit(const uint8_t* tile, int64_t u) : base(tile + u * MB * kRowBytes) {}
    // Row m's int8s as 4-byte words: word w holds columns 4w..4w+3 of the unit.
    const int32_t* x(int m) const { return reinterpret_cast<const int32_t*>(base + m * kCols); }
    const float* scales() const { return reinterpret_cast<const float*>(base + MB * kCols); }
    template <typename T>
    const T* extras(int m) const { return reinterpret_cast<const T*>(base + MB * (kCols + 4) + m * kExtraBytes); }
  };
};

// Calls body(std::integral_constant<int, MB>{}, m) for each tile of rows [m0, M): MB its row count, m its first row.
template <typename Body>
inline void for_each_tile(int64_t m0, int64_t M, Body body) {
  for (int64_t m = m0; m < M; m += kTileRows)
    with_rows<kTileRows>(std::min<int64_t>(kTileRows, M - m), [&](auto rows) { body(rows, m); });
}

// int4's, q4's and q8's activations per block of 32: the integer each dot starts from (start_factor * sum: q4 -8,
// q8 -128, int4 0), then int4's minimum factor (scale * sum).
using Per32Tiles = TileLayout<kInt4GroupCols, 8>;

inline const uint8_t* per32_tiles(const QuantizedRows& q, int64_t m0, int64_t M, int32_t start_factor) {
  return Per32Tiles::interleave(q, m0, M, [&](int64_t row, int64_t c, uint8_t* out) {
    const int32_t start = start_factor * q.sums[row * q.blocks + c];
    std::memcpy(out, &start, 4);
    std::memcpy(out + 4, &q.sum_scales[row * q.blocks + c], 4);
  });
}

}  // namespace tern
