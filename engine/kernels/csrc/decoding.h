// How a pass of a loop over activation rows takes a weight block's decoded form (split nibbles, unpacked scales):
// the pair loops of the AVX512 kernels (activation_tiles.h) and the AVX2 q4k and q6k loops decode a block once for
// all their tiles of rows, where decoding it again for each tile cost more instructions than the multiplies.
#pragma once

namespace tern {

// What a pass of a K-quant pair loop (q4k, q6k) does with its weights' decoded form: decode them and keep them for
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

}  // namespace tern
