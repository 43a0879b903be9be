// How the AVX512 block kernels keep their weights streaming from memory at one or two activation rows (decode),
// where little arithmetic hides the memory's latency.
//
// The loops over two groups of 8 rows side by side (every AVX512 matmul loop: int4_avx512.cpp, q8_avx512.cpp,
// q5k_avx512.cpp, q6k_avx512.cpp) read two streams at once, and the hardware prefetcher alone ran too little ahead
// of them: a 2-core AMD EPYC AVX512 VM read a 1B model's q4 layers at 22-30 GB/s (its K = 2048 rows make streams of 9 KB) and large
// matrices at 34-42. Each step of those loops now also asks for the lines kL2AheadBytes ahead into L2: 29-31 and
// 41-52 GB/s, 0.72-0.90x the time in one process alternated, and one stream of the 1B Q4_0 file decoded at 61 tok/s
// instead of 45. Anywhere from 3.5 to 18 KB ahead did the same, 2.3 KB less; the far lines asked into L1 instead
// of L2 did worse than none. The loops over one group (one stream: the AVX2 kernels) gained nothing from it on
// that VM (0.97-1.03x) and, compute-bound there, lost 2-6%: they keep only the near request. With it, the AVX512
// pairs read faster than one group at a time even at one row (engine/kernels/README.md: q4k, q5k, q6k).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tern {

constexpr int64_t kL1AheadBytes = 576;   // 4 blocks of 144 bytes (q4)
constexpr int64_t kL2AheadBytes = 4608;  // 32 blocks of 144 bytes

// Prefetch for one step over `step` bytes at `at` of a weight stream read straight on (one group of rows after
// another): the lines kL1AheadBytes ahead, into L1.
template <int64_t kStep>
inline void prefetch_near(const uint8_t* at) {
  for (int64_t line = 0; line < kStep; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at + kL1AheadBytes + line), _MM_HINT_T0);
}

// Prefetch for one step over `step` bytes at `at` of one of a pair loop's two streams: the lines kL1AheadBytes
// ahead into L1 and kL2AheadBytes ahead into L2. The stream ends at `end` (its group of rows), past which the loop
// goes on `gap` bytes further: it reads groups g and g + 1 side by side, then g + 2 and g + 3, so each stream's
// next bytes after its group lie one group further on.
template <int64_t kStep>
inline void prefetch_pair_stream(const uint8_t* at, const uint8_t* end, int64_t gap) {
  const uint8_t* near = at + kL1AheadBytes;
  const uint8_t* far = at + kL2AheadBytes;
  if (near >= end) near += gap;
  if (far >= end) far += gap;
  for (int64_t line = 0; line < kStep; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(near + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(far + line), _MM_HINT_T1);
  }
}

}  // namespace tern
