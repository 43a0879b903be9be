// The walk of the AVX2 K-quant loops (int4_avx2.cpp's q4k, q6k_avx2.cpp) over groups of 8 weight rows: per group,
// a super-block at a time for all the activation rows, in tiles, the first tile decoding it (decoding.h), each row's
// 8 outputs summed in a register's worth of floats across the super-blocks, then stored.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx2.h"
#include "decoding.h"
#include "kernels.h"

namespace tern {

// Groups [g0, g1) of p (kSuperBytes a group's super-block) for every activation row: tile(rows, decoding, m, s,
// super, result + m) per tile of up to kTileRows rows (as for_each_decoded_tile), `super` the group's super-block s
// and result[m] row m's 8 sums. The next group's super-block is prefetched in step, a group ahead: one super-block
// ahead was too near at one row (q4k 30 against 38 GMAC/s).
template <int kTileRows, int64_t kSuperBytes, typename Tile>
inline void walk_super_blocks(const Int4Problem& p, int64_t g0, int64_t g1, Tile tile) {
  const int64_t group_stride = p.x->blocks * kSuperBytes;  // 8 rows, all of K
  // Per activation row its 8 outputs, summed over the super-blocks. Taken as a pointer once: named in the loops, a
  // thread_local is looked up again (__tls_get_addr) at every use.
  thread_local std::vector<__m256> thread_results;
  if (thread_results.size() < static_cast<size_t>(p.M)) thread_results.resize(p.M);
  __m256* const results = thread_results.data();
  float (*result)[8] = reinterpret_cast<float (*)[8]>(results);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = p.w + g * group_stride;
    std::fill(results, results + p.M, _mm256_setzero_ps());
    for (int64_t s = 0; s < p.x->blocks; ++s) {
      const uint8_t* super = wg + s * kSuperBytes;
      if (g + 1 < g1)
        for (int64_t line = 0; line < kSuperBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(super + group_stride + line), _MM_HINT_T0);
      for_each_decoded_tile<kTileRows>(p.M, [&](auto rows, auto decoding, int64_t m) {
        tile(rows, decoding, m, s, super, result + m);
      });
    }
    for (int64_t m = 0; m < p.M; ++m) avx2::store8(p.out, m * p.N + g * kInt4GroupRows, results[m], p.out_bf16);
  }
}

}  // namespace tern
