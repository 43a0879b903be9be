// int8 weights with a scale per 32 values (GGUF's Q8_0) times int8 activations on AVX2 (kernels.h:
// q8_groups_avx2): the int4 AVX2 kernel's loop over groups of 8 rows and 32 columns, with bytes for nibbles.
//
// The stored bytes are q + 128 (the AVX512 kernel's vpdpbusd wants them unsigned). vpmaddubsw would saturate on
// (q + 128) * x, so, as the per-row int8 kernel does: flip the top bit back to q, multiply |q| by x carrying q's
// sign (a pair sums to at most 2 * 128 * 127 = 32,512), and widen each register's pairs into int32 with vpmaddwd.
// The group's dot product is the exact integer sum(q * xq) the AVX512 kernel gets, and the float step after it
// (acc += dot * (d * x_scale)) is the same, so both kernels give the same bits.
#include "avx2.h"
#include "kernels.h"

#include <algorithm>

namespace tern {
namespace {

constexpr int kTileRows = 4;  // activation rows sharing each weight load

template <int MB>
inline void group_rows(const Q8Problem& p, int64_t m0, const uint8_t* w, int64_t n0, const uint8_t* prefetch) {
  const QuantizedRows& q = *p.x;
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < q.blocks; ++c) {
    const uint8_t* wc = w + c * kQ8GroupBytes;
    if (prefetch)
      for (int64_t line = 0; line < kQ8GroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * kQ8GroupBytes + line), _MM_HINT_T0);
    __m256i dot[MB];
    const int32_t* x[MB];
    for (int m = 0; m < MB; ++m) {
      dot[m] = _mm256_setzero_si256();
      x[m] = reinterpret_cast<const int32_t*>(q.values + (m0 + m) * q.K + c * kQ8GroupCols);
    }
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const __m256i signed_w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * j)), offset);
      const __m256i magnitude = _mm256_abs_epi8(signed_w);
      for (int m = 0; m < MB; ++m) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(x[m][j]), signed_w));
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 256)));
    for (int m = 0; m < MB; ++m) {
      const float x_scale = q.scales[(m0 + m) * q.blocks + c];
      acc[m] = _mm256_add_ps(acc[m], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(d, _mm256_set1_ps(x_scale))));
    }
  }
  for (int m = 0; m < MB; ++m) avx2::store8(p.out, (m0 + m) * p.N + n0, acc[m], p.out_bf16);
}

}  // namespace

void q8_groups_avx2(const Q8Problem& p, int64_t g0, int64_t g1) {
  const int64_t group_stride = p.x->blocks * kQ8GroupBytes;  // one group of 8 rows, all of K
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = p.w + g * group_stride;
    // The first tile of rows asks for the next group's bytes, so reading memory overlaps the arithmetic.
    const uint8_t* next = g + 1 < g1 ? wg + group_stride : nullptr;
    for (int64_t m = 0; m < p.M; m += kTileRows, next = nullptr) {
      switch (std::min<int64_t>(kTileRows, p.M - m)) {
        case 1: group_rows<1>(p, m, wg, g * kQ8GroupRows, next); break;
        case 2: group_rows<2>(p, m, wg, g * kQ8GroupRows, next); break;
        case 3: group_rows<3>(p, m, wg, g * kQ8GroupRows, next); break;
        default: group_rows<kTileRows>(p, m, wg, g * kQ8GroupRows, next); break;
      }
    }
  }
}

}  // namespace tern
