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

// One thread's share of a parallel region's work, [front, back), in one word so that its owner (from the front)
// and a thread done early (from the back) claim chunks of it with one compare-and-swap each.
struct alignas(64) Share {
  std::atomic<uint64_t> ends{0};  // front in the low 32 bits, back in the high 32

  void set(int64_t front, int64_t back) { ends.store(static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front), std::memory_order_relaxed); }
  // The next `chunk` from the front (owner) or from the back (a helper); false once the share is used up.
  bool claim(int64_t chunk, bool from_back, int64_t& i0, int64_t& i1) {
    uint64_t v = ends.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(v & 0xffffffffu), back = static_cast<int64_t>(v >> 32);
      if (front >= back) return false;
      i0 = from_back ? std::max(front, back - chunk) : front;
      i1 = from_back ? back : std::min(back, front + chunk);
      const uint64_t next = from_back ? static_cast<uint64_t>(i0) << 32 | static_cast<uint64_t>(front) :
                                        static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(i1);
      if (ends.compare_exchange_weak(v, next, std::memory_order_relaxed)) return true;
    }
  }
};

// run(i0, i1) over [0, count) for a step of `rows` activation rows: how the matmuls and attention share the threads.
// Fewer rows (decode of a few streams): the matmuls are bound by memory, and each thread reads one contiguous share
// front to back, as at::parallel_for's halves do (chunks dealt from one counter cost one stream ~5%: each thread's read
// broken into pieces). But a share whose thread started late or was interrupted (by the thread that runs Python, or a
// neighbour on the host) held the other at the end of every region, so a thread done with its own share takes chunks
// from the back of one still running, a 1/16 of a share at a time; neither thread's read is broken before then.
// With many rows (prefill, a batch of streams) the kernels are bound by their instructions and the work goes out in
// chunks to whichever thread is free: ~1/8 of a thread's share, a multiple of `unit` (the AVX512 matmul loops take 2 or
// 4 groups at a time). A 1,500-token prompt of a 1B Q4_K_M file on a 2-core Ice Lake VM (AVX2) took 0.85x the time, 16
// streams decoded 1.09-1.31x faster. `grain`: the least share (a range no longer than one grain stays on one thread).
constexpr int64_t kChunkedMinRows = 4;
constexpr int64_t kShareChunks = 16;

template <typename Run>
inline void parallel_share(int64_t count, int64_t rows, int64_t grain, int64_t unit, const Run& run) {
  const int64_t threads = at::get_num_threads();
  if (threads == 1 || at::in_parallel_region() || count <= unit || count >= (int64_t{1} << 31))
    return at::parallel_for(0, count, grain, [&](int64_t i0, int64_t i1) { run(i0, i1); });
  if (rows < kChunkedMinRows) {
    // as many shares as at::parallel_for would make halves: none shorter than a grain
    const int64_t least = std::max<int64_t>(grain, 1), n = std::min(threads, (count + least - 1) / least);
    if (n == 1) return run(0, count);
    std::vector<Share> shares(n);
    for (int64_t t = 0; t < n; ++t)
      shares[t].set(count * t / n / unit * unit, t + 1 == n ? count : count * (t + 1) / n / unit * unit);
    const int64_t chunk = std::max<int64_t>(unit, (count / (kShareChunks * n) + unit - 1) / unit * unit);
    at::parallel_for(0, n, 1, [&](int64_t t0, int64_t t1) {
      int64_t i0, i1;
      for (int64_t t = t0; t < t1; ++t)
        while (shares[t].claim(chunk, false, i0, i1)) run(i0, i1);
      for (int64_t k = 1; k < n; ++k)  // then help the others, the next one first
        while (shares[(t0 + k) % n].claim(chunk, true, i0, i1)) run(i0, i1);
    });
    return;
  }
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
