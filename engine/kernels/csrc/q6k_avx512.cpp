// 6-bit weights (GGUF's Q6_K, kernels.h: q6k_groups_avx512) times int8 activations on AVX512-VNNI: two groups of 8
// rows at a time in 16 int32 lanes, as the 4-bit kernels (int4_avx512.cpp).
//
// Each block of 32 columns is 4 nibble registers and 2 registers of top bits (layouts.pack_q6k); a value is its
// nibble | its 2 top bits << 4, in 0..63, unsigned as vpdpbusd wants it. Per sub-block of 16 columns (2 nibble
// registers) each row adds s_j * sum((q - 32) * xq) in integers (per half, below), and one float step per
// super-block follows: llama.cpp's Q6_K x Q8_K.
#include "activation_tiles.h"
#include "avx512.h"
#include "kernels.h"
#include "prefetch.h"
#include "q6k_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace tern {
namespace {

// q6k's activations per super-block of 256 (activation_tiles.h): the integer each half of its 16 sub-blocks' dots
// starts from, -32 * the sum of its 8 int8s, then each sub-block's, -32 * the sum of its 16.
using Q6KTiles = TileLayout<kQ6KSuperCols, 48 * 4>;

const uint8_t* q6k_tiles(const QuantizedRows& q, int64_t m0, int64_t M) {
  return Q6KTiles::interleave(q, m0, M, [&](int64_t row, int64_t s, uint8_t* out) {
    const int8_t* values = q.values + row * q.K + s * kQ6KSuperCols;
    for (int half = 0; half < 32; ++half) {
      int32_t sum = 0;
      for (int k = 0; k < 8; ++k) sum += values[8 * half + k];
      const int32_t start = -32 * sum;
      std::memcpy(out + 4 * half, &start, 4);
    }
    for (int j = 0; j < 16; ++j) {
      const int32_t start = -32 * q.sums16[row * (q.K / 16) + s * 16 + j];
      std::memcpy(out + 128 + 4 * j, &start, 4);
    }
  });
}

// A pair of groups' super-block as pair_rows multiplies it: the first tile of rows decodes it from the layout and
// keeps it here, the other tiles load it (int4_avx512.cpp's Q4KDecoded says why).
struct Q6KDecoded {
  __m512i values[8][4][2];  // per block of 32 columns and nibble register, the low and high nibbles' 6-bit values
  __m512i scale[16];        // s_j (int8) in each row's lane
  __m512 d;
};

// out[m, rows n0..n0+15] for MB activation rows (m0.., the tile at `tile`) against groups wa (rows n0..n0+7) and wb
// (n0+8..n0+15); decoded: their super-blocks, as kDecoding says.
// Each half of a sub-block (a nibble register, 8 columns) has a dot of its own, which starts at -32 * its sum and
// so ends at sum((q - 32) * xq), at most 8 * 32 * 127: it fits int16, so with s_j in the low half of each lane (the
// high half 0) one vpdpwssd adds s_j * dot, where a vpmulld (two instructions on Intel) and an add did per
// sub-block. isum ends at the same integer, sum_j s_j * dot_j.
// Not inlined: inlined into q6k_pairs_avx512 beside its 23 other instantiations, one row took 1.18x the time.
template <int MB, Decoding kDecoding>
__attribute__((noinline)) void pair_rows(const Q6KProblem& p, const uint8_t* tile, const uint8_t* wa, const uint8_t* wb, int64_t m0,
                      int64_t n0, Q6KDecoded* decoded) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks
  const int64_t group_stride = q.blocks * kQ6KSuperBytes;
  constexpr bool kFirst = kDecoding != Decoding::kLoad, kKeep = kDecoding == Decoding::kKeep;
  // By halves from 3 rows; with one or two, each row's isum would be one chain of vpdpwssd (5 cycles each) that
  // bounds the loop (one row, 1B shapes: 1.15x the time), so a sub-block's dot adds s_j * dot by vpmulld there.
  constexpr bool kByHalves = MB > 2;
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  alignas(64) float result[MB][16] = {};
  for (int64_t s = 0; s < q.blocks; ++s) {
    const uint8_t* sa = wa + s * kQ6KSuperBytes;
    const uint8_t* sb = wb + s * kQ6KSuperBytes;
    Q6KDecoded* w = decoded + s;
    const Q6KTiles::Unit<MB> x(tile, s);
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const uint8_t* ca = sa + kQ6KHeaderBytes + c * kQ6KBlockBytes;
      const uint8_t* cb = sb + kQ6KHeaderBytes + c * kQ6KBlockBytes;
      if constexpr (kFirst) {
        prefetch_pair_stream<kQ6KGroupBytes>(sa + c * kQ6KGroupBytes, wa + group_stride, group_stride);  // as q6k_rows.h
        prefetch_pair_stream<kQ6KGroupBytes>(sb + c * kQ6KGroupBytes, wb + group_stride, group_stride);
      }
      for (int h = 0; h < 2; ++h) {  // sub-block j = 2c + h: nibble registers 2h and 2h + 1, top-bit register h
        const int j = 2 * c + h;
        __m512i scale;
        if constexpr (kFirst) {
          scale = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 16 + 8 * j)),
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 16 + 8 * j))));
          if constexpr (kKeep) _mm512_store_si512(&w->scale[j], scale);
        } else {
          scale = _mm512_load_si512(&w->scale[j]);
        }
        // vpdpwssd takes s_j from the low 16 bits with the high ones 0; vpmulld the sign-extended int32.
        if constexpr (kByHalves) scale = _mm512_and_si512(scale, low16);
        __m512i highs;
        if constexpr (kFirst) highs = avx512::two_groups(ca + 128 + 32 * h, cb + 128 + 32 * h);
        __m512i dot[MB];
        if constexpr (!kByHalves)
          for (int m = 0; m < MB; ++m)
            dot[m] = _mm512_set1_epi32(x.template extras<int32_t>(m)[32 + j]);
        for (int k = 0; k < 2; ++k) {
          const int i = 2 * h + k;
          __m512i lo, hi;
          if constexpr (kFirst) {
            q6k::register_values(ca, cb, highs, i, lo, hi);
            if constexpr (kKeep) {
              _mm512_store_si512(&w->values[c][i][0], lo);
              _mm512_store_si512(&w->values[c][i][1], hi);
            }
          } else {
            lo = _mm512_load_si512(&w->values[c][i][0]);
            hi = _mm512_load_si512(&w->values[c][i][1]);
          }
          for (int m = 0; m < MB; ++m) {
            if constexpr (kByHalves) dot[m] = _mm512_set1_epi32(x.template extras<int32_t>(m)[2 * j + k]);
            dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x.x(m)[8 * c + 2 * i]));
            dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x.x(m)[8 * c + 2 * i + 1]));
            if constexpr (kByHalves) isum[m] = _mm512_dpwssd_epi32(isum[m], dot[m], scale);
          }
        }
        if constexpr (!kByHalves)
          for (int m = 0; m < MB; ++m) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(dot[m], scale));
      }
    }
    const __m512 d = decoded_value<kDecoding>(&w->d, [&] { return avx512::two_fp16_rows(sa, sb); });
    for (int m = 0; m < MB; ++m) {
      const __m512 x_scale = _mm512_set1_ps(x.scales()[m]);
      _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]),
                                               _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]),
                                                             _mm512_mul_ps(d, x_scale))));
    }
  }
  for (int m = 0; m < MB; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, _mm512_load_ps(result[m]), p.out_bf16);
}

}  // namespace

void q6k_pairs_avx512(const Q6KProblem& p, int64_t m0, int64_t g0, int64_t g1) {
  if (g0 + 1 >= g1) return;
  const int64_t group_stride = p.x->blocks * kQ6KSuperBytes;  // 8 rows, all of K
  const uint8_t* tiles = q6k_tiles(*p.x, m0, p.M);
  thread_local std::vector<Q6KDecoded> thread_decoded;  // one pair's super-blocks: 5 KB per 256 columns
  const bool one_tile = p.M - m0 <= kTileRows;    // nothing to keep
  thread_decoded.resize(std::max(thread_decoded.size(), static_cast<size_t>(p.x->blocks)));
  // Bound once: a thread_local named in the lambda is looked up (__tls_get_addr) at every tile, ~2% of a prompt.
  Q6KDecoded* const decoded = thread_decoded.data();
  for (; g0 + 1 < g1; g0 += 2) {
    const uint8_t* wa = p.w + g0 * group_stride;
    const uint8_t* wb = wa + group_stride;
    const int64_t n0 = g0 * kInt4GroupRows;
    for_each_tile(m0, p.M, [&](auto rows, int64_t m) {
      constexpr int MB = decltype(rows)::value;
      const uint8_t* tile = tiles + Q6KTiles::tile_bytes(*p.x, m - m0);
      if (m != m0) pair_rows<MB, Decoding::kLoad>(p, tile, wa, wb, m, n0, decoded);
      else if (one_tile) pair_rows<MB, Decoding::kDecode>(p, tile, wa, wb, m, n0, decoded);
      else pair_rows<MB, Decoding::kKeep>(p, tile, wa, wb, m, n0, decoded);
    });
  }
}

void q6k_groups_avx512(const Q6KProblem& p, int64_t g0, int64_t g1) {
  const int64_t paired_end = g0 + (g1 - g0) / 2 * 2;
  q6k_pairs_avx512(p, 0, g0, paired_end);
  if (paired_end < g1) q6k_groups_avx2(p, paired_end, g1);  // an odd group left: the AVX2 kernel, the same bits
}

}  // namespace tern
