// q4 and q4k (kernels.h: GGUF's Q4_0 and Q4_K) on Intel AMX-INT8 (kernels.h: q4_groups_amx, q4k_groups_amx) for
// batches of 16 activation rows and more: the AVX512 kernels' integers and float steps (int4_avx512.cpp: pair_rows,
// q4k_pair_rows), with the dots made by tile multiplies. Both kernels give the same bits.
//
// Per pair of groups (16 weight rows) and tile of 16 activation rows, in steps of two (sub-)blocks of 32 columns:
// tdpbsud (tdpbssd for q4's centred values) multiplies A, the activation rows' int8s (straight from QuantizedRows, stride K), by B, the 16 weight
// rows' nibbles as bytes. The AVX512 loop's registers `lo` and `hi` are exactly B's rows (row 2r: each weight row's
// columns 8r..8r+3 in its int32 lane, row 2r + 1: columns 8r+4..8r+7), so B is that loop's loads, ands and shift,
// stored; the first tile of activation rows unpacks them for all of K, the others reuse them. The 16 x 16 int32
// dots are the integers the AVX512 loop's vpdpbusd chains make.
//
// q4 multiplies its nibbles centred (q - 8 as signed bytes, tdpbssd: the dots come out as sum((q - 8) * xq), with
// no correction to add), reads each block's dots back and takes its AVX512 loop's float step on them (acc += dot *
// (d * x_scale)). q4k has two ways. By sub-block (q4k_sub_block_tile): each sub-block's dots read back,
// isum += s_j * dot_j summed through fp32 four sub-blocks at a time, exactly (|dot_j| <= 32 * 15 * 127, s_j <= 63:
// four products sum to at most 15.4M < 2^24). By scale parts (q4k_tile): with s_j = 16 * high_j + low_j, B holds
// the nibbles times low_j and, in a second tile, times high_j, so the tiles sum a whole super-block and it is read
// back once: an eighth of the read-backs for twice the weight bytes to unpack and store. Measured (paired runs of a
// 1B model's matrices against the AVX512 kernel, bench/kernels.py's stack): by scale parts 0.82x the time at 16
// rows, 0.59x at 64, 0.60-0.63x at 256; by sub-block 0.78-0.80x, 0.75x, 0.77x. With one tile of activation rows the
// unpacking is not shared, so batches under 32 rows go by sub-block.
//
// The tile configuration, the pipeline of steps (amx::tile_steps: weights unpacked a step ahead, dots stored a step
// after their multiplies and read back a step after that) and the walk over pairs and tiles are amx_tiles.h's; q4k by
// scale parts keeps a pipeline of its own (a super-block's dots stored a step into the next super-block and read back
// two steps after that).
#include "amx_tiles.h"
#include "avx512.h"
#include "kernels.h"
#include "kquant_minimums_avx512.h"
#include "prefetch.h"

#include <immintrin.h>


namespace tern {
namespace {

using amx::kTileRows;
using amx::TileShape;

// The minimums' pass (kquant_minimums_avx512.h) for a tile of MB rows m0.. that reads the activations' sums and
// scales from the rows themselves, not from activation_tiles.h's tiles; super-block s.
template <int MB>
inline void add_row_minimums(const QuantizedRows& q, int64_t m0, int64_t s, const uint8_t* sa, const uint8_t* sb,
                             __m512i top_bits, float (*result)[16]) {
  __m512i pairs[4];
  pair_minimums(sa, sb, top_bits, pairs);
  const __m512 minus_dmin = negative_dmin(sa, sb);
  const int64_t per_row = q.K / kInt4GroupCols;
  for (int m = 0; m < MB; ++m) {
    const int32_t* sums = reinterpret_cast<const int32_t*>(q.sums32 + (m0 + m) * per_row + s * 8);  // int16 pairs
    __m512i msum = _mm512_madd_epi16(pairs[0], _mm512_set1_epi32(sums[0]));
    for (int k = 1; k < 4; ++k) msum = _mm512_dpwssd_epi32(msum, pairs[k], _mm512_set1_epi32(sums[k]));
    const __m512 x_scale = _mm512_set1_ps(q.scales[(m0 + m) * q.blocks + s]);
    _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]),
        _mm512_mul_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(minus_dmin, x_scale))));
  }
}
using amx::WeightBytes;

constexpr int64_t kBlockTileBytes = 8 * 64;  // tile B: a block's 16 weight rows x 32 columns as bytes
// q4 and q4k by sub-block: a block of 32 columns per tile multiply. q4k by scale parts: 64 columns of activations in
// tile 4, their weights times the low and the high parts of their scales in tiles 6 and 7 (16 rows each), a
// super-block's two dot tiles in 0 and 1 (even super-blocks) or 2 and 3 (odd ones).
constexpr TileShape kBlockTiles{32, 8, 16};
constexpr TileShape kScalePartTiles{64, 16, 2 * 16};

// A block's 16 weight rows' nibbles as tile B's 8 rows of bytes (see the header).
template <WeightBytes kBytes>
inline void weight_rows(const uint8_t* nibbles_a, const uint8_t* nibbles_b, uint8_t (*rows)[64]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  auto as_stored = [](__m512i bytes) {
    return kBytes == WeightBytes::kSigned ? _mm512_sub_epi8(bytes, _mm512_set1_epi8(8)) : bytes;
  };
  for (int r = 0; r < 4; ++r) {
    const __m512i packed = avx512::two_groups(nibbles_a + 32 * r, nibbles_b + 32 * r);
    _mm512_storeu_si512(rows[2 * r], as_stored(_mm512_and_si512(packed, low)));
    _mm512_storeu_si512(rows[2 * r + 1], as_stored(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low)));
  }
}

// The two weight streams' lines ahead of blocks c0, c0 + 1, as the AVX512 pair loops ask for them: both layouts
// stream kQ4GroupBytes per block (a Q4_K super-block is 8 of them).
inline void prefetch_two_blocks(const uint8_t* wa, const uint8_t* wb, int64_t c0) {
  const int64_t group_stride = wb - wa;
  for (int64_t c = c0; c < c0 + 2; ++c) {
    prefetch_pair_stream<kQ4GroupBytes>(wa + c * kQ4GroupBytes, wa + group_stride, group_stride);
    prefetch_pair_stream<kQ4GroupBytes>(wb + c * kQ4GroupBytes, wb + group_stride, group_stride);
  }
}

// Unpacks step t's two blocks of 32 columns (nibbles_at(c): block c's nibbles in each group) for amx::tile_steps.
template <WeightBytes kBytes, class NibblesAt>
inline auto block_unpacker(const uint8_t* wa, const uint8_t* wb, uint8_t* weights, NibblesAt nibbles_at) {
  return [=](int64_t t) {
    prefetch_two_blocks(wa, wb, 2 * t);
    for (int64_t c = 2 * t; c < 2 * t + 2; ++c)
      weight_rows<kBytes>(wa + nibbles_at(c), wb + nibbles_at(c),
                          reinterpret_cast<uint8_t(*)[64]>(weights + c * kBlockTileBytes));
  };
}

// Sub-block j's 6-bit scales of the 16 weight rows (q4k super-block at sa and sb), one per int32 lane.
inline __m512i sub_block_scales(const uint8_t* sa, const uint8_t* sb, int j) {
  const __m512i lows = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 64 + 8 * j)),
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 64 + 8 * j))));
  const __m512i top = _mm512_srl_epi32(avx512::two_groups(sa + 32, sb + 32), _mm_cvtsi32_si128(2 * j));
  return _mm512_or_si512(_mm512_and_si512(lows, _mm512_set1_epi32(15)),
                         _mm512_slli_epi32(_mm512_and_si512(top, _mm512_set1_epi32(3)), 4));
}

// q4k for one tile of activation rows (a batch of 16 to 31 rows): out[m0..m0+15, rows n0..n0+15] against groups
// wa and wb, int4_avx512.cpp's q4k_pair_rows at 16 rows, a sub-block per tile multiply: the weights' nibbles as
// they are, each sub-block's dots read back and scaled (see the header for why this and not q4k_tile below).
void q4k_sub_block_tile(const Q4KProblem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, uint8_t* weights,
                        bool unpack, int64_t n0) {
  const QuantizedRows& q = *p.x;
  alignas(64) float result[kTileRows][16] = {};
  __m512i isum[kTileRows];
  __m512 fsum[kTileRows];
  for (int m = 0; m < kTileRows; ++m) isum[m] = _mm512_setzero_si512(), fsum[m] = _mm512_setzero_ps();
  auto nibbles_at = [](int64_t c) { return c / 8 * kQ4KSuperBytes + 128 + 128 * (c % 8); };
  amx::tile_steps<WeightBytes::kUnsigned, kInt4GroupCols>(
      q, q.values + m0 * q.K, weights, unpack, block_unpacker<WeightBytes::kUnsigned>(wa, wb, weights, nibbles_at),
      [&](int64_t step, const int32_t (*dots)[kTileRows][16]) {
    // sub-blocks j, j + 1 of super-block s
    const int64_t s = step / 4;
    const int j = static_cast<int>(step % 4) * 2;
    const uint8_t* sa = wa + s * kQ4KSuperBytes;
    const uint8_t* sb = wb + s * kQ4KSuperBytes;
    const __m512 scale0 = _mm512_cvtepi32_ps(sub_block_scales(sa, sb, j));
    const __m512 scale1 = _mm512_cvtepi32_ps(sub_block_scales(sa, sb, j + 1));
    for (int m = 0; m < kTileRows; ++m)
      fsum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[1][m])), scale1,
                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[0][m])), scale0, fsum[m]));
    if (j % 4 == 2) {  // four sub-blocks in fsum: into isum (exact, see the header)
      for (int m = 0; m < kTileRows; ++m) {
        isum[m] = _mm512_add_epi32(isum[m], _mm512_cvtps_epi32(fsum[m]));
        fsum[m] = _mm512_setzero_ps();
      }
    }
    if (j == 6) {  // the super-block's last: its float steps
      const __m512 d = avx512::two_fp16_rows(sa, sb);
      for (int m = 0; m < kTileRows; ++m) {
        const __m512 x_scale = _mm512_set1_ps(q.scales[(m0 + m) * q.blocks + s]);
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, x_scale));
        _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]), scaled));
        isum[m] = _mm512_setzero_si512();
      }
      add_row_minimums<kTileRows>(q, m0, s, sa, sb, avx512::two_groups(sa + 32, sb + 32), result);
    }
  });
  for (int m = 0; m < kTileRows; ++m)
    avx512::store16(p.out, (m0 + m) * p.N + n0, _mm512_load_ps(result[m]), p.out_bf16);
}

// q4k's weights for one tile multiply of 64 columns (sub-blocks c and c + 1, super-block c / 8): two B tiles of
// 16 rows x 64 bytes, the nibbles times the low 4 bits of their sub-block's scale (at most 15 * 15) and times its
// top 2 bits (at most 15 * 3), as bytes. Rows 0-7 sub-block c, 8-15 sub-block c + 1, each in weight_rows' order.
constexpr int64_t kQ4KStepBytes = 2 * 2 * kBlockTileBytes;
static_assert(kScalePartTiles.weight_bytes_per_column * 64 == kQ4KStepBytes);
static_assert(kBlockTiles.weight_bytes_per_column * kInt4GroupCols == kBlockTileBytes);

inline void q4k_scaled_weights(const uint8_t* wa, const uint8_t* wb, int64_t c, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h, ++c) {
    const uint8_t* sa = wa + c / 8 * kQ4KSuperBytes;
    const uint8_t* sb = wb + c / 8 * kQ4KSuperBytes;
    // Each int32 lane is one weight row's 4 bytes: its scale's parts in both 16-bit halves, so that one 16-bit
    // multiply scales two bytes (their products stay below 256: no carry from the low byte into the high one).
    const __m512i scale = sub_block_scales(sa, sb, static_cast<int>(c % 8));
    const __m512i both_halves = _mm512_set1_epi32(0x10001);
    const __m512i scale_low = _mm512_mullo_epi32(_mm512_and_si512(scale, _mm512_set1_epi32(15)), both_halves);
    const __m512i scale_high = _mm512_mullo_epi32(_mm512_srli_epi32(scale, 4), both_halves);
    uint8_t(*low_rows)[64] = reinterpret_cast<uint8_t(*)[64]>(out + h * kBlockTileBytes);
    uint8_t(*high_rows)[64] = reinterpret_cast<uint8_t(*)[64]>(out + 2 * kBlockTileBytes + h * kBlockTileBytes);
    const int64_t nibbles = c / 8 * kQ4KSuperBytes + 128 + 128 * (c % 8);
    for (int r = 0; r < 4; ++r) {
      const __m512i packed = avx512::two_groups(wa + nibbles + 32 * r, wb + nibbles + 32 * r);
      const __m512i lo = _mm512_and_si512(packed, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      _mm512_storeu_si512(low_rows[2 * r], _mm512_mullo_epi16(lo, scale_low));
      _mm512_storeu_si512(low_rows[2 * r + 1], _mm512_mullo_epi16(hi, scale_low));
      _mm512_storeu_si512(high_rows[2 * r], _mm512_mullo_epi16(lo, scale_high));
      _mm512_storeu_si512(high_rows[2 * r + 1], _mm512_mullo_epi16(hi, scale_high));
    }
  }
}

// q4k: out[m0..m0+15, rows n0..n0+15] against groups wa and wb, int4_avx512.cpp's q4k_pair_rows at 16 rows.
// With s_j = 16 * high_j + low_j, a super-block's isum = sum_j s_j * dot_j is 16 * (the dots against the weights
// times high_j) + (those against the weights times low_j): two tiles summed over the super-block's 256 columns in
// four multiplies each (at most 256 * 127 * 225 and 256 * 127 * 45, so isum is exact in int32 as in the AVX512
// kernel). Read back once per super-block, then its float steps and minimums as the AVX512 kernel's: the same bits.
// Pipelined as tile_steps (see the header): weights scaled a step (64 columns) ahead, a super-block's dots stored a
// step into the next one and read back two steps after that.
void q4k_tile(const Q4KProblem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, uint8_t* weights, bool unpack,
              int64_t n0) {
  const QuantizedRows& q = *p.x;
  const int8_t* x = q.values + m0 * q.K;
  alignas(64) float result[kTileRows][16] = {};
  alignas(64) int32_t dots[2][2][kTileRows][16];  // [super-block % 2][low, high]
  const int64_t steps = q.K / 64;  // four per super-block
  auto unpack_step = [&](int64_t t) {
    prefetch_two_blocks(wa, wb, 2 * t);
    q4k_scaled_weights(wa, wb, 2 * t, weights + t * kQ4KStepBytes);
  };
  auto read_back = [&](int64_t s, const int32_t (*dot)[kTileRows][16]) {
    const uint8_t* sa = wa + s * kQ4KSuperBytes;
    const uint8_t* sb = wb + s * kQ4KSuperBytes;
    const __m512 d = avx512::two_fp16_rows(sa, sb);
    for (int m = 0; m < kTileRows; ++m) {
      const __m512i isum = _mm512_add_epi32(_mm512_load_si512(dot[0][m]),
                                            _mm512_slli_epi32(_mm512_load_si512(dot[1][m]), 4));
      const __m512 x_scale = _mm512_set1_ps(q.scales[(m0 + m) * q.blocks + s]);
      _mm512_store_ps(result[m], _mm512_add_ps(_mm512_load_ps(result[m]),
                                               _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, x_scale))));
    }
    add_row_minimums<kTileRows>(q, m0, s, sa, sb, avx512::two_groups(sa + 32, sb + 32), result);
  };
  if (unpack) unpack_step(0);
  for (int64_t t = 0; t < steps + 4; ++t) {
    if (unpack && t + 1 < steps) unpack_step(t + 1);
    if (t < steps) {
      const uint8_t* bt = weights + t * kQ4KStepBytes;
      _tile_loadd(4, x + t * 64, q.K);
      _tile_loadd(6, bt, 64);
      _tile_loadd(7, bt + 2 * kBlockTileBytes, 64);
      if (t / 4 % 2 == 0) {
        if (t % 4 == 0) {
          _tile_zero(0);
          _tile_zero(1);
        }
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
      } else {
        if (t % 4 == 0) {
          _tile_zero(2);
          _tile_zero(3);
        }
        _tile_dpbsud(2, 4, 6);
        _tile_dpbsud(3, 4, 7);
      }
    }
    const int64_t previous = t / 4 - 1;  // the super-block before step t's
    if (t % 4 == 1 && previous >= 0) {
      if (previous % 2 == 0) {
        _tile_stored(0, dots[0][0], 64);
        _tile_stored(1, dots[0][1], 64);
      } else {
        _tile_stored(2, dots[1][0], 64);
        _tile_stored(3, dots[1][1], 64);
      }
    }
    if (t % 4 == 3 && previous >= 0) read_back(previous, dots[previous % 2]);
  }
  for (int m = 0; m < kTileRows; ++m)
    avx512::store16(p.out, (m0 + m) * p.N + n0, _mm512_load_ps(result[m]), p.out_bf16);
}

// q4: out[m0..m0+15, rows n0..n0+15] against groups wa and wb, int4_avx512.cpp's pair_rows<true> at 16 rows: per
// block c, dot = sum((q - 8) * xq) (the weights centred in the tile), then acc += dot * (d * x_scale), in the same
// order.
void q4_tile(const Q4Problem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, uint8_t* weights, bool unpack,
             int64_t n0) {
  const QuantizedRows& q = *p.x;
  __m512 acc[kTileRows];
  for (int m = 0; m < kTileRows; ++m) acc[m] = _mm512_setzero_ps();
  auto nibbles_at = [](int64_t c) { return c * kQ4GroupBytes; };
  amx::tile_steps<WeightBytes::kSigned, kInt4GroupCols>(
      q, q.values + m0 * q.K, weights, unpack, block_unpacker<WeightBytes::kSigned>(wa, wb, weights, nibbles_at),
      [&](int64_t step, const int32_t (*dots)[kTileRows][16]) {
    for (int h = 0; h < 2; ++h) {
      const int64_t c = 2 * step + h;
      const __m512 d = avx512::two_fp16_rows(wa + c * kQ4GroupBytes + 128, wb + c * kQ4GroupBytes + 128);
      for (int m = 0; m < kTileRows; ++m) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(q.scales[(m0 + m) * q.blocks + c]));
        acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[h][m])), scale));
      }
    }
  });
  for (int m = 0; m < kTileRows; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, acc[m], p.out_bf16);
}

}  // namespace

void q4k_groups_amx(const Q4KProblem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kQ4KSuperBytes;
  if (p.M < 2 * amx::kTileRows)  // one tile of activation rows: by sub-block (see the header)
    return amx::groups(p, g0, g1, group_stride, q4k_sub_block_tile, q4k_pairs_avx512, q4k_groups_avx2, kBlockTiles);
  amx::groups(p, g0, g1, group_stride, q4k_tile, q4k_pairs_avx512, q4k_groups_avx2, kScalePartTiles);
}

void q4_groups_amx(const Q4Problem& p, int64_t g0, int64_t g1) {
  // The tiles take blocks two at a time; an odd count (K = 32 * odd: no model here has one) stays on AVX512.
  if (p.x->blocks % 2) return q4_groups_avx512(p, g0, g1);
  amx::groups(p, g0, g1, p.x->blocks * kQ4GroupBytes, q4_tile, q4_pairs_avx512, q4_groups_avx2, kBlockTiles);
}

}  // namespace tern
