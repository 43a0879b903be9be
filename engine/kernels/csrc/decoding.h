// How a pass of a loop over activation rows takes a weight block's decoded form (split nibbles, unpacked scales):
// the pair loops of the AVX512 kernels (activation_tiles.h) and the AVX2 q4k and q6k loops decode a block once for
// all their tiles of rows, where decoding it again for each tile took instructions from the ports the multiplies
// need (a load takes none of them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace tern {

// What a pass over a tile of activation rows does with its weights' decoded form: decode them and keep them for
// the passes over the next rows (kKeep), decode them with no pass to follow (kDecode: one tile of rows, where the
// stores would only cost), or load what the first pass kept (kLoad).
enum class Decoding { kKeep, kDecode, kLoad };

// One value of a pass's decoded weights: decode() on the first pass (kept in *slot where kKeep), *slot after.
template <Decoding kDecoding, typename T, typename Decode>
inline T decoded_value(T* slot, Decode decode) {
  if constexpr (kDecoding == Decoding::kLoad) {
    return *slot;
  } else {
    const T value = decode();
    if constexpr (kDecoding == Decoding::kKeep) *slot = value;
    return value;
  }
}

// Calls body(std::integral_constant<int, rows>{}) for 1 <= rows <= kMax: a tile's row count as a constant.
template <int kMax, typename Body>
inline void with_rows(int64_t rows, Body body) {
  if constexpr (kMax > 1)
    if (rows < kMax) return with_rows<kMax - 1>(rows, body);
  body(std::integral_constant<int, kMax>{});
}

// Calls tile(rows, decoding, m) for the tiles of up to kTileRows activation rows of [0, M), m a tile's first row,
// rows its row count and decoding its Decoding, both as std::integral_constant: the first tile decodes the weights
// (and keeps them where more tiles follow), the others load them.
template <int kTileRows, typename Tile>
inline void for_each_decoded_tile(int64_t M, Tile tile) {
  for (int64_t m = 0; m < M; m += kTileRows)
    with_rows<kTileRows>(std::min<int64_t>(kTileRows, M - m), [&](auto rows) {
      if (m > 0) tile(rows, std::integral_constant<Decoding, Decoding::kLoad>{}, m);
      else if (M <= kTileRows) tile(rows, std::integral_constant<Decoding, Decoding::kDecode>{}, m);
      else tile(rows, std::integral_constant<Decoding, Decoding::kKeep>{}, m);
    });
}

}  // namespace tern
