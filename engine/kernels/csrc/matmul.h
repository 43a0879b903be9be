// The block-layout matmuls on raw pointers, threaded with at::parallel_for: what ops.cpp's operators and
// decode_step.cpp's fused layers both call. Activations are quantized first (once per call), then the weight
// groups are split across threads. `out_stride` (default N): the output's row stride, where a layer's part writes
// its columns of a wider output (the kernels' Problem.N is only ever that stride).
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstring>

#include <vector>

#include "kernels.h"

namespace tern {

using Int4Groups = void (*)(const Int4Problem&, int64_t, int64_t);
using AttentionTasks = void (*)(const AttentionProblem&, int64_t, int64_t);

// Reusable buffers for quantized activations (resized, never shrunk).
struct QuantizedScratch {
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<int32_t> sums;
  std::vector<float> sum_scales;
  std::vector<int16_t> sums32;  // at most 32 * 127 in magnitude
  std::vector<int16_t> sums16;
  std::vector<int32_t> q4_offsets;

  // with_sums32 / with_sums16: also the sum of every 32 (q4k) or 16 (q6k) values' int8s (activations in blocks of 256).
  QuantizedRows quantize(const void* x, bool bf16, int64_t M, int64_t K, int64_t block, bool with_sums32 = false,
                         bool with_sums16 = false) {
    values.resize(M * K);
    scales.resize(M * K / block);
    sums.resize(M * K / block);
    sum_scales.resize(M * K / block);
    if (with_sums32) sums32.resize(M * K / 32);
    if (with_sums16) sums16.resize(M * K / 16);
    const bool per32 = block == kInt4GroupCols;
    if (per32) q4_offsets.resize(M * K / block);
    QuantizedRows rows{K, block, K / block, values.data(), scales.data(), sums.data(), sum_scales.data(),
                       with_sums32 ? sums32.data() : nullptr, with_sums16 ? sums16.data() : nullptr,
                       per32 ? q4_offsets.data() : nullptr};
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { quantize_rows_avx2(x, bf16, m0, m1, rows); });
    return rows;
  }
};

// How a kernel wants its activations quantized (kernels.h): per `block` values, with the sums of every 32 (q4k) or
// 16 (q6k) values' int8s where it reads them.
struct ActivationBlocks {
  int64_t block;
  bool sums32 = false, sums16 = false;
};
inline constexpr ActivationBlocks kPer32Activations{kInt4GroupCols};  // int4, q4, q8
inline constexpr ActivationBlocks kQ4KActivations{kQ4KSuperCols, true, false};  // q4k and q5k
inline constexpr ActivationBlocks kQ6KActivations{kQ6KSuperCols, false, true};

// run(i0, i1) over [0, count) for a step of `rows` activation rows: how the matmuls and attention share the threads.
// Fewer rows: at::parallel_for's halves, `grain` its least share (a range no longer than one grain stays on one thread).
// With many rows (prefill, a batch of streams) the kernels are bound by their instructions, and at::parallel_for's
// fixed halves left whichever core ran slower that moment (the one that also runs Python, an interrupt, a neighbour on
// the host) holding the other at the end of every parallel region, so there the work goes out in chunks to whichever
// thread is free: ~1/8 of a thread's share, a multiple of `unit` (the AVX512 matmul loops take 2 or 4 groups at a
// time). A 1,500-token prompt of a 1B Q4_K_M file on a 2-core Ice Lake VM (AVX2) took 0.85x the time, 16 streams
// decoded 1.09-1.31x faster. At fewer rows the matmuls are bound by memory, and a thread done early leaves the other
// the whole bandwidth, so halves lose nothing there; chunks cost one stream ~5% (each thread's read broken into
// pieces), so those keep the halves.
constexpr int64_t kChunkedMinRows = 4;

template <typename Run>
inline void parallel_share(int64_t count, int64_t rows, int64_t grain, int64_t unit, const Run& run) {
  const int64_t threads = at::get_num_threads();
  if (rows < kChunkedMinRows || threads == 1 || at::in_parallel_region() || count <= unit)
    return at::parallel_for(0, count, grain, [&](int64_t i0, int64_t i1) { run(i0, i1); });
  const int64_t chunk = std::max<int64_t>(1, (count / (8 * threads) + unit - 1) / unit) * unit;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(chunk, std::memory_order_relaxed)) < count;)
      run(i0, std::min(count, i0 + chunk));
  });
}

// out [M, N] = x [M, K] @ w.T for a weight packed per 8 rows (int4, q4, q4k, q5k, q6k or q8, as `groups` reads it), its
// activations quantized as `activations` says.
inline void block_matmul(Int4Groups groups, ActivationBlocks activations, QuantizedScratch& scratch, const void* x,
                         bool x_bf16, int64_t M, int64_t K, const uint8_t* w, int64_t N, void* out,
                         int64_t out_stride = 0) {
  if (M == 0) return;
  const QuantizedRows q = scratch.quantize(x, x_bf16, M, K, activations.block, activations.sums32, activations.sums16);
  const Int4Problem p{&q, M, out_stride ? out_stride : N, w, out, x_bf16};
  parallel_share(N / kInt4GroupRows, M, 8, 4, [&](int64_t g0, int64_t g1) { groups(p, g0, g1); });
}

// Consecutive rows whose contexts are prefixes of one another's (a prompt run as decode rows, one position each:
// engine/decode/runner.py) attend as one tile of up to kAttentionTileRows, reading each key and value once for all
// of them; rows of different sequences (a decode step) are tiles of one row. Each row's arithmetic is the same
// either way (decode_attention.h: attend_tile).
constexpr int64_t kAttentionTileRows = 16;

inline std::vector<int64_t> attention_tiles(const AttentionProblem& p) {
  std::vector<int64_t> starts{0};
  for (int64_t b = 1; b < p.B; ++b) {
    const int64_t previous = std::min(p.lengths[b - 1], p.L), length = std::min(p.lengths[b], p.L);
    const bool extends_previous = b - starts.back() < kAttentionTileRows && length >= previous &&
                                  std::memcmp(p.slots + b * p.L, p.slots + (b - 1) * p.L, previous * sizeof(int64_t)) == 0;
    if (!extends_previous) starts.push_back(b);
  }
  starts.push_back(p.B);
  return starts;
}

inline void decode_attention(AttentionTasks tasks, const AttentionProblem& problem) {
  const std::vector<int64_t> tiles = attention_tiles(problem);
  AttentionProblem p = problem;
  p.tiles = tiles.data();
  p.num_tiles = static_cast<int64_t>(tiles.size()) - 1;
  parallel_share(p.num_tiles * p.Hkv, p.B, 1, 1, [&](int64_t t0, int64_t t1) { tasks(p, t0, t1); });
}

}  // namespace tern
