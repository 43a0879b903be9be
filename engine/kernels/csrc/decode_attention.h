// Attention of decode steps (one new query per sequence) straight from the paged KV cache, written once for
// every instruction set: V is a small struct of vector operations (decode_attention_avx2.cpp, _avx512.cpp).
//
//   out[b, h*D:(h+1)*D] = softmax(scale * q[b, h] . K[b]^T) V[b], over the first context_lens[b] positions,
//   K[b][l] = k_cache[context_slots[b, l], h / (H / Hkv)] (grouped-query heads share their KV head)
//
// The plain-PyTorch step gathers every sequence's context into a padded copy and runs two batched matmuls of
// tiny matrices (3 x 64 x ~200 per KV head): ~0.8 ms per layer at 16 sequences on 2 cores, a third of the step.
// Here each (sequence, KV head) pair reads its keys and values once, in place, with its query heads together.
//
// In bf16 it rounds where SDPA's CPU flash kernel rounds, which serves prompts, so a prompt's token and the same
// token decoded agree to fp32 summation order: scores stay fp32 (scaled in fp32), each exp(s - max) is rounded to
// bf16 to weight the values while the sum divides in fp32 at the end, and the output is rounded once. (Rounding
// scores to bf16, as a bf16 matmul does, moved logprobs by ~0.15 nats between prompt and decode.) In fp32 it is
// softmax then the weighted sum, also over a bf16 cache (--kv-cache-dtype: float32 queries, each key and value widened
// as read). Each pair's arithmetic is the same whatever else is in the batch.
#pragma once

#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace tern::attention {

// Rows are scattered over the cache's blocks and each is a few cache lines: without asking ahead, reading
// them waits on memory latency (a 16-sequence step's context came in at ~4 GB/s, not the ~20 the bus gives).
constexpr int64_t kPrefetch = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < D * static_cast<int64_t>(sizeof(T)); offset += 64)
    _mm_prefetch(bytes + offset, _MM_HINT_T0);
}

inline void store_floats(float* p, const float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = values[i];
}
inline void store_floats(uint16_t* p, const float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = round_to_bf16_bits(values[i]);
}

// Applies f to row[0..n) a register at a time, writing its results back, and folds them into `total` with
// `combine`. The tail is loaded and stored under a mask, and its lanes past n leave `total` as it was: zeros
// loaded there must not join a max (they would, for scores that are all negative, and shift the softmax).
template <class V, typename F, typename Combine>
inline typename V::Reg map_row(float* row, int64_t n, typename V::Reg total, F f, Combine combine) {
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    const typename V::Reg result = f(V::load(row + i));
    V::store(row + i, result);
    total = combine(total, result);
  }
  if (i < n) {
    const typename V::Mask mask = V::tail_mask(n - i);
    const typename V::Reg result = f(V::load_masked(row + i, mask));
    V::store_masked(row + i, mask, result);
    total = V::blend(mask, total, combine(total, result));
  }
  return total;
}

// A thread's working memory, reused by every pair it attends to.
struct Scratch {
  std::vector<float> query, scores, acc, sums;
  std::vector<float> keys, values;  // a prompt tile's context widened from a bf16 cache (attend)
  std::vector<int64_t> positions;   // 0, 1, 2, ...: the widened rows' slots
};

// Rows slots[0..n) of a cache (row_stride apart, D values each, from `cache`) as float32 rows one after another.
template <class V, typename C>
inline void widen_rows(const C* cache, const int64_t* slots, int64_t n, int64_t row_stride, int64_t D,
                       std::vector<float>& out) {
  out.resize(n * D);
  for (int64_t l = 0; l < n; ++l) {
    if (l + kPrefetch < n) prefetch_row(cache + slots[l + kPrefetch] * row_stride, D);
    for (int64_t i = 0; i < D; i += V::kLanes) V::store(&out[l * D + i], V::load(cache + slots[l] * row_stride + i));
  }
}

// Heads [0, HB) x registers [j0, j0 + JB) of a row's weighted values: acc[h][j] = sum over positions l < n, in
// order, of score[h][l] * value[l][j], kept in registers over all the positions (HB * JB of them), each value read
// once for the HB heads. Each sum is the fused multiply-adds from zero that the order of positions gives, so the
// bits do not depend on how the heads and registers are blocked. From l0 > 0 the sums go on from acc (positions
// [0, l0) summed there before: the same multiply-adds in the same order, so the same bits).
template <class V, int HB, int JB, typename T>
inline void weigh_block(const T* v_cache, const int64_t* slots, int64_t row_stride, const float* scores,
                        int64_t score_stride, int64_t l0, int64_t n, int64_t j0, float* acc, int64_t D) {
  using Reg = typename V::Reg;
  Reg sums[HB][JB];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < JB; ++j) sums[h][j] = l0 == 0 ? V::zero() : V::load(acc + h * D + (j0 + j) * V::kLanes);
  for (int64_t l = l0; l < n; ++l) {
    if (l + kPrefetch < n) prefetch_row(v_cache + slots[l + kPrefetch] * row_stride + j0 * V::kLanes, JB * V::kLanes);
    const T* value = v_cache + slots[l] * row_stride + j0 * V::kLanes;
    Reg score[HB];
    for (int h = 0; h < HB; ++h) score[h] = V::set1(scores[h * score_stride + l]);
    for (int j = 0; j < JB; ++j) {
      const Reg v = V::load(value + j * V::kLanes);
      for (int h = 0; h < HB; ++h) sums[h][j] = V::fmadd(score[h], v, sums[h][j]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < JB; ++j) V::store(acc + h * D + (j0 + j) * V::kLanes, sums[h][j]);
}

template <class V, int JB, typename T>
inline void weigh_heads(int64_t heads, const T* v_cache, const int64_t* slots, int64_t row_stride,
                        const float* scores, int64_t score_stride, int64_t l0, int64_t n, int64_t j0, float* acc,
                        int64_t D) {
  switch (heads) {  // at most kMaxBlockHeads
    case 1: return weigh_block<V, 1, JB>(v_cache, slots, row_stride, scores, score_stride, l0, n, j0, acc, D);
    case 2: return weigh_block<V, 2, JB>(v_cache, slots, row_stride, scores, score_stride, l0, n, j0, acc, D);
    case 3: return weigh_block<V, 3, JB>(v_cache, slots, row_stride, scores, score_stride, l0, n, j0, acc, D);
    default: return weigh_block<V, 4, JB>(v_cache, slots, row_stride, scores, score_stride, l0, n, j0, acc, D);
  }
}

// G heads' weighted values over positions [l0, n) (acc[h * D ..], their scores at scores[h * score_stride ..]), in
// blocks of heads and registers that fit the register file: V::kAccumulators sums at a time.
constexpr int64_t kMaxBlockHeads = 4;
template <class V, typename T>
void weigh_values(const T* v_cache, const int64_t* slots, int64_t row_stride, const float* scores,
                  int64_t score_stride, int64_t l0, int64_t n, int64_t G, int64_t D, float* acc) {
  const int64_t vectors = D / V::kLanes;
  const int64_t JB = vectors % 8 == 0 && V::kAccumulators >= 16 ? 8 : vectors % 4 == 0 ? 4 : vectors % 2 == 0 ? 2 : 1;
  const int64_t block_heads = std::min<int64_t>(kMaxBlockHeads, std::max<int64_t>(V::kAccumulators / JB, 1));
  for (int64_t h = 0; h < G; h += block_heads) {
    const int64_t heads = std::min(block_heads, G - h);
    for (int64_t j0 = 0; j0 < vectors; j0 += JB) {
      const float* s = scores + h * score_stride;
      float* a = acc + h * D;
      if (JB == 8) weigh_heads<V, 8>(heads, v_cache, slots, row_stride, s, score_stride, l0, n, j0, a, D);
      else if (JB == 4) weigh_heads<V, 4>(heads, v_cache, slots, row_stride, s, score_stride, l0, n, j0, a, D);
      else if (JB == 2) weigh_heads<V, 2>(heads, v_cache, slots, row_stride, s, score_stride, l0, n, j0, a, D);
      else weigh_heads<V, 1>(heads, v_cache, slots, row_stride, s, score_stride, l0, n, j0, a, D);
    }
  }
}

// One tile's KV head: R rows (a sequence at one position each, each row's context a prefix of the last row's:
// lengths[r] <= lengths[R - 1]), each with its G query heads. Each key is read once for the tile, the values once
// per row; each (row, head)'s arithmetic is what it would be alone, in the same order: its scores one dot per
// position, its softmax over its own length, its sum over its positions in order. So a prompt run as R decode rows
// gets the bits that decoding each of its tokens gets.
template <class V, typename T, typename C>
void attend_tile(const T* q, int64_t q_row_stride, const C* k_cache, const C* v_cache, const int64_t* slots,
                 const int64_t* lengths, int64_t R, int64_t row_stride, int64_t G, int64_t D, float scale,
                 bool round_like_bf16, T* out, int64_t out_row_stride, Scratch& scratch) {
  using Reg = typename V::Reg;
  const int64_t vectors = D / V::kLanes, heads = R * G, length = lengths[R - 1];
  std::vector<float>& query = scratch.query;
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& acc = scratch.acc;
  query.resize(heads * D);
  scores.resize(heads * length);
  acc.resize(heads * D);  // weigh_values writes every sum
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < G * D; i += V::kLanes) V::store(&query[r * G * D + i], V::load(q + r * q_row_stride + i));
  // Scores two heads and half a register of positions at a time: each (head, position) dot sums in a register of
  // its own and sum_each folds the kLanes of them into one register, the first head's scores in its low half, the
  // second's in its high half (a horizontal sum per dot cost more than the dots). Each key register is loaded once
  // for both heads. A dot's lanes are its fused multiply-adds in order of registers, then sum_each's fixed tree:
  // the same bits for a position whatever block, pair of heads, tile or batch it is in. A block's positions past
  // a row's length are scored and never read; past the tile's length they repeat its last key and are not stored.
  constexpr int64_t P = V::kLanes / 2;
  int64_t first_row = 0;  // the first row whose context reaches position l
  for (int64_t l = 0; l < length; l += P) {
    for (int64_t ahead = l + kPrefetch; ahead < std::min(l + kPrefetch + P, length); ++ahead)
      prefetch_row(k_cache + slots[ahead] * row_stride, D);
    while (lengths[first_row] <= l) ++first_row;
    const int64_t block = std::min<int64_t>(P, length - l);
    const C* keys[P];
    for (int64_t p = 0; p < P; ++p) keys[p] = k_cache + slots[l + std::min(p, block - 1)] * row_stride;
    for (int64_t head = first_row * G; head < heads; head += 2) {
      const int64_t second = std::min(head + 1, heads - 1);  // an odd head out pairs with itself
      Reg dots[V::kLanes];
      for (int64_t d = 0; d < V::kLanes; ++d) dots[d] = V::zero();
      for (int64_t j = 0; j < vectors; ++j) {
        const Reg q_first = V::load(&query[head * D + j * V::kLanes]);
        const Reg q_second = V::load(&query[second * D + j * V::kLanes]);
        for (int64_t p = 0; p < P; ++p) {
          const Reg key = V::load(keys[p] + j * V::kLanes);
          dots[p] = V::fmadd(q_first, key, dots[p]);
          dots[P + p] = V::fmadd(q_second, key, dots[P + p]);
        }
      }
      const Reg both = V::sum_each(dots);
      V::store_half(&scores[head * length + l], &scores[second * length + l], block, both);
    }
  }
  const Reg scale_v = V::set1(scale);
  const auto add = [](Reg a, Reg b) { return V::add(a, b); };
  std::vector<float>& sums = scratch.sums;  // bf16: each head's sum of exps, which divides its output at the end
  sums.resize(heads);
  for (int64_t head = 0; head < heads; ++head) {  // softmax in fp32, as torch's: exp(s - max) / sum
    float* row = &scores[head * length];
    const int64_t n = lengths[head / G];
    const Reg max_v = V::set1(V::reduce_max(map_row<V>(
        row, n, V::set1(-std::numeric_limits<float>::infinity()), [&](Reg s) { return V::mul(s, scale_v); },
        [](Reg a, Reg b) { return V::max(a, b); })));
    if (round_like_bf16) {  // SDPA's: the exps rounded to weight the values, their fp32 sum kept to divide
      Reg sum = V::zero();
      int64_t i = 0;
      for (; i + V::kLanes <= n; i += V::kLanes) {
        const Reg e = V::exp(V::sub(V::load(row + i), max_v));
        sum = V::add(sum, e);
        V::store(row + i, V::round_to_bf16(e));
      }
      if (i < n) {
        const typename V::Mask mask = V::tail_mask(n - i);
        const Reg e = V::exp(V::sub(V::load_masked(row + i, mask), max_v));
        sum = V::blend(mask, sum, V::add(sum, e));
        V::store_masked(row + i, mask, V::round_to_bf16(e));
      }
      sums[head] = V::reduce_add(sum);
      continue;
    }
    const Reg sum = V::set1(V::reduce_add(map_row<V>(
        row, n, V::zero(), [&](Reg s) { return V::exp(V::sub(s, max_v)); }, add)));
    map_row<V>(row, n, V::zero(), [&](Reg e) { return V::div(e, sum); }, add);
  }
  // Each (row, head)'s sums in registers over its own positions, in order, as a decode row's (weigh_values). The
  // positions every row of the tile reaches (its first row's, the shortest) are weighed for all of its R * G heads
  // together, each value read once for a block of heads of any rows; then each row's last few on their own.
  weigh_values<V>(v_cache, slots, row_stride, scores.data(), length, 0, lengths[0], heads, D, acc.data());
  for (int64_t r = 1; r < R; ++r)
    if (lengths[r] > lengths[0])
      weigh_values<V>(v_cache, slots, row_stride, &scores[r * G * length], length, lengths[0], lengths[r], G, D,
                      &acc[r * G * D]);
  if (round_like_bf16)
    for (int64_t head = 0; head < heads; ++head)
      for (int64_t j = 0; j < D; ++j) acc[head * D + j] /= sums[head];
  for (int64_t r = 0; r < R; ++r) store_floats(out + r * out_row_stride, &acc[r * G * D], G * D);
}

// Tasks [task0, task1) of p: each is one (tile, KV head) pair (see attention_tiles). T: the queries' and output's
// type, C: the caches'.
template <class V, typename T, typename C>
void attend(const AttentionProblem& p, int64_t task0, int64_t task1) {
  const int64_t G = p.H / p.Hkv;
  const T* q = static_cast<const T*>(p.q);
  const C* k = static_cast<const C*>(p.k_cache);
  const C* v = static_cast<const C*>(p.v_cache);
  T* out = static_cast<T*>(p.out);
  // Kept per thread: a prefill's tasks come in many small chunks (matmul.h: parallel_share), and each chunk would
  // otherwise allocate (and fault in) its widened keys and values again. Bound once: a thread_local named in the loop
  // is looked up at every use.
  thread_local Scratch thread_scratch;
  thread_local std::vector<int64_t> thread_lengths;
  Scratch& scratch = thread_scratch;
  std::vector<int64_t>& lengths = thread_lengths;
  for (int64_t task = task0; task < task1; ++task) {
    // A prompt's tiles grow with their position; threads take contiguous ranges of tasks (halves or chunks:
    // matmul.h's parallel_share), so tiles are dealt from both ends (0, n-1, 1, n-2, ...) and each range gets short
    // and long ones alike.
    const int64_t dealt = task / p.Hkv, h = task % p.Hkv;
    const int64_t tile = dealt % 2 == 0 ? dealt / 2 : p.num_tiles - 1 - dealt / 2;
    const int64_t b0 = p.tiles[tile], rows = p.tiles[tile + 1] - b0, last = b0 + rows - 1;
    lengths.resize(rows);
    for (int64_t r = 0; r < rows; ++r) lengths[r] = std::min(p.lengths[b0 + r], p.L);
    if constexpr (!std::is_same_v<C, float>) {
      // A prompt's tile reads each key for all its R * G heads and each value for every block of them: from a bf16
      // cache each read widened it again (two instructions a register, as many as the multiply-adds it fed). So the
      // tile's context is widened once here (exactly: bf16 is the top half of a float32), and read as float32.
      if (rows > 1) {
        const int64_t length = lengths[rows - 1], row_stride = p.Hkv * p.D;
        widen_rows<V>(k + h * p.D, p.slots + last * p.L, length, row_stride, p.D, scratch.keys);
        widen_rows<V>(v + h * p.D, p.slots + last * p.L, length, row_stride, p.D, scratch.values);
        scratch.positions.resize(length);
        for (int64_t l = 0; l < length; ++l) scratch.positions[l] = l;
        attend_tile<V, T, float>(q + (b0 * p.H + h * G) * p.D, p.H * p.D, scratch.keys.data(), scratch.values.data(),
                                 scratch.positions.data(), lengths.data(), rows, p.D, G, p.D, p.scale, p.bf16,
                                 out + (b0 * p.H + h * G) * p.D, p.H * p.D, scratch);
        continue;
      }
    }
    attend_tile<V, T, C>(q + (b0 * p.H + h * G) * p.D, p.H * p.D, k + h * p.D, v + h * p.D, p.slots + last * p.L,
                      lengths.data(), rows, p.Hkv * p.D, G, p.D, p.scale, p.bf16, out + (b0 * p.H + h * G) * p.D,
                      p.H * p.D, scratch);
  }
}

template <class V>
void attend(const AttentionProblem& p, int64_t task0, int64_t task1) {
  if (p.bf16) attend<V, uint16_t, uint16_t>(p, task0, task1);
  else if (p.kv_bf16) attend<V, float, uint16_t>(p, task0, task1);
  else attend<V, float, float>(p, task0, task1);
}

}  // namespace tern::attention
