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
// -8 * sum(xq), so it ends at sum((q - 8) * xq), and one float step follows, q8's.
#include "avx512.h"
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>

namespace tern {
namespace {

constexpr int kTileRows = 8;  // activation rows sharing each weight load
// Both streams are prefetched 4 blocks (640 bytes) ahead: on a 1B model's decode stack that took the kernel from
// 22 to ~25 GB/s on a 2-core AVX512 VM (26.5 GB/s streaming read); 2, 8 and 16 blocks did no better. Reading
// past a row group's end touches the next group's lines, which are read next anyway.
constexpr int64_t kPrefetchBlocks = 4;

// out[m, rows n0..n0+15] for MB activation rows against groups wa (rows n0..n0+7) and wb (n0+8..n0+15); kQ4: the
// q4 layout (no minimums), else int4.
template <bool kQ4, int MB>
inline void pair_rows(const Int4Problem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, int64_t n0) {
  constexpr int64_t kBytes = kQ4 ? kQ4GroupBytes : kInt4GroupBytes;
  const QuantizedRows& q = *p.x;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < q.blocks; ++c) {
    const uint8_t* ca = wa + c * kBytes;
    const uint8_t* cb = wb + c * kBytes;
    for (int line = 0; line < kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ca + kPrefetchBlocks * kBytes + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(cb + kPrefetchBlocks * kBytes + line), _MM_HINT_T0);
    }
    __m512i dot[MB];
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      dot[m] = kQ4 ? _mm512_set1_epi32(-8 * q.sums[(m0 + m) * q.blocks + c]) : _mm512_setzero_si512();
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
    const __m512 d = avx512::two_fp16_rows(ca + 128, cb + 128);
    if constexpr (kQ4) {
      for (int m = 0; m < MB; ++m) {
        const float x_scale = q.scales[(m0 + m) * q.blocks + c];
        acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(x_scale))));
      }
    } else {
      const __m512 minimum = avx512::two_fp16_rows(ca + 144, cb + 144);
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

template <bool kQ4>
void groups(const Int4Problem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * (kQ4 ? kQ4GroupBytes : kInt4GroupBytes);  // 8 rows, all of K
  for (; g0 + 1 < g1; g0 += 2) {
    const uint8_t* wa = p.w + g0 * group_stride;
    for (int64_t m = 0; m < p.M; m += kTileRows) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: pair_rows<kQ4, 1>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
        case 2: pair_rows<kQ4, 2>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
        case 3: pair_rows<kQ4, 3>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
        case 4: pair_rows<kQ4, 4>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
        case 5: pair_rows<kQ4, 5>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
        case 6: pair_rows<kQ4, 6>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
        case 7: pair_rows<kQ4, 7>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
        default: pair_rows<kQ4, kTileRows>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows); break;
      }
    }
  }
  // An odd group left: the AVX2 kernel, the same bits.
  if (g0 < g1) kQ4 ? q4_groups_avx2(p, g0, g1) : int4_groups_avx2(p, g0, g1);
}

}  // namespace

void int4_groups_avx512(const Int4Problem& p, int64_t g0, int64_t g1) { groups<false>(p, g0, g1); }

void q4_groups_avx512(const Q4Problem& p, int64_t g0, int64_t g1) { groups<true>(p, g0, g1); }

}  // namespace tern
