// 4-bit weights times int8 activations on AVX512-VNNI (kernels.h: int4_groups_avx512): the same layout, integers
// and float steps as int4_avx2.cpp, two groups of 8 rows at a time in 16 int32 lanes.
//
// Each 512-bit register holds one 32-byte nibble register of group g (low half) and the same one of group g + 1
// (high half): 16 rows, one per int32 lane, 4 columns each. vpdpbusd multiplies the unsigned nibbles by 4 signed
// activation bytes broadcast to every lane and adds the 4 products into the lane: the exact integer the AVX2
// kernel gets through vpmaddubsw and vpmaddwd, with a third of the instructions and no int16 stage. At one row
// (decode) the AVX2 kernel is compute-bound at ~18 GB/s of weights on a 1B model's layers where this one reads
// ~25 GB/s (one large matrix: 26-27 GB/s, the VM's streaming read). The float steps per group (acc += dot * (d * x_scale),
// then acc += m * (x_scale * sum)) are unchanged, so both kernels give the same bits.
//
// The q4 layout (kernels.h: q4_groups_avx512, GGUF's Q4_0) is the same loop without minimums: each dot starts at
// -8 * sum(xq), so it ends at sum((q - 8) * xq), and one float step follows, q8's. The q4k layout (GGUF's Q4_K) has a
// loop of its own below: the same dots, summed per super-block in integers.
#include "activation_tiles.h"
#include "avx2.h"
#include "avx512.h"
#include "kernels.h"
#include "kquant_minimums_avx512.h"
#include "prefetch.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace tern {
namespace {

// Rows from which the q4, int4 and q4k loops take two pairs of groups at a time (walk_pairs): q4's alone 0.92-0.95x
// the time at 64 and 256 rows, the same at 32, 1.02-1.09x at 16 (a 1B model's q4 layers, 2-core Zen 5 VM).
constexpr int64_t kQuadMinRows = 64;

// A pair of groups' block of 32 columns as pair_rows multiplies it (q4k_rows' Q4KDecoded says why).
struct Per32Decoded {
  __m512i nibbles[4][2];  // per register j, the low and the high nibbles as bytes
  __m512 d, minimum;      // int4's minimums; q4 has none
};

// out[m, rows n0..n0 + 16 * NP - 1] for rows R0..R0 + R - 1 of a tile of MB activation rows (first row m0, at
// `tile`) against NP pairs of groups from wa (rows n0..n0+7; each next group one group_stride on); kQ4: the q4
// layout (no minimums), else int4. kPrefetch: this pass is the first over these weights; the later passes find
// them in cache, and their prefetches only took issue slots (the same time at 16 and 256 rows without them).
// decoded: the blocks of the NP pairs as the loop multiplies them (Per32Decoded, NP x q.blocks), as kDecoding says
// (q4k_rows says why).
template <bool kQ4, int MB, int R0, int R, int NP, Decoding kDecoding>
inline void pair_rows(const Int4Problem& p, int64_t m0, const uint8_t* tile, const uint8_t* wa, int64_t n0,
                      Per32Decoded* decoded) {
  constexpr int64_t kBytes = kQ4 ? kQ4GroupBytes : kInt4GroupBytes;
  constexpr bool kPrefetch = kDecoding != Decoding::kLoad, kKeep = kDecoding == Decoding::kKeep;
  const QuantizedRows& q = *p.x;
  const int64_t group_stride = q.blocks * kBytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][NP];
  for (int m = 0; m < R; ++m)
    for (int pr = 0; pr < NP; ++pr) acc[m][pr] = _mm512_setzero_ps();
  for (int64_t c = 0; c < q.blocks; ++c) {
    const uint8_t* ca[NP];
    const uint8_t* cb[NP];
    Per32Decoded* w[NP];
    for (int pr = 0; pr < NP; ++pr) {
      ca[pr] = wa + 2 * pr * group_stride + c * kBytes;
      cb[pr] = ca[pr] + group_stride;
      w[pr] = decoded + pr * q.blocks + c;
      if constexpr (kPrefetch) {
        // Each stream's next bytes after its group lie 2 * NP - 1 groups on (the next pass over NP pairs).
        const uint8_t* a_end = wa + (2 * pr + 1) * group_stride;
        prefetch_pair_stream<kBytes>(ca[pr], a_end, (2 * NP - 1) * group_stride);
        prefetch_pair_stream<kBytes>(cb[pr], a_end + group_stride, (2 * NP - 1) * group_stride);
      }
    }
    const Per32Tiles::Unit<MB> x(tile, c);
    __m512i dot[R][NP];
    for (int m = 0; m < R; ++m)
      for (int pr = 0; pr < NP; ++pr)
        dot[m][pr] = kQ4 ? _mm512_set1_epi32(*x.template extras<int32_t>(R0 + m)) : _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i lo[NP], hi[NP];
      for (int pr = 0; pr < NP; ++pr) {
        if constexpr (kPrefetch) {
          const __m512i packed = avx512::two_groups(ca[pr] + 32 * j, cb[pr] + 32 * j);
          lo[pr] = _mm512_and_si512(packed, low);
          hi[pr] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
          if constexpr (kKeep) {
            _mm512_store_si512(&w[pr]->nibbles[j][0], lo[pr]);
            _mm512_store_si512(&w[pr]->nibbles[j][1], hi[pr]);
          }
        } else {
          lo[pr] = _mm512_load_si512(&w[pr]->nibbles[j][0]);
          hi[pr] = _mm512_load_si512(&w[pr]->nibbles[j][1]);
        }
      }
      for (int m = 0; m < R; ++m) {
        const __m512i x_lo = _mm512_set1_epi32(x.x(R0 + m)[2 * j]);
        const __m512i x_hi = _mm512_set1_epi32(x.x(R0 + m)[2 * j + 1]);
        for (int pr = 0; pr < NP; ++pr) {
          dot[m][pr] = _mm512_dpbusd_epi32(dot[m][pr], lo[pr], x_lo);
          dot[m][pr] = _mm512_dpbusd_epi32(dot[m][pr], hi[pr], x_hi);
        }
      }
    }
    for (int pr = 0; pr < NP; ++pr) {
      const __m512 d = decoded_value<kDecoding>(&w[pr]->d, [&] { return avx512::two_fp16_rows(ca[pr] + 128, cb[pr] + 128); });
      for (int m = 0; m < R; ++m)
        acc[m][pr] = _mm512_add_ps(acc[m][pr], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][pr]),
                                                             _mm512_mul_ps(d, _mm512_set1_ps(x.scales()[R0 + m]))));
      if constexpr (!kQ4) {
        const __m512 minimum = decoded_value<kDecoding>(&w[pr]->minimum,
                                                        [&] { return avx512::two_fp16_rows(ca[pr] + 144, cb[pr] + 144); });
        for (int m = 0; m < R; ++m)
          acc[m][pr] = _mm512_add_ps(acc[m][pr], _mm512_mul_ps(minimum, _mm512_set1_ps(x.template extras<float>(R0 + m)[1])));
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int pr = 0; pr < NP; ++pr) avx512::store16(p.out, (m0 + R0 + m) * p.N + n0 + 16 * pr, acc[m][pr], p.out_bf16);
}

// One pass of a pair loop: rows R0..R0 + R - 1 of a tile of MB activation rows against NP pairs of groups;
// kPrefetch on the first pass over those weights.
template <int kMB, int kR0, int kR, int kNP, bool kFirst>
struct Pass {
  static constexpr int MB = kMB, R0 = kR0, R = kR, NP = kNP;
  static constexpr bool kPrefetch = kFirst;
};

template <int MB, int NP, typename Run>
inline void in_halves(Run& run, const uint8_t* tile, int64_t m, int64_t g, bool first_tile) {
  constexpr int kHalf = NP == 1 ? MB : std::min(MB, 4);
  if (first_tile) run(Pass<MB, 0, kHalf, NP, true>{}, tile, m, g);
  else run(Pass<MB, 0, kHalf, NP, false>{}, tile, m, g);
  if constexpr (kHalf < MB) run(Pass<MB, kHalf, MB - kHalf, NP, false>{}, tile, m, g);
}

// The walk of the q4, int4 and q4k pair loops over groups [g0, g1) (an even count) and activation rows m0..M
// (their tiles at `tiles`, laid out as Tiles): run(Pass, tile, first row, first group) for each pass. From
// kQuadMinRows rows two pairs at a time, each tile in halves of 4 rows (4 rows x 2 pairs of dots and sums in
// registers), each activation broadcast feeding two weight registers. Why the gain is small: vpdpbusd and vmulps
// share the two multiply pipes (Zen 5: either alone 2 a cycle, 1 each a cycle together), and each row and pair
// takes 8 vpdpbusd and 2 vmulps a block whatever the tiling: at best 80% of vpdpbusd's peak, where one pair at a
// time reaches ~60%.
template <typename Tiles, typename Run>
inline void walk_pairs(const QuantizedRows& q, int64_t m0, int64_t M, int64_t g0, int64_t g1, const uint8_t* tiles,
                       Run run) {
  const bool quads = M - m0 >= kQuadMinRows;
  while (g0 + 1 < g1) {
    const int np = quads && g0 + 3 < g1 ? 2 : 1;
    for_each_tile(m0, M, [&](auto rows, int64_t m) {
      constexpr int MB = decltype(rows)::value;
      const uint8_t* tile = tiles + Tiles::tile_bytes(q, m - m0);
      if (np == 2) in_halves<MB, 2>(run, tile, m, g0, m == m0);
      else in_halves<MB, 1>(run, tile, m, g0, m == m0);
    });
    g0 += 2 * np;
  }
}

// Pairs of groups [g0, g1) (an even count) for activation rows m0.. (kQ4: the q4 layout, else int4).
template <bool kQ4>
void pairs(const Int4Problem& p, int64_t m0, int64_t g0, int64_t g1) {
  if (g0 + 1 >= g1) return;
  const int64_t group_stride = p.x->blocks * (kQ4 ? kQ4GroupBytes : kInt4GroupBytes);  // 8 rows, all of K
  const uint8_t* tiles = per32_tiles(*p.x, m0, p.M, kQ4 ? -8 : 0);
  thread_local std::vector<Per32Decoded> thread_decoded;  // two pairs' blocks: 1.2 KB per 32 columns
  const bool one_pass = p.M - m0 <= kTileRows;     // one tile, one pass (walk_pairs): nothing to keep
  thread_decoded.resize(std::max(thread_decoded.size(), static_cast<size_t>(2 * p.x->blocks)));
  // Bound once: a thread_local named in the lambda is looked up (__tls_get_addr) at every tile, ~2% of a prompt.
  Per32Decoded* const decoded = thread_decoded.data();
  walk_pairs<Per32Tiles>(*p.x, m0, p.M, g0, g1, tiles, [&](auto pass, const uint8_t* tile, int64_t m, int64_t g) {
    using P = decltype(pass);
    const uint8_t* w = p.w + g * group_stride;
    const int64_t n0 = g * kInt4GroupRows;
    if (!P::kPrefetch) pair_rows<kQ4, P::MB, P::R0, P::R, P::NP, Decoding::kLoad>(p, m, tile, w, n0, decoded);
    else if (one_pass) pair_rows<kQ4, P::MB, P::R0, P::R, P::NP, Decoding::kDecode>(p, m, tile, w, n0, decoded);
    else pair_rows<kQ4, P::MB, P::R0, P::R, P::NP, Decoding::kKeep>(p, m, tile, w, n0, decoded);
  });
}

template <bool kQ4>
void groups(const Int4Problem& p, int64_t g0, int64_t g1) {
  const int64_t paired_end = g0 + (g1 - g0) / 2 * 2;
  pairs<kQ4>(p, 0, g0, paired_end);
  // An odd group left: the AVX2 kernel, the same bits.
  if (paired_end < g1) kQ4 ? q4_groups_avx2(p, paired_end, g1) : int4_groups_avx2(p, paired_end, g1);
}

// q4k's activations per super-block: SuperBlockTiles' int16 sums of each 32, then the same times 8 (int16 pairs),
// then -8 times them as int32s (the integer each sub-block's dot starts from).
using Q4KTiles = TileLayout<kQ4KSuperCols, 64>;

inline const uint8_t* q4k_tiles(const QuantizedRows& q, int64_t m0, int64_t M) {
  return Q4KTiles::interleave(q, m0, M, [&](int64_t row, int64_t s, uint8_t* out) {
    const int16_t* sums = q.sums32 + row * (q.K / kInt4GroupCols) + s * 8;
    std::memcpy(out, sums, 16);
    for (int j = 0; j < 8; ++j) {
      const int16_t eight = static_cast<int16_t>(8 * sums[j]);  // |sum| <= 32 * 127, so 8 times it fits int16
      const int32_t start = -8 * sums[j];
      std::memcpy(out + 16 + 2 * j, &eight, 2);
      std::memcpy(out + 32 + 4 * j, &start, 4);
    }
  });
}

// A pair of groups' super-block as q4k_rows multiplies it: the first pass over the pair (its first rows) decodes
// it from the layout and keeps it here; the passes for the other rows load it. With many rows most of the loop's
// vector instructions besides vpdpbusd were this decoding (splitting nibbles, the 6-bit scales and minimums), and
// on a CPU whose 512-bit integer work all issues on the two ports vpdpbusd uses (Intel's), each of them cost half a
// vpdpbusd; a load costs none of those ports.
struct Q4KDecoded {
  __m512i nibbles[8][4][2];  // per sub-block j and register r, the low and the high nibbles as bytes
  __m512i scale[8];          // s_j in the low 16 bits of each row's lane
  __m512i scale_pairs[4];    // s_2k | s_2k+1 << 16
  __m512i minimum_pairs[4];  // m_2k | m_2k+1 << 16
  __m512 d, negative_dmin;
};

// q4k (kernels.h: llama.cpp's Q4_K x Q8_K): out[m, rows n0..n0 + 16 * NP - 1] for rows R0..R0 + R - 1 of a tile
// of MB activation rows (first row m0, at `tile`) against NP pairs of groups from wa (as pair_rows); decoded: their
// super-blocks decoded (NP x q.blocks), as kDecoding says.
// Per super-block: each sub-block's dot starts at -8 * sum_j, so it ends at sum((q - 8) * xq), which fits int16
// (at most 32 * 8 * 127); with s_j in the low half of each lane (the high half 0) one vpdpwssd adds s_j * dot, and
// per pair of sub-blocks another adds the 8 * s_j * sum_j this leaves out, against the sums times 8, so isum ends
// at the integer sum_j s_j * dot_j; one float step. Then the minimums, msum = sum_j m_j * sums32_j, and the second
// float step. The results wait in memory during the dots, which leaves registers for 8 (row, pair) dots and sums.
template <int MB, int R0, int R, int NP, Decoding kDecoding>
inline void q4k_rows(const Q4KProblem& p, const uint8_t* tile, const uint8_t* wa, int64_t m0, int64_t n0,
                     Q4KDecoded* decoded) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks
  const int64_t group_stride = q.blocks * kQ4KSuperBytes;
  const __m512i low = _mm512_set1_epi8(0x0F), fifteen = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3);
  constexpr bool kFirst = kDecoding != Decoding::kLoad, kKeep = kDecoding == Decoding::kKeep;
  alignas(64) float result[NP][R][16] = {};
  for (int64_t s = 0; s < q.blocks; ++s) {
    const Q4KTiles::Unit<MB> x(tile, s);
    const uint8_t* sa[NP];
    const uint8_t* sb[NP];
    Q4KDecoded* w[NP];
    __m512i top[NP], isum[R][NP];
    for (int pr = 0; pr < NP; ++pr) {
      sa[pr] = wa + 2 * pr * group_stride + s * kQ4KSuperBytes;
      sb[pr] = sa[pr] + group_stride;
      w[pr] = decoded + pr * q.blocks + s;
      if constexpr (kFirst) top[pr] = avx512::two_groups(sa[pr] + 32, sb[pr] + 32);  // s_j at 2j, m_j at 16 + 2j
    }
    for (int m = 0; m < R; ++m)
      for (int pr = 0; pr < NP; ++pr) isum[m][pr] = _mm512_setzero_si512();
    __m512i even_scale[NP];
    for (int j = 0; j < 8; ++j) {
      __m512i scale[NP];
      for (int pr = 0; pr < NP; ++pr) {
        if constexpr (kFirst) {  // 8 steps a super-block; each stream's next group lies 2 * NP - 1 groups on
          const uint8_t* a_end = wa + (2 * pr + 1) * group_stride;
          prefetch_pair_stream<kQ4GroupBytes>(sa[pr] + j * kQ4GroupBytes, a_end, (2 * NP - 1) * group_stride);
          prefetch_pair_stream<kQ4GroupBytes>(sb[pr] + j * kQ4GroupBytes, a_end + group_stride,
                                              (2 * NP - 1) * group_stride);
          const __m512i lows = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa[pr] + 64 + 8 * j)),
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb[pr] + 64 + 8 * j))));
          scale[pr] = _mm512_or_si512(_mm512_and_si512(lows, fifteen), _mm512_slli_epi32(_mm512_and_si512(top[pr], three), 4));
          top[pr] = _mm512_srli_epi32(top[pr], 2);
          if constexpr (kKeep) _mm512_store_si512(&w[pr]->scale[j], scale[pr]);
        } else {
          scale[pr] = _mm512_load_si512(&w[pr]->scale[j]);
        }
      }
      __m512i dot[R][NP];
      for (int m = 0; m < R; ++m) {
        const __m512i start = _mm512_set1_epi32(x.template extras<int32_t>(R0 + m)[8 + j]);
        for (int pr = 0; pr < NP; ++pr) dot[m][pr] = start;
      }
      for (int r = 0; r < 4; ++r) {
        __m512i lo[NP], hi[NP];
        for (int pr = 0; pr < NP; ++pr) {
          if constexpr (kFirst) {
            const __m512i packed = avx512::two_groups(sa[pr] + 128 + 128 * j + 32 * r, sb[pr] + 128 + 128 * j + 32 * r);
            lo[pr] = _mm512_and_si512(packed, low);
            hi[pr] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            if constexpr (kKeep) {
              _mm512_store_si512(&w[pr]->nibbles[j][r][0], lo[pr]);
              _mm512_store_si512(&w[pr]->nibbles[j][r][1], hi[pr]);
            }
          } else {
            lo[pr] = _mm512_load_si512(&w[pr]->nibbles[j][r][0]);
            hi[pr] = _mm512_load_si512(&w[pr]->nibbles[j][r][1]);
          }
        }
        for (int m = 0; m < R; ++m) {
          const __m512i x_lo = _mm512_set1_epi32(x.x(R0 + m)[8 * j + 2 * r]);
          const __m512i x_hi = _mm512_set1_epi32(x.x(R0 + m)[8 * j + 2 * r + 1]);
          for (int pr = 0; pr < NP; ++pr) {
            dot[m][pr] = _mm512_dpbusd_epi32(dot[m][pr], lo[pr], x_lo);
            dot[m][pr] = _mm512_dpbusd_epi32(dot[m][pr], hi[pr], x_hi);
          }
        }
      }
      for (int m = 0; m < R; ++m)
        for (int pr = 0; pr < NP; ++pr) isum[m][pr] = _mm512_dpwssd_epi32(isum[m][pr], dot[m][pr], scale[pr]);
      if (j % 2 == 0) {
        if constexpr (kFirst)
          for (int pr = 0; pr < NP; ++pr) even_scale[pr] = scale[pr];
      } else {
        for (int pr = 0; pr < NP; ++pr) {
          __m512i pair;
          if constexpr (kFirst) {
            pair = _mm512_or_si512(even_scale[pr], _mm512_slli_epi32(scale[pr], 16));
            if constexpr (kKeep) _mm512_store_si512(&w[pr]->scale_pairs[j / 2], pair);
          } else {
            pair = _mm512_load_si512(&w[pr]->scale_pairs[j / 2]);
          }
          for (int m = 0; m < R; ++m)
            isum[m][pr] = _mm512_dpwssd_epi32(isum[m][pr], pair,
                                              _mm512_set1_epi32(x.template extras<int32_t>(R0 + m)[4 + j / 2]));
        }
      }
    }
    for (int pr = 0; pr < NP; ++pr) {
      __m512 d, negative_min_scale;
      __m512i minimum_pairs[4];
      if constexpr (kFirst) {
        d = avx512::two_fp16_rows(sa[pr], sb[pr]);
        negative_min_scale = negative_dmin(sa[pr], sb[pr]);
        pair_minimums(sa[pr], sb[pr], avx512::two_groups(sa[pr] + 32, sb[pr] + 32), minimum_pairs);
        if constexpr (kKeep) {
          w[pr]->d = d;
          w[pr]->negative_dmin = negative_min_scale;
          for (int k = 0; k < 4; ++k) w[pr]->minimum_pairs[k] = minimum_pairs[k];
        }
      } else {
        d = w[pr]->d;
        negative_min_scale = w[pr]->negative_dmin;
        for (int k = 0; k < 4; ++k) minimum_pairs[k] = w[pr]->minimum_pairs[k];
      }
      for (int m = 0; m < R; ++m) {
        const __m512 x_scale = _mm512_set1_ps(x.scales()[R0 + m]);
        _mm512_store_ps(result[pr][m], _mm512_add_ps(_mm512_load_ps(result[pr][m]),
                                                     _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m][pr]), _mm512_mul_ps(d, x_scale))));
      }
      add_minimums<MB, R0, R>(x, minimum_pairs, negative_min_scale, result[pr]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int pr = 0; pr < NP; ++pr)
      avx512::store16(p.out, (m0 + R0 + m) * p.N + n0 + 16 * pr, _mm512_load_ps(result[pr][m]), p.out_bf16);
}

}  // namespace

void q4k_pairs_avx512(const Q4KProblem& p, int64_t m0, int64_t g0, int64_t g1) {
  if (g0 + 1 >= g1) return;
  const int64_t group_stride = p.x->blocks * kQ4KSuperBytes;  // 8 rows, all of K
  const uint8_t* tiles = q4k_tiles(*p.x, m0, p.M);
  thread_local std::vector<Q4KDecoded> thread_decoded;  // two pairs' super-blocks: 10 KB per 256 columns
  const bool one_pass = p.M - m0 <= kTileRows;   // one tile, one pass (walk_pairs): nothing to keep
  thread_decoded.resize(std::max(thread_decoded.size(), static_cast<size_t>(2 * p.x->blocks)));
  // Bound once: a thread_local named in the lambda is looked up (__tls_get_addr) at every tile, ~2% of a prompt.
  Q4KDecoded* const decoded = thread_decoded.data();
  walk_pairs<Q4KTiles>(*p.x, m0, p.M, g0, g1, tiles, [&](auto pass, const uint8_t* tile, int64_t m, int64_t g) {
    using P = decltype(pass);
    const uint8_t* w = p.w + g * group_stride;
    const int64_t n0 = g * kInt4GroupRows;
    if (!P::kPrefetch) q4k_rows<P::MB, P::R0, P::R, P::NP, Decoding::kLoad>(p, tile, w, m, n0, decoded);
    else if (one_pass) q4k_rows<P::MB, P::R0, P::R, P::NP, Decoding::kDecode>(p, tile, w, m, n0, decoded);
    else q4k_rows<P::MB, P::R0, P::R, P::NP, Decoding::kKeep>(p, tile, w, m, n0, decoded);
  });
}

void q4k_groups_avx512(const Q4KProblem& p, int64_t g0, int64_t g1) {
  const int64_t paired_end = g0 + (g1 - g0) / 2 * 2;
  q4k_pairs_avx512(p, 0, g0, paired_end);
  if (paired_end < g1) q4k_groups_avx2(p, paired_end, g1);  // an odd group left: the AVX2 kernel, the same bits
}

void int4_groups_avx512(const Int4Problem& p, int64_t g0, int64_t g1) { groups<false>(p, g0, g1); }

void q4_groups_avx512(const Q4Problem& p, int64_t g0, int64_t g1) { groups<true>(p, g0, g1); }

void q4_pairs_avx512(const Q4Problem& p, int64_t m0, int64_t g0, int64_t g1) { pairs<true>(p, m0, g0, g1); }

}  // namespace tern
