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
// -8 * sum(xq), so it ends at sum((q - 8) * xq), and one float step follows, q8's. The q4k layout (q4k_groups_avx512,
// GGUF's Q4_K) is int4's loop with each group's d and m computed from its super-block's header, as the AVX2 kernel
// computes them.
#include "avx512.h"
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace tern {
namespace {

constexpr int kTileRows = 8;  // activation rows sharing each weight load
// Both streams are prefetched 4 blocks (640 bytes) ahead: on a 1B model's decode stack that took the kernel from
// 22 to ~25 GB/s on a 2-core AVX512 VM (26.5 GB/s streaming read); 2, 8 and 16 blocks did no better. Reading
// past a row group's end touches the next group's lines, which are read next anyway.
constexpr int64_t kPrefetchBlocks = 4;

// Which 4-bit layout a loop reads (kernels.h).
enum class Form { kInt4, kQ4, kQ4K };

// Bytes per group of 8 rows and 32 columns (q4k: on average; its groups come 8 to a super-block).
template <Form kForm>
constexpr int64_t kBytes = kForm == Form::kInt4 ? kInt4GroupBytes : kQ4GroupBytes;

// Where block c's 128 bytes of nibbles are in a group of rows' bytes.
template <Form kForm>
inline const uint8_t* nibbles(const uint8_t* w, int64_t c) {
  if constexpr (kForm == Form::kQ4K) return w + (c / 8) * kQ4KSuperBytes + 128 + (c % 8) * 128;
  else return w + c * kBytes<kForm>;
}

// Block c's d (and, int4 and q4k, m) for the 8 rows of group a (low lanes) and the 8 of group b (high lanes).
template <Form kForm>
inline void group_scales(const uint8_t* wa, const uint8_t* wb, int64_t c, __m512& d, __m512& minimum) {
  if constexpr (kForm == Form::kQ4K) {
    const uint8_t* sa = wa + (c / 8) * kQ4KSuperBytes;
    const uint8_t* sb = wb + (c / 8) * kQ4KSuperBytes;
    const int j = static_cast<int>(c % 8);
    const __m512i hi = avx512::two_groups(sa + 32, sb + 32);
    const __m512i low = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sa + 64 + 8 * j)),
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 64 + 8 * j))));
    const __m512i three = _mm512_set1_epi32(3);
    const __m512i scale = _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(15)),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(hi, _mm_cvtsi32_si128(2 * j)), three), 4));
    const __m512i min = _mm512_or_si512(_mm512_srli_epi32(low, 4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(hi, _mm_cvtsi32_si128(16 + 2 * j)), three), 4));
    d = _mm512_mul_ps(_mm512_cvtepi32_ps(scale), avx512::two_fp16_rows(sa, sb));
    minimum = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(min), avx512::two_fp16_rows(sa + 16, sb + 16))),
        _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  } else {
    const uint8_t* ca = wa + c * kBytes<kForm>;
    const uint8_t* cb = wb + c * kBytes<kForm>;
    d = avx512::two_fp16_rows(ca + 128, cb + 128);
    if constexpr (kForm == Form::kInt4) minimum = avx512::two_fp16_rows(ca + 144, cb + 144);
  }
}

// out[m, rows n0..n0+15] for MB activation rows against groups wa (rows n0..n0+7) and wb (n0+8..n0+15).
// `table` (q4k, prefill-sized batches): each block's d and m, 2 registers a block, computed once for all tiles.
template <Form kForm, int MB>
inline void pair_rows(const Int4Problem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, int64_t n0,
                      const __m512* table) {
  constexpr int64_t kGroupBytes = kBytes<kForm>;
  const QuantizedRows& q = *p.x;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < q.blocks; ++c) {
    const uint8_t* ca = nibbles<kForm>(wa, c);
    const uint8_t* cb = nibbles<kForm>(wb, c);
    // In step with c (a q4k group's bytes are 144 a block on average, its header first).
    for (int line = 0; line < kGroupBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(wa + (c + kPrefetchBlocks) * kGroupBytes + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + (c + kPrefetchBlocks) * kGroupBytes + line), _MM_HINT_T0);
    }
    __m512i dot[MB];
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      dot[m] = kForm == Form::kQ4 ? _mm512_set1_epi32(-8 * q.sums[(m0 + m) * q.blocks + c]) : _mm512_setzero_si512();
      x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + c * kInt4GroupCols);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = avx512::two_groups(ca + 32 * j, cb + 32 * j);
      const __m512i lo = _mm512_and_si512(packed, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      for (int m = 0; m < MB; ++m) {
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x[m][2 * j]));
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x[m][2 * j + 1]));
      }
    }
    __m512 d, minimum;
    if (table) {
      d = table[2 * c];
      minimum = table[2 * c + 1];
    } else {
      group_scales<kForm>(wa, wb, c, d, minimum);
    }
    if constexpr (kForm == Form::kQ4) {
      for (int m = 0; m < MB; ++m) {
        const float x_scale = q.scales[(m0 + m) * q.blocks + c];
        acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(x_scale))));
      }
    } else {
      for (int m = 0; m < MB; ++m) {
        const int64_t block = (m0 + m) * q.blocks + c;
        const float x_scale = q.scales[block];
        acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(x_scale))));
        acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(minimum, _mm512_set1_ps(q.sum_scales[block])));
      }
    }
  }
  for (int m = 0; m < MB; ++m) avx512::store16(p.out, (m0 + m) * p.N + n0, acc[m], p.out_bf16);
}

template <Form kForm>
void groups(const Int4Problem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kBytes<kForm>;  // 8 rows, all of K
  // q4k's d and m take ~20 instructions a block to decode: for prefill-sized batches once per block, not per tile
  // (at 16 rows or fewer that measured no faster).
  std::vector<__m512> table(kForm == Form::kQ4K && p.M > 2 * kTileRows ? 2 * p.x->blocks : 0);
  for (; g0 + 1 < g1; g0 += 2) {
    const uint8_t* wa = p.w + g0 * group_stride;
    for (int64_t c = 0; c < static_cast<int64_t>(table.size()) / 2; ++c)
      group_scales<kForm>(wa, wa + group_stride, c, table[2 * c], table[2 * c + 1]);
    const __m512* scales = table.empty() ? nullptr : table.data();
    for (int64_t m = 0; m < p.M; m += kTileRows) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: pair_rows<kForm, 1>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
        case 2: pair_rows<kForm, 2>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
        case 3: pair_rows<kForm, 3>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
        case 4: pair_rows<kForm, 4>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
        case 5: pair_rows<kForm, 5>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
        case 6: pair_rows<kForm, 6>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
        case 7: pair_rows<kForm, 7>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
        default: pair_rows<kForm, kTileRows>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, scales); break;
      }
    }
  }
  // An odd group left: the AVX2 kernel, the same bits.
  if (g0 < g1) {
    if constexpr (kForm == Form::kInt4) int4_groups_avx2(p, g0, g1);
    else if constexpr (kForm == Form::kQ4) q4_groups_avx2(p, g0, g1);
    else q4k_groups_avx2(p, g0, g1);
  }
}

}  // namespace

void int4_groups_avx512(const Int4Problem& p, int64_t g0, int64_t g1) { groups<Form::kInt4>(p, g0, g1); }

void q4_groups_avx512(const Q4Problem& p, int64_t g0, int64_t g1) { groups<Form::kQ4>(p, g0, g1); }

void q4k_groups_avx512(const Q4KProblem& p, int64_t g0, int64_t g1) { groups<Form::kQ4K>(p, g0, g1); }

}  // namespace tern
