// 4-bit weights times int8 activations on AVX2 (kernels.h: int4_groups_avx2): GGUF's Q4_1 x Q8_1 dot product,
// laid out so that each output row stays in its own int32 lane, as in the int8 kernels.
//
//   y[m, n] = sum over groups g of 32 columns: x_scale[m, g] * (d[n, g] * dot(q[n, g], xq[m, g]) + m[n, g] * sum(xq[m, g]))
//
// A group of 8 weight rows and 32 columns is 160 bytes, read in order: 4 registers of nibbles (register j holds,
// for each row, columns 8j..8j+3 in its low nibbles and 8j+4..8j+7 in its high ones), then the 8 rows' fp16
// scales d and minimums m. Nibbles are unsigned (0..15) and activations signed, which is exactly what vpmaddubsw
// multiplies; 8 of its pair sums (at most 8 * 2 * 15 * 127 = 30,480) still fit int16, so a group needs one
// vpmaddwd to widen. Each group's float steps (acc += dot * (d * x_scale), then acc += m * (x_scale * sum)) are
// those the tests' PyTorch reference takes, bit for bit.
//
// The q4 layout (kernels.h: q4_groups_avx2, GGUF's Q4_0) is the same loop without minimums: 144 bytes a group, and
// per group dot = sum(q * xq) - 8 * sum(xq), exact, then one float step, q8's (acc += dot * (d * x_scale)).
// The q4k layout (GGUF's Q4_K) has a loop of its own below: the same dots, summed per super-block in integers.
#include "avx2.h"
#include "decoding.h"
#include "kernels.h"
#include "kquant_avx2.h"
#include "super_blocks_avx2.h"

#include <algorithm>
#include <cstdint>

namespace tern {
namespace {

constexpr int kTileRows = 4;  // activation rows sharing each weight load
constexpr int kPairTileRows = 4;  // the same, when two groups share each activation broadcast

// acc += one group's float steps: dot * (d * x_scale), then (int4) m * (x_scale * sum) or (q4: the dot less
// 8 * sum(xq) first, no minimum). `block` indexes the activations' (row, block).
template <bool kQ4>
inline __m256 add_group(__m256 acc, __m256i dot, const uint8_t* wc, const QuantizedRows& q, int64_t block) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 128)));
  if constexpr (kQ4) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * q.sums[block]));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(q.scales[block]))));
  if constexpr (!kQ4) {
    const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 144)));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(minimum, _mm256_set1_ps(q.sum_scales[block])));
  }
  return acc;
}

template <bool kQ4, int MB>
inline void group_rows(const Int4Problem& p, int64_t m0, const uint8_t* w, int64_t n0, const uint8_t* prefetch) {
  constexpr int64_t kBytes = kQ4 ? kQ4GroupBytes : kInt4GroupBytes;
  const QuantizedRows& q = *p.x;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < q.blocks; ++c) {
    const uint8_t* wc = w + c * kBytes;
    if (prefetch)
      for (int64_t line = 0; line < kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * kBytes + line), _MM_HINT_T0);
    __m256i sums[MB];
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      sums[m] = _mm256_setzero_si256();
      x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + c * kInt4GroupCols);
    }
    // Not unrolled: unrolled, gcc computed all 32 products first and spilled them (1.25x slower at 256 rows).
#pragma GCC unroll 1
    for (int j = 0; j < 4; ++j) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * j));
      const __m256i lo = _mm256_and_si256(packed, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      for (int m = 0; m < MB; ++m) {
        sums[m] = _mm256_add_epi16(sums[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[m][2 * j])));
        sums[m] = _mm256_add_epi16(sums[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[m][2 * j + 1])));
      }
    }
    for (int m = 0; m < MB; ++m)
      acc[m] = add_group<kQ4>(acc[m], _mm256_madd_epi16(sums[m], ones), wc, q, (m0 + m) * q.blocks + c);
  }
  for (int m = 0; m < MB; ++m) avx2::store8(p.out, (m0 + m) * p.N + n0, acc[m], p.out_bf16);
}

// One block of 32 columns of two groups against 4 activation rows: sums[g][m] += the 16 vpmaddubsw products of
// group g's nibbles (wa, wb: 128 bytes each) and row m's 32 int8s (x[m]), in int16 pairs. Written in assembly so the
// 8 sums stay in registers: 8 sums, the two groups' split nibbles, a mask, a broadcast and a product are 13 of the
// 16 ymm registers, and gcc, hoisting every broadcast and product it could, spilled half the sums (a store and a
// reload around each add; 70 instructions per register of weights where this takes 46). The low nibbles of both
// groups go against every row, then the high ones, so only two split registers live at once. The integers are
// the intrinsics' (adds in another order: exact), so the bits are. 0.86-0.89x the time of the intrinsics loop at 16
// and 64 rows on a 2-core AMD EPYC Zen 3 VM (one thread, the block alone in L1 and a 1B gate_up's shapes).
inline void pair_block_4rows(const uint8_t* wa, const uint8_t* wb, const int8_t* const (&x)[4], __m256i (&sums)[2][4],
                             __m256i low) {
  __m256i la, lb, bc, t;
#define TERN_ROW(XR, OFF, SA, SB)                                                            \
  "vpbroadcastd " OFF "(%[" XR "]), %[bc]\n\t"                                             \
  "vpmaddubsw %[bc], %[la], %[t]\n\t"                                                      \
  "vpaddw %[t], %[" SA "], %[" SA "]\n\t"                                                  \
  "vpmaddubsw %[bc], %[lb], %[t]\n\t"                                                      \
  "vpaddw %[t], %[" SB "], %[" SB "]\n\t"
#define TERN_ROWS(XOFF) \
  TERN_ROW("x0", XOFF, "s00", "s10") TERN_ROW("x1", XOFF, "s01", "s11") TERN_ROW("x2", XOFF, "s02", "s12") TERN_ROW("x3", XOFF, "s03", "s13")
#define TERN_LOW(W) "vpand " W "(%[wa]), %[low], %[la]\n\t" "vpand " W "(%[wb]), %[low], %[lb]\n\t"
#define TERN_HIGH(W)                                                                          \
  "vmovdqu " W "(%[wa]), %[la]\n\t" "vmovdqu " W "(%[wb]), %[lb]\n\t"                    \
  "vpsrlw $4, %[la], %[la]\n\t" "vpsrlw $4, %[lb], %[lb]\n\t"                            \
  "vpand %[la], %[low], %[la]\n\t" "vpand %[lb], %[low], %[lb]\n\t"
  // Register j of a group: columns 8j..8j+3 in its low nibbles, 8j+4..8j+7 in its high ones.
  asm(TERN_LOW("0") TERN_ROWS("0") TERN_HIGH("0") TERN_ROWS("4")
      TERN_LOW("32") TERN_ROWS("8") TERN_HIGH("32") TERN_ROWS("12")
      TERN_LOW("64") TERN_ROWS("16") TERN_HIGH("64") TERN_ROWS("20")
      TERN_LOW("96") TERN_ROWS("24") TERN_HIGH("96") TERN_ROWS("28")
      : [s00] "+x"(sums[0][0]), [s01] "+x"(sums[0][1]), [s02] "+x"(sums[0][2]), [s03] "+x"(sums[0][3]),
        [s10] "+x"(sums[1][0]), [s11] "+x"(sums[1][1]), [s12] "+x"(sums[1][2]), [s13] "+x"(sums[1][3]),
        [la] "=&x"(la), [lb] "=&x"(lb), [bc] "=&x"(bc), [t] "=&x"(t)
      : [wa] "r"(wa), [wb] "r"(wb), [x0] "r"(x[0]), [x1] "r"(x[1]), [x2] "r"(x[2]), [x3] "r"(x[3]), [low] "x"(low)
      : "memory");  // it reads wa's, wb's and the rows' bytes (an operand each would pass asm's limit of 30)
#undef TERN_ROW
#undef TERN_ROWS
#undef TERN_LOW
#undef TERN_HIGH
}

// Two neighbouring groups (16 rows) at once, for batches (`prefetch`: the next pair's first group, its second as far
// on as wb is from wa, asked for block by block into L1): each broadcast activation feeds two weight registers
// (prefill-sized batches 1.13x faster; one row, memory-bound, gains nothing and keeps the single-group loop).
// q4's sums start at the block's centring (QuantizedRows.q4_offsets: -8 * sum(xq) in each row's first int16 pair),
// so each row's dot leaves vpmaddwd as the exact sum((q - 8) * xq), where a scalar load, a multiply, a broadcast and a
// subtraction per group and row did it after: the even pair of a row then holds sum((q - 8) * xq) over its 16
// columns less 8 * the other 16 columns' sum, at most 2 * 16 * 8 * 127 = 32,512 in magnitude, an int16 (vpaddw
// wraps, so the partial sums on the way may not be).
template <bool kQ4, int MB>
inline void group_pair_rows(const Int4Problem& p, int64_t m0, const uint8_t* wa, const uint8_t* wb, int64_t n0,
                            const uint8_t* prefetch = nullptr) {
  constexpr int64_t kBytes = kQ4 ? kQ4GroupBytes : kInt4GroupBytes;
  const QuantizedRows& q = *p.x;
  // Locals, not q's fields: after the assembly's memory clobber gcc would read those again every block.
  const int64_t K = q.K, blocks = q.blocks;
  const int8_t* values = q.values + m0 * K;
  const int32_t* offsets = kQ4 ? q.q4_offsets + m0 * blocks : nullptr;
  const float *scales = q.scales + m0 * blocks, *sum_scales = q.sum_scales + m0 * blocks;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[2][MB];
  for (int m = 0; m < MB; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < blocks; ++c) {
    const uint8_t* wc[2] = {wa + c * kBytes, wb + c * kBytes};
    if (prefetch)
      for (int64_t line = 0; line < kBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * kBytes + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + (wb - wa) + c * kBytes + line), _MM_HINT_T0);
      }
    __m256i sums[2][MB];
    const int8_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      sums[0][m] = sums[1][m] = kQ4 ? _mm256_set1_epi32(offsets[m * blocks + c]) : _mm256_setzero_si256();
      x[m] = values + m * K + c * kInt4GroupCols;
    }
    if constexpr (MB == 4) {
      pair_block_4rows(wc[0], wc[1], x, sums, low);
    } else {
#pragma GCC unroll 1
      for (int j = 0; j < 4; ++j) {
        const __m256i pa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc[0] + 32 * j));
        const __m256i pb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc[1] + 32 * j));
        const __m256i loa = _mm256_and_si256(pa, low), hia = _mm256_and_si256(_mm256_srli_epi16(pa, 4), low);
        const __m256i lob = _mm256_and_si256(pb, low), hib = _mm256_and_si256(_mm256_srli_epi16(pb, 4), low);
        for (int m = 0; m < MB; ++m) {
          const int32_t* xm = reinterpret_cast<const int32_t*>(x[m]);
          const __m256i xl = _mm256_set1_epi32(xm[2 * j]), xh = _mm256_set1_epi32(xm[2 * j + 1]);
          sums[0][m] = _mm256_add_epi16(sums[0][m], _mm256_add_epi16(_mm256_maddubs_epi16(loa, xl), _mm256_maddubs_epi16(hia, xh)));
          sums[1][m] = _mm256_add_epi16(sums[1][m], _mm256_add_epi16(_mm256_maddubs_epi16(lob, xl), _mm256_maddubs_epi16(hib, xh)));
        }
      }
    }
    for (int g = 0; g < 2; ++g) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc[g] + 128)));
      for (int m = 0; m < MB; ++m) {  // add_group's float steps, on the dot centred already
        const __m256i dot = _mm256_madd_epi16(sums[g][m], ones);
        acc[g][m] = _mm256_add_ps(acc[g][m], _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(scales[m * blocks + c]))));
        if constexpr (!kQ4) {
          const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc[g] + 144)));
          acc[g][m] = _mm256_add_ps(acc[g][m], _mm256_mul_ps(minimum, _mm256_set1_ps(sum_scales[m * blocks + c])));
        }
      }
    }
  }
  for (int g = 0; g < 2; ++g)
    for (int m = 0; m < MB; ++m) avx2::store8(p.out, (m0 + m) * p.N + n0 + 8 * g, acc[g][m], p.out_bf16);
}

template <bool kQ4>
void groups(const Int4Problem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * (kQ4 ? kQ4GroupBytes : kInt4GroupBytes);  // 8 rows, all of K
  if (p.M > 1) {
    for (; g0 + 1 < g1; g0 += 2) {
      const uint8_t* wa = p.w + g0 * group_stride;
      // The first tile of rows asks for the next pair's bytes, as group_rows does for the next group: at 2-4 rows
      // (one tile) the loop took 0.80-0.82x the time, at 8 and 16 rows 0.92x and 0.94x (1B shapes, Zen 3, 2 threads).
      const uint8_t* next = g0 + 3 < g1 ? wa + 2 * group_stride : nullptr;
      for (int64_t m = 0; m < p.M; m += kPairTileRows, next = nullptr) {
        switch (std::min<int64_t>(kPairTileRows, p.M - m)) {
          case 1: group_pair_rows<kQ4, 1>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, next); break;
          case 2: group_pair_rows<kQ4, 2>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, next); break;
          case 3: group_pair_rows<kQ4, 3>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, next); break;
          default: group_pair_rows<kQ4, kPairTileRows>(p, m, wa, wa + group_stride, g0 * kInt4GroupRows, next); break;
        }
      }
    }
  }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = p.w + g * group_stride;
    const uint8_t* next = g + 1 < g1 ? wg + group_stride : nullptr;
    for (int64_t m = 0; m < p.M; m += kTileRows, next = nullptr) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: group_rows<kQ4, 1>(p, m, wg, g * kInt4GroupRows, next); break;
        case 2: group_rows<kQ4, 2>(p, m, wg, g * kInt4GroupRows, next); break;
        case 3: group_rows<kQ4, 3>(p, m, wg, g * kInt4GroupRows, next); break;
        default: group_rows<kQ4, kTileRows>(p, m, wg, g * kInt4GroupRows, next); break;
      }
    }
  }
}

// q4k (kernels.h: llama.cpp's Q4_K x Q8_K): one group of 8 rows against every activation row, a super-block at a
// time, tiles of kQ4KTileRows rows within it. The first tile decodes the super-block (nibbles split, the 6-bit scales
// and minimums unpacked: Q4KDecoded) and keeps it where more tiles follow; they load it. Decoding was 3 of every 8
// instructions per tile when each tile did its own, and a load takes none of the ports vpmaddubsw needs.
// Per sub-block j each row's 8 vpmaddubsw sum in int16 (at most 8 * 2 * 15 * 127 = 30,480); one vpmaddwd against
// s_j in both halves of each lane widens them and weights them by s_j at once (a lane at most 2 * 30,480 * 63, a
// super-block's 8 of them 30.7 million: int32), so isum = sum_j s_j * dot_j in integers and one float step follows.
// Then the minimums as vpmaddwd over int16 pairs and the second float step: the AVX512 kernel's integers and steps,
// so both give the same bits.
// Activation rows sharing each weight load: 6 measured 1.00-1.04x, 8 spilled registers (0.84-0.95x).
constexpr int kQ4KTileRows = 4;

struct Q4KDecoded {
  __m256i nibbles[8][4][2];  // per sub-block j and register r, the low and the high nibbles as bytes
  __m256i scale_pairs[8];    // s_j | s_j << 16 in each row's lane
  __m256i minimum_pairs[4];  // m_2k | m_2k+1 << 16
  __m256 d, negative_dmin;
};

// One sub-block of a decoded Q4_K super-block (nibbles: its 4 registers' low and high nibbles, 256 bytes; the
// scale pair s_j | s_j << 16) against 4 activation rows (x0..x3: their 32 int8s): isum[m] += s_j * dot, the
// integers of q4k_super_rows' loop. In assembly for pair_block_4rows' reason: the 4 int16 sums, the 4 int32 sums,
// two nibble registers, a broadcast and a product stay in registers, where gcc's loop copied each row's sums between
// registers once per register of nibbles (32 instructions per 8 vpmaddubsw, here 26). The tiles that load a decoded
// super-block (all but a group's first 4 rows) took 0.83-0.86x the time at 16, 64 and 256 rows (2-core AMD EPYC
// Zen 3 VM, one thread, 1B gate_up shapes).
inline void q4k_sub_block_4rows(const __m256i* nibbles, const __m256i* scale_pair, const int8_t* x0, const int8_t* x1,
                                const int8_t* x2, const int8_t* x3, __m256i (&isum)[4]) {
  __m256i s0, s1, s2, s3, lo, hi, bc, t;
#define TERN_FIRST(XR, S) \
  "vpbroadcastd 0(%[" XR "]), %[bc]\n\t" "vpmaddubsw %[bc], %[lo], %[" S "]\n\t" \
  "vpbroadcastd 4(%[" XR "]), %[bc]\n\t" "vpmaddubsw %[bc], %[hi], %[t]\n\t" "vpaddw %[t], %[" S "], %[" S "]\n\t"
#define TERN_NEXT(XR, OFF, OFF4, S) \
  "vpbroadcastd " OFF "(%[" XR "]), %[bc]\n\t" "vpmaddubsw %[bc], %[lo], %[t]\n\t" "vpaddw %[t], %[" S "], %[" S "]\n\t" \
  "vpbroadcastd " OFF4 "(%[" XR "]), %[bc]\n\t" "vpmaddubsw %[bc], %[hi], %[t]\n\t" "vpaddw %[t], %[" S "], %[" S "]\n\t"
#define TERN_LOAD(R) "vmovdqa " R "*64(%[w]), %[lo]\n\t" "vmovdqa " R "*64+32(%[w]), %[hi]\n\t"
#define TERN_REG(R, OFF, OFF4) TERN_LOAD(R) TERN_NEXT("x0", OFF, OFF4, "s0") TERN_NEXT("x1", OFF, OFF4, "s1") \
  TERN_NEXT("x2", OFF, OFF4, "s2") TERN_NEXT("x3", OFF, OFF4, "s3")
#define TERN_SCALE(S, I) "vpmaddwd (%[sp]), %[" S "], %[t]\n\t" "vpaddd %[t], %[" I "], %[" I "]\n\t"
  asm(TERN_LOAD("0") TERN_FIRST("x0", "s0") TERN_FIRST("x1", "s1") TERN_FIRST("x2", "s2") TERN_FIRST("x3", "s3")
      TERN_REG("1", "8", "12") TERN_REG("2", "16", "20") TERN_REG("3", "24", "28")
      TERN_SCALE("s0", "i0") TERN_SCALE("s1", "i1") TERN_SCALE("s2", "i2") TERN_SCALE("s3", "i3")
      : [i0] "+x"(isum[0]), [i1] "+x"(isum[1]), [i2] "+x"(isum[2]), [i3] "+x"(isum[3]),
        [s0] "=&x"(s0), [s1] "=&x"(s1), [s2] "=&x"(s2), [s3] "=&x"(s3), [lo] "=&x"(lo), [hi] "=&x"(hi),
        [bc] "=&x"(bc), [t] "=&x"(t)
      : [w] "r"(nibbles), [sp] "r"(scale_pair), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3)
      : "memory");
#undef TERN_FIRST
#undef TERN_NEXT
#undef TERN_LOAD
#undef TERN_REG
#undef TERN_SCALE
}

// result[m][8] += rows m0..m0 + MB - 1's products with super-block s of a group (`super` its bytes).
template <int MB, Decoding kDecoding>
inline void q4k_super_rows(const Q4KProblem& p, int64_t m0, int64_t s, const uint8_t* super, Q4KDecoded& w,
                           float (*result)[8]) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks, q.sums32 (int16) per 32 values
  const int64_t per_row = q.K / kInt4GroupCols;
  const __m256i low = _mm256_set1_epi8(0x0F), fifteen = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3);
  __m256i top;  // s_j's top bits at 2j, m_j's at 16 + 2j; shifted down as j goes
  if constexpr (kDecoding != Decoding::kLoad) top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 32));
  __m256i isum[MB];
  for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
  if constexpr (kDecoding == Decoding::kLoad && MB == 4) {
    const int64_t K = q.K;
    const int8_t* x0 = q.values + m0 * K + s * kQ4KSuperCols;
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const int8_t* xj = x0 + j * kInt4GroupCols;
      q4k_sub_block_4rows(&w.nibbles[j][0][0], &w.scale_pairs[j], xj, xj + K, xj + 2 * K, xj + 3 * K, isum);
    }
  } else {
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const uint8_t* wc = super + 128 + 128 * j;
      const int32_t* x[MB];
      for (int m = 0; m < MB; ++m)
        x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + s * kQ4KSuperCols + j * kInt4GroupCols);
      // Register r's low and high nibbles times each row's activations, summed in int16 pairs.
      const auto products = [&](int r, __m256i (&pairs)[MB]) {
        __m256i packed;
        if constexpr (kDecoding != Decoding::kLoad) packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * r));
        const __m256i lo = decoded_value<kDecoding>(&w.nibbles[j][r][0], [&] { return _mm256_and_si256(packed, low); });
        const __m256i hi = decoded_value<kDecoding>(&w.nibbles[j][r][1],
                                                    [&] { return _mm256_and_si256(_mm256_srli_epi16(packed, 4), low); });
        for (int m = 0; m < MB; ++m)
          pairs[m] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[m][2 * r])),
                                      _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[m][2 * r + 1])));
      };
      __m256i sums[MB];
      products(0, sums);  // the first register's products start the sums: no add to zero
      // Not unrolled: unrolled, gcc computed all 32 products first and spilled them.
#pragma GCC unroll 1
      for (int r = 1; r < 4; ++r) {
        __m256i pairs[MB];
        products(r, pairs);
        for (int m = 0; m < MB; ++m) sums[m] = _mm256_add_epi16(sums[m], pairs[m]);
      }
      // Taken after the products: read (kLoad) as vpmaddwd's memory operand, not held in a register through them.
      const __m256i scale_pair = decoded_value<kDecoding>(&w.scale_pairs[j], [&] {
        const __m256i lows = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 64 + 8 * j)));
        const __m256i scale = _mm256_or_si256(_mm256_and_si256(lows, fifteen),
                                              _mm256_slli_epi32(_mm256_and_si256(top, three), 4));
        top = _mm256_srli_epi32(top, 2);
        return _mm256_or_si256(scale, _mm256_slli_epi32(scale, 16));
      });
      for (int m = 0; m < MB; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(sums[m], scale_pair));
    }
  }
  const __m256 d = decoded_value<kDecoding>(&w.d, [&] {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super)));
  });
  // The minimums: per pair of sub-blocks (2k, 2k + 1) a lane's m_2k | m_2k+1 << 16 against the activations' two
  // int16 sums, one vpmaddwd.
  __m256i pairs[4];
  for (int k = 0; k < 4; ++k)
    pairs[k] = decoded_value<kDecoding>(&w.minimum_pairs[k], [&] {
      return kquant::minimum_pair(super, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 32)), k);
    });
  const __m256 negative_dmin = decoded_value<kDecoding>(&w.negative_dmin, [&] { return kquant::negative_dmin(super); });
  kquant::finish_super_block<MB>(result, isum, d, pairs, negative_dmin, q.scales + m0 * q.blocks + s, q.blocks,
                                 q.sums32 + m0 * per_row + s * 8, per_row);
}

}  // namespace

void q4k_groups_avx2(const Q4KProblem& p, int64_t g0, int64_t g1) {
  thread_local Q4KDecoded thread_decoded;
  // Bound once: a thread_local named in the lambda is looked up (__tls_get_addr) at every tile, ~2% of a prompt.
  Q4KDecoded& decoded = thread_decoded;
  const auto tile = [&](auto rows, auto decoding, int64_t m, int64_t s, const uint8_t* super, float (*result)[8]) {
    q4k_super_rows<decltype(rows)::value, decltype(decoding)::value>(p, m, s, super, decoded, result);
  };
  walk_super_blocks<kQ4KTileRows, kQ4KSuperBytes>(p, g0, g1, tile);
}

void int4_groups_avx2(const Int4Problem& p, int64_t g0, int64_t g1) { groups<false>(p, g0, g1); }

void q4_groups_avx2(const Q4Problem& p, int64_t g0, int64_t g1) { groups<true>(p, g0, g1); }

}  // namespace tern
