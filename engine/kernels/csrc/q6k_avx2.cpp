// 6-bit weights (GGUF's Q6_K, kernels.h: q6k_groups_avx2) times int8 activations on AVX2: one group of 8 rows in 8
// int32 lanes against every activation row, a super-block at a time, tiles of kTileRows rows within it. The AVX512
// kernel (q6k_avx512.cpp) takes its odd group here.
//
// The first tile decodes the super-block (the 6-bit values from nibbles and top bits, the scales as int16 pairs:
// Q6KDecoded) and keeps it where more tiles follow; they load it. Decoding took 9 instructions a register, more than
// the 5 of its dots, when each tile of 4 rows did its own.
//
// Per nibble register (8 columns of a sub-block j) each row's two vpmaddubsw (unsigned 6-bit values times signed
// activations) sum in int16 pairs (at most 2 * 2 * 63 * 127 = 32,004: no saturation), and one vpmaddwd against s_j
// in both halves of each lane widens them and weights them by s_j at once, so isum gathers sum_j s_j * dot_j. The
// -32 of every value comes off once per super-block: per pair of sub-blocks one vpmaddwd of (s_2k, s_2k+1) against
// the activations' sums (sums16_2k, sums16_2k+1), isum -= 32 * their sum. isum is the integer of kernels.h (sum_j s_j *
// (dot_j - 32 * sums16_j), at most 134M in magnitude, every partial sum too), and the float step per super-block is
// the same: the AVX512 kernel's bits.
#include "avx2.h"
#include "decoding.h"
#include "kernels.h"
#include "kquant_avx2.h"
#include "super_blocks_avx2.h"

#include <algorithm>
#include <cstdint>

namespace tern {
namespace {

// Activation rows sharing each weight load: 8 spilled registers (0.84x the speed at 16 rows), 4 measured 0.96-0.98x.
constexpr int kTileRows = 6;

struct Q6KDecoded {
  __m256i values[8][4][2];  // per block of 32 columns and nibble register, the low and high nibbles' 6-bit values
  __m256i scale_pairs[16];  // s_j in both int16 halves of each row's lane
  __m256i offset_pairs[8];  // s_2k | s_2k+1 << 16 (int16 halves)
  __m256 d;
};

// Nibble register `packed`'s 6-bit values, its low and high nibbles: the top bits of an even register sit at bits
// 0-1 (low) and 2-3 (high) of the top-bit register's bytes, of an odd one at 4-5 and 6-7; each pair goes to bits 4-5.
inline void six_bits(__m256i packed, __m256i highs, bool odd, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  lo = _mm256_and_si256(packed, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
  const __m256i lo_top = odd ? highs : _mm256_slli_epi16(highs, 4);
  const __m256i hi_top = odd ? _mm256_srli_epi16(highs, 2) : _mm256_slli_epi16(highs, 2);
  lo = _mm256_or_si256(lo, _mm256_and_si256(lo_top, top));
  hi = _mm256_or_si256(hi, _mm256_and_si256(hi_top, top));
}

// result[m][8] += rows m0..m0 + MB - 1's products with super-block s of a group (`super` its bytes).
template <int MB, Decoding kDecoding>
inline void super_rows(const Q6KProblem& p, int64_t m0, int64_t s, const uint8_t* super, Q6KDecoded& w,
                       float (*result)[8]) {
  const QuantizedRows& q = *p.x;  // blocks of 256: q.blocks super-blocks, q.sums16 (int16) per 16 values
  const __m256i halves = _mm256_set1_epi32(0xFFFF);
  __m256i isum[MB];
  for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int c = 0; c < 8; ++c) {
    const uint8_t* wc = super + kQ6KHeaderBytes + c * kQ6KBlockBytes;
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m)
      x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + s * kQ6KSuperCols + c * 32);
    for (int h = 0; h < 2; ++h) {  // sub-block j = 2c + h: nibble registers 2h and 2h + 1, top-bit register h
      const int j = 2 * c + h;
      const __m256i scale_pair = decoded_value<kDecoding>(&w.scale_pairs[j], [&] {
        const __m256i scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 16 + 8 * j)));
        return _mm256_or_si256(_mm256_and_si256(scale, halves), _mm256_slli_epi32(scale, 16));
      });
      __m256i highs;
      if constexpr (kDecoding != Decoding::kLoad)
        highs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 128 + 32 * h));
      for (int k = 0; k < 2; ++k) {
        const int i = 2 * h + k;
        __m256i lo, hi;
        if constexpr (kDecoding == Decoding::kLoad) {
          lo = w.values[c][i][0];
          hi = w.values[c][i][1];
        } else {
          six_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * i)), highs, k == 1, lo, hi);
          if constexpr (kDecoding == Decoding::kKeep) {
            w.values[c][i][0] = lo;
            w.values[c][i][1] = hi;
          }
        }
        for (int m = 0; m < MB; ++m) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[m][2 * i])),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[m][2 * i + 1])));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(pairs, scale_pair));
        }
      }
    }
  }
  // The -32 of each value: isum -= 32 * sum_j s_j * sums16_j, over pairs of sub-blocks.
  __m256i offset_pairs[8];
  for (int k = 0; k < 8; ++k)
    offset_pairs[k] = decoded_value<kDecoding>(&w.offset_pairs[k], [&] {
      const __m256i even = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 16 + 16 * k)));
      const __m256i odd = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 24 + 16 * k)));
      return _mm256_or_si256(_mm256_and_si256(even, halves), _mm256_slli_epi32(odd, 16));
    });
  const __m256 d = decoded_value<kDecoding>(&w.d, [&] {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super)));
  });
  // The strides in locals: the float stores (may-alias vector types) would make every row read them from q again.
  const int64_t blocks = q.blocks, per_row = q.K / 16;
  const float* x_scales = q.scales + m0 * blocks + s;
  const int16_t* x_sums = q.sums16 + m0 * per_row + s * 16;
  for (int m = 0; m < MB; ++m) {
    const int32_t* sums = reinterpret_cast<const int32_t*>(x_sums + m * per_row);  // int16 pairs
    __m256i offset = _mm256_madd_epi16(offset_pairs[0], _mm256_set1_epi32(sums[0]));
    for (int k = 1; k < 8; ++k) offset = _mm256_add_epi32(offset, _mm256_madd_epi16(offset_pairs[k], _mm256_set1_epi32(sums[k])));
    const __m256i total = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(offset, 5));
    kquant::add_scaled(result[m], total, d, x_scales[m * blocks]);
  }
}

}  // namespace

void q6k_groups_avx2(const Q6KProblem& p, int64_t g0, int64_t g1) {
  thread_local Q6KDecoded thread_decoded;
  // Bound once: a thread_local named in the lambda is looked up (__tls_get_addr) at every tile, ~2% of a prompt.
  Q6KDecoded& decoded = thread_decoded;
  const auto tile = [&](auto rows, auto decoding, int64_t m, int64_t s, const uint8_t* super, float (*result)[8]) {
    super_rows<decltype(rows)::value, decltype(decoding)::value>(p, m, s, super, decoded, result);
  };
  walk_super_blocks<kTileRows, kQ6KSuperBytes>(p, g0, g1, tile);
}

}  // namespace tern
