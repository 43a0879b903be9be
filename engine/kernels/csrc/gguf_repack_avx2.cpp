// GGUF blocks into Tern's layouts at load time (kernels.h: gguf_int4_groups, gguf_q4_groups, gguf_q4k_groups,
// gguf_q5k_groups, gguf_q6k_groups, gguf_q8_groups): the C++ twins of engine/weights/gguf_blocks.py's torch repacking
// (int4: Q4_0, Q4_1, Q4_K; q4: Q4_0; q4k: Q4_K; q5k: Q5_K; q6k: Q6_K), of gguf's numpy de-quantizer followed by
// quant.quantize_q8 (q8: Q8_0 as it is, Q4_0 and Q5_0 levels as they are; Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, F16, BF16,
// F32 re-quantized per 32 values) and of quant.quantize_int4 (int4: F16, BF16, F32 quantized per 32 values).
// Bit for bit the same bytes: the float steps are numpy's and torch's, in their order, with no fused multiply-add
// (-ffp-contract=off) and round-to-nearest-even everywhere. Why in C++: torch's many passes and gguf's numpy spent
// 3-4 s of a 1B Q4_K_M file's start on 2 cores; this reads each block once.
//
// Block layouts are llama.cpp's (ggml-common.h), as gguf's reference de-quantizers read them.
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tern {
namespace {

// ggml type ids (ggml.h / gguf.GGMLQuantizationType).
constexpr int kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
              kQ6_K = 14, kBF16 = 30;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// The 6-bit scale and minimum of sub-block j of a K-quant super-block (Q4_K, Q5_K), from its 12 bytes.
inline void k_scale_min(const uint8_t* s, int j, int& scale, int& minimum) {
  if (j < 4) {
    scale = s[j] & 0x3F;
    minimum = s[j + 4] & 0x3F;
  } else {
    scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    minimum = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

inline uint32_t word_at(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  return word;
}

constexpr uint32_t kLowNibbles = 0x0F0F0F0Fu;

// Sub-block j (32 values) of a K-quant super-block's nibbles (Q4_K's 16 bytes into its block, Q5_K's 48) as int4's
// 4 register words: each 32 bytes of nibbles hold sub-block 2c (low) and 2c + 1 (high).
inline void k_quant_words(const uint8_t* nibbles, int j, uint32_t* words) {
  const uint8_t* qs = nibbles + 32 * (j / 2);
  for (int w = 0; w < 4; ++w) {
    const uint32_t first = word_at(qs + 8 * w), second = word_at(qs + 8 * w + 4);
    words[w] = j % 2 == 0 ? (first & kLowNibbles) | ((second & kLowNibbles) << 4)
                          : ((first >> 4) & kLowNibbles) | (second & ~kLowNibbles);
  }
}

template <int type>
inline void float_block(const uint8_t* row, int64_t b, float* w);

// quant.quantize_int4 of 32 values (Q4_1's rule): the minimum rounded to fp16 first, then the step (max - minimum) /
// 15 to fp16, q = round((w - minimum) / step) in 0..15 (0 where the step is 0), as layouts.pack_int4's 4 register
// words.
inline void quantize_int4_block(const float* w, uint32_t* words, uint16_t& d, uint16_t& m) {
  __m256 low8 = _mm256_loadu_ps(w), high8 = low8;
  for (int i = 8; i < 32; i += 8) {
    low8 = _mm256_min_ps(low8, _mm256_loadu_ps(w + i));
    high8 = _mm256_max_ps(high8, _mm256_loadu_ps(w + i));
  }
  alignas(32) float lows[8], highs[8];
  _mm256_store_ps(lows, low8);
  _mm256_store_ps(highs, high8);
  float low = lows[0], high = highs[0];
  for (int i = 1; i < 8; ++i) {
    low = std::min(low, lows[i]);
    high = std::max(high, highs[i]);
  }
  m = float_to_half(low);
  const float minimum = _cvtsh_ss(m);
  d = float_to_half((high - minimum) / 15.0f);
  const float step = _cvtsh_ss(d);
  alignas(32) int32_t q[32] = {};
  if (step > 0) {
    for (int i = 0; i < 32; i += 8) {
      __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(w + i), _mm256_set1_ps(minimum)), _mm256_set1_ps(step));
      v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + i), _mm256_cvtps_epi32(v));
    }
  }
  for (int j = 0; j < 4; ++j) {
    words[j] = 0;
    for (int i = 0; i < 4; ++i)
      words[j] |= static_cast<uint32_t>(q[8 * j + i] | (q[8 * j + 4 + i] << 4)) << (8 * i);
  }
}

// Block b (32 values) of a row as layouts.pack_int4's 4 register words of that row (word j: columns 8j..8j+3 in the
// low nibbles, 8j+4..8j+7 in the high ones), and the fp16 bits of d and m (w = d * q + m): a 4-bit type's from whole
// 32-bit words of the file's nibbles, a float type's quantized (quantize_int4_block).
template <int type>
inline void int4_block(const uint8_t* row, int64_t b, uint32_t* words, uint16_t& d, uint16_t& m) {
  if constexpr (type == kF32 || type == kF16 || type == kBF16) {
    alignas(32) float w[32];
    float_block<type>(row, b, w);
    quantize_int4_block(w, words, d, m);
  } else if constexpr (type == kQ4_0 || type == kQ4_1) {
    // 16 bytes: values 0..15 in the low nibbles, 16..31 in the high ones.
    const uint8_t* block = row + b * (type == kQ4_0 ? 18 : 20);
    const uint8_t* qs = block + (type == kQ4_0 ? 2 : 4);
    const uint32_t b0 = word_at(qs), b1 = word_at(qs + 4), b2 = word_at(qs + 8), b3 = word_at(qs + 12);
    words[0] = (b0 & kLowNibbles) | ((b1 & kLowNibbles) << 4);
    words[1] = (b2 & kLowNibbles) | ((b3 & kLowNibbles) << 4);
    words[2] = ((b0 >> 4) & kLowNibbles) | (b1 & ~kLowNibbles);
    words[3] = ((b2 >> 4) & kLowNibbles) | (b3 & ~kLowNibbles);
    std::memcpy(&d, block, 2);
    if constexpr (type == kQ4_1) std::memcpy(&m, block + 2, 2);
    else m = float_to_half(-8 * half_to_float(block));  // exact
  } else {  // Q4_K: 144 bytes per 256 values
    const uint8_t* block = row + (b / 8) * 144;
    const int j = static_cast<int>(b % 8);
    int scale, minimum;
    k_scale_min(block + 4, j, scale, minimum);
    k_quant_words(block + 16, j, words);
    d = float_to_half(half_to_float(block) * static_cast<float>(scale));
    m = float_to_half(-(half_to_float(block + 2) * static_cast<float>(minimum)));
  }
}

// Block b (32 values) of a row as float32, as gguf's numpy de-quantizer computes it.
template <int type>
inline void float_block(const uint8_t* row, int64_t b, float* w) {
  switch (type) {  // a constant: each instantiation keeps one case
    case kF32:
      std::memcpy(w, row + b * 128, 128);
      return;
    case kF16:
      for (int i = 0; i < 32; ++i) w[i] = half_to_float(row + b * 64 + 2 * i);
      return;
    case kBF16:
      for (int i = 0; i < 32; ++i) {
        uint16_t h;
        std::memcpy(&h, row + b * 64 + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&w[i], &bits, 4);
      }
      return;
    // Q4_0 and Q5_0 never come here: their levels go into q8 as they are (offset_levels).
    case kQ4_1:
    case kQ4_K: {  // (d * scale) * q - (dmin * min) for Q4_K; d * q + m for Q4_1
      const uint8_t* block = row + b * 20;
      uint8_t q[32];
      if (type == kQ4_K) {
        const uint8_t* super = row + (b / 8) * 144;
        const int j = static_cast<int>(b % 8);
        int scale, minimum;
        k_scale_min(super + 4, j, scale, minimum);
        const float d = half_to_float(super) * static_cast<float>(scale);
        const float dm = half_to_float(super + 2) * static_cast<float>(minimum);
        const uint8_t* qs = super + 16 + 32 * (j / 2);
        for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>((qs[i] >> (4 * (j % 2))) & 0x0F) - dm;
        return;
      }
      const uint8_t* qs = block + 4;
      for (int i = 0; i < 16; ++i) {
        q[i] = qs[i] & 0x0F;
        q[i + 16] = qs[i] >> 4;
      }
      const float d = half_to_float(block);
      const float m = half_to_float(block + 2);
      for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>(q[i]) + m;
      return;
    }
    case kQ5_1: {  // d * q + m. Bit i of the 32-bit qh is value i's fifth bit.
      const uint8_t* block = row + b * 24;
      uint32_t qh;
      std::memcpy(&qh, block + 4, 4);
      const uint8_t* qs = block + 8;
      const float d = half_to_float(block);
      for (int i = 0; i < 32; ++i) {
        const int low = i < 16 ? (qs[i] & 0x0F) : (qs[i - 16] >> 4);
        const int q = low | static_cast<int>(((qh >> i) & 1) << 4);
        w[i] = d * static_cast<float>(q) + half_to_float(block + 2);
      }
      return;
    }
    case kQ5_K: {  // 176 bytes per 256: d, dmin, 12 bytes of scales, 32 of fifth bits (bit j: sub-block j), 128
      const uint8_t* super = row + (b / 8) * 176;
      const int j = static_cast<int>(b % 8);
      int scale, minimum;
      k_scale_min(super + 4, j, scale, minimum);
      const float d = half_to_float(super) * static_cast<float>(scale);
      const float dm = half_to_float(super + 2) * static_cast<float>(minimum);
      const uint8_t* qh = super + 16;
      const uint8_t* qs = super + 48 + 32 * (j / 2);
      for (int i = 0; i < 32; ++i) {
        const int q = ((qs[i] >> (4 * (j % 2))) & 0x0F) | (((qh[i] >> j) & 1) << 4);
        w[i] = d * static_cast<float>(q) - dm;
      }
      return;
    }
    case kQ6_K: {  // 210 bytes per 256: 128 of low nibbles, 64 of high 2 bits, 16 int8 scales, fp16 d
      // Value v of a super-block: low nibble of ql[64 (v / 128) + v % 64] at bit 4 ((v % 128) / 64), high 2 bits
      // of qh[32 (v / 128) + v % 32] at bit 2 ((v % 128) / 32), scale v / 16. A block of 32 starts at a multiple
      // of 32, so within it every shift is one constant and the indexes run on by one.
      const uint8_t* super = row + (b / 8) * 210;
      const int first = static_cast<int>(b % 8) * 32, half = first / 128, within = first % 128;
      const uint8_t* ql = super + 64 * half + within % 64;
      const uint8_t* qh = super + 128 + 32 * half;
      const int low_shift = 4 * (within / 64), high_shift = 2 * (within / 32);
      const int8_t* scales = reinterpret_cast<const int8_t*>(super + 192) + first / 16;
      const float d = half_to_float(super + 208);
      const __m256i nibbles = _mm256_and_si256(
          _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql)), _mm_cvtsi32_si128(low_shift)),
          _mm256_set1_epi8(0x0F));
      const __m256i twos = _mm256_and_si256(
          _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)), _mm_cvtsi32_si128(high_shift)),
          _mm256_set1_epi8(0x03));
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_slli_epi16(twos, 4)), _mm256_set1_epi8(32));
      alignas(32) int8_t values[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(values), q);
      for (int k = 0; k < 4; ++k) {  // values 8k..8k+7, with the scale of their 16
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + 8 * k))));
        _mm256_storeu_ps(w + 8 * k, _mm256_mul_ps(_mm256_set1_ps(d * static_cast<float>(scales[k / 2])), x));
      }
      return;
    }
  }
}

// Block b of a Q4_0 or Q5_0 row as q8 holds it exactly: its fp16 d, and q - 8 (Q4_0) or q - 16 (Q5_0) as int8.
template <int type>
void offset_levels(const uint8_t* row, int64_t b, int8_t* q, uint16_t& d) {
  const uint8_t* block = row + b * (type == kQ4_0 ? 18 : 22);
  std::memcpy(&d, block, 2);
  uint32_t qh = 0;
  if constexpr (type == kQ5_0) std::memcpy(&qh, block + 2, 4);
  const uint8_t* qs = block + (type == kQ4_0 ? 2 : 6);
  for (int i = 0; i < 32; ++i) {
    const int low = i < 16 ? (qs[i] & 0x0F) : (qs[i - 16] >> 4);
    q[i] = static_cast<int8_t>(type == kQ4_0 ? low - 8 : (low | static_cast<int>(((qh >> i) & 1) << 4)) - 16);
  }
}

// quant.quantize_q8 of 32 values: the step absmax / 127 rounded to fp16 first, q = round(w / step) in -127..127.
void quantize_block(const float* w, int8_t* q, uint16_t& d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(w + i)));
  __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
  amax4 = _mm_max_ss(amax4, _mm_shuffle_ps(amax4, amax4, 1));
  d = float_to_half(_mm_cvtss_f32(amax4) / 127);
  const float step = _cvtsh_ss(d);
  const __m256 safe = _mm256_set1_ps(step > 0 ? step : 1.0f);
  alignas(32) int32_t rounded[32];
  for (int i = 0; i < 32; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(w + i), safe), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + i), _mm256_cvtps_epi32(v));
  }
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(rounded[i]);
}

int64_t row_bytes(int type, int64_t cols) {
  switch (type) {
    case kF32: return cols * 4;
    case kF16: case kBF16: return cols * 2;
    case kQ4_0: return cols / 32 * 18;
    case kQ4_1: return cols / 32 * 20;
    case kQ5_0: return cols / 32 * 22;
    case kQ5_1: return cols / 32 * 24;
    case kQ8_0: return cols / 32 * 34;
    case kQ4_K: return cols / 256 * 144;
    case kQ5_K: return cols / 256 * 176;
    case kQ6_K: return cols / 256 * 210;
  }
  return -1;
}

}  // namespace

int64_t gguf_row_bytes(int type, int64_t cols) { return row_bytes(type, cols); }

bool gguf_has_int4(int type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ4_K || type == kF32 || type == kF16 || type == kBF16;
}

bool gguf_has_q4(int type) { return type == kQ4_0; }

bool gguf_has_q4k(int type) { return type == kQ4_K; }

bool gguf_has_q5k(int type) { return type == kQ5_K; }

bool gguf_has_q6k(int type) { return type == kQ6_K; }

namespace {

// Row r's 4 words of a block into registers j = 0..3 of its group (layouts.pack_int4; kQ4: layouts.pack_q4, the
// same without the minimums).
template <int type, bool kQ4 = false>
void int4_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  constexpr int64_t kBytes = kQ4 ? kQ4GroupBytes : kInt4GroupBytes;
  const int64_t stride = row_bytes(type, p.cols), blocks = p.cols / kInt4GroupCols;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* out = p.out + (g * blocks + b) * kBytes;
      for (int r = 0; r < kInt4GroupRows; ++r) {
        uint32_t words[4];
        uint16_t d, m;
        int4_block<type>(p.raw + (g * kInt4GroupRows + r) * stride, b, words, d, m);
        for (int j = 0; j < 4; ++j) std::memcpy(out + 32 * j + 4 * r, &words[j], 4);
        std::memcpy(out + 128 + 2 * r, &d, 2);
        if constexpr (!kQ4) std::memcpy(out + 144 + 2 * r, &m, 2);
      }
    }
  }
}

// Q4_K super-blocks as they are (layouts.pack_q4k): per group of 8 rows and super-block, the rows' d and dmin, the
// top 2 bits of their scales and minimums, the low 4 bits of each, then each sub-block's nibbles in int4's order.
void q4k_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  const int64_t stride = row_bytes(kQ4_K, p.cols), supers = p.cols / kQ4KSuperCols;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t s = 0; s < supers; ++s) {
      uint8_t* out = p.out + (g * supers + s) * kQ4KSuperBytes;
      for (int r = 0; r < kInt4GroupRows; ++r) {
        const uint8_t* row = p.raw + (g * kInt4GroupRows + r) * stride;
        const uint8_t* super = row + s * 144;
        std::memcpy(out + 2 * r, super, 2);
        std::memcpy(out + 16 + 2 * r, super + 2, 2);
        uint32_t top = 0;
        for (int j = 0; j < 8; ++j) {
          int scale, minimum;
          k_scale_min(super + 4, j, scale, minimum);
          top |= static_cast<uint32_t>(scale >> 4) << (2 * j) | static_cast<uint32_t>(minimum >> 4) << (16 + 2 * j);
          out[64 + 8 * j + r] = static_cast<uint8_t>((scale & 0x0F) | ((minimum & 0x0F) << 4));
          uint32_t words[4];
          k_quant_words(super + 16, j, words);  // the nibbles only: q4k keeps the scales as they are
          for (int w = 0; w < 4; ++w) std::memcpy(out + 128 + 128 * j + 32 * w + 4 * r, &words[w], 4);
        }
        std::memcpy(out + 32 + 4 * r, &top, 4);
      }
    }
  }
}

// The 8 x 8 bit matrix in a word transposed: bit j of byte i goes to bit i of byte j (Hacker's Delight, 7-3).
inline uint64_t transpose_bits(uint64_t x) {
  uint64_t t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
  x ^= t ^ (t << 14);
  t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
  return x ^ t ^ (t << 28);
}

// Q5_K super-blocks as they are (layouts.pack_q5k): q4k's bytes of the same scales, minimums and nibbles (Q5_K's
// nibbles lie 48 bytes into its 176, Q4_K's 16 into its 144), each sub-block's nibbles followed by its 32 bytes of
// fifth bits: byte 4r + t, bit k the fifth bit of nibble register k's low nibble there (column 8k + t), bit 4 + k
// that of its high nibble (column 8k + 4 + t). The file keeps value l of sub-block j's fifth bit at qh[l]'s bit j.
void q5k_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  const int64_t stride = row_bytes(kQ5_K, p.cols), supers = p.cols / kQ4KSuperCols;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t s = 0; s < supers; ++s) {
      uint8_t* out = p.out + (g * supers + s) * kQ5KSuperBytes;
      for (int r = 0; r < kInt4GroupRows; ++r) {
        const uint8_t* super = p.raw + (g * kInt4GroupRows + r) * stride + s * 176;
        const uint8_t* qh = super + 16;
        std::memcpy(out + 2 * r, super, 2);
        std::memcpy(out + 16 + 2 * r, super + 2, 2);
        uint32_t top = 0;
        for (int j = 0; j < 8; ++j) {
          int scale, minimum;
          k_scale_min(super + 4, j, scale, minimum);
          top |= static_cast<uint32_t>(scale >> 4) << (2 * j) | static_cast<uint32_t>(minimum >> 4) << (16 + 2 * j);
          out[64 + 8 * j + r] = static_cast<uint8_t>((scale & 0x0F) | ((minimum & 0x0F) << 4));
          uint8_t* block = out + kQ5KHeaderBytes + kQ5KBlockBytes * j;
          uint32_t words[4];
          k_quant_words(super + 48, j, words);
          for (int w = 0; w < 4; ++w) std::memcpy(block + 32 * w + 4 * r, &words[w], 4);
        }
        std::memcpy(out + 32 + 4 * r, &top, 4);
        // Byte 4r + t of every sub-block's fifth bits at once: byte 4h + k of `columns` is qh[8k + 4h + t] (bit j:
        // sub-block j), so its transpose holds in byte j, bit 4h + k, what sub-block j's byte wants there.
        for (int t = 0; t < 4; ++t) {
          uint64_t columns = 0;
          for (int k = 0; k < 4; ++k)
            columns |= static_cast<uint64_t>(qh[8 * k + t]) << (8 * k) | static_cast<uint64_t>(qh[8 * k + 4 + t]) << (8 * (4 + k));
          const uint64_t by_sub_block = transpose_bits(columns);
          for (int j = 0; j < 8; ++j)
            out[kQ5KHeaderBytes + kQ5KBlockBytes * j + 128 + 4 * r + t] = static_cast<uint8_t>(by_sub_block >> (8 * j));
        }
      }
    }
  }
}

// The 32 six-bit values (0..63, q before its - 32) of block b (32 values) of a Q6_K super-block: the indexes of
// float_block's Q6_K case.
inline void q6_k_values(const uint8_t* super, int b, uint8_t* values) {
  const int first = b * 32, half = first / 128, within = first % 128;
  const uint8_t* ql = super + 64 * half + within % 64;
  const uint8_t* qh = super + 128 + 32 * half;
  const int low_shift = 4 * (within / 64), high_shift = 2 * (within / 32);
  const __m256i nibbles = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql)), _mm_cvtsi32_si128(low_shift)),
      _mm256_set1_epi8(0x0F));
  const __m256i twos = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)), _mm_cvtsi32_si128(high_shift)),
      _mm256_set1_epi8(0x03));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(values), _mm256_or_si256(nibbles, _mm256_slli_epi16(twos, 4)));
}

// Q6_K super-blocks as they are (layouts.pack_q6k): per group of 8 rows and super-block, the rows' d, their 16 int8
// scales (byte 8j + row), then per block of 32 columns the low nibbles in int4's order and the top 2 bits of each
// nibble register's bytes, 4 to a byte.
void q6k_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  const int64_t stride = row_bytes(kQ6_K, p.cols), supers = p.cols / kQ6KSuperCols;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t s = 0; s < supers; ++s) {
      uint8_t* out = p.out + (g * supers + s) * kQ6KSuperBytes;
      for (int r = 0; r < kInt4GroupRows; ++r) {
        const uint8_t* super = p.raw + (g * kInt4GroupRows + r) * stride + s * 210;
        std::memcpy(out + 2 * r, super + 208, 2);
        for (int j = 0; j < 16; ++j) out[16 + 8 * j + r] = super[192 + j];
        for (int b = 0; b < 8; ++b) {
          alignas(32) uint8_t v[32];
          q6_k_values(super, b, v);
          uint8_t* block = out + kQ6KHeaderBytes + b * kQ6KBlockBytes;
          // Nibble register i takes values 8i..8i+7: byte t of its word holds value 8i + t's low nibble and value
          // 8i + 4 + t's as its high one. Read as one 64-bit word (bytes 0-3 the low half, 4-7 the high one), all
          // four bytes of a register's word, and of its top-2-bit word, come from a few shifts and masks.
          uint32_t top[2] = {0, 0};
          for (int i = 0; i < 4; ++i) {
            uint64_t u;
            std::memcpy(&u, v + 8 * i, 8);
            const uint32_t low = static_cast<uint32_t>(u), high = static_cast<uint32_t>(u >> 32);
            const uint32_t nibbles = (low & kLowNibbles) | ((high & kLowNibbles) << 4);
            std::memcpy(block + 32 * i + 4 * r, &nibbles, 4);
            // the top 2 bits of register 2p's low and high nibbles at bits 0 and 2 of each byte, 2p + 1's at 4, 6
            top[i / 2] |= (((low >> 4) & 0x03030303u) | (((high >> 4) & 0x03030303u) << 2)) << (4 * (i % 2));
          }
          std::memcpy(block + 128 + 4 * r, &top[0], 4);
          std::memcpy(block + 160 + 4 * r, &top[1], 4);
        }
      }
    }
  }
}

// Row r's 32 values of a block into registers j = 0..7, 4 bytes each, as q + 128 (flipping the top bit).
template <int type>
void q8_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  const int64_t stride = row_bytes(type, p.cols), blocks = p.cols / kQ8GroupCols;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* out = p.out + (g * blocks + b) * kQ8GroupBytes;
      for (int r = 0; r < kQ8GroupRows; ++r) {
        const uint8_t* row = p.raw + (g * kQ8GroupRows + r) * stride;
        int8_t q[32];
        uint16_t d;
        if constexpr (type == kQ8_0) {  // as it is
          std::memcpy(&d, row + b * 34, 2);
          std::memcpy(q, row + b * 34 + 2, 32);
        } else if constexpr (type == kQ4_0 || type == kQ5_0) {  // d * (q - 8), d * (q - 16): int8 levels under d
          offset_levels<type>(row, b, q, d);
        } else {
          alignas(32) float w[32];
          float_block<type>(row, b, w);
          quantize_block(w, q, d);
        }
        for (int j = 0; j < 8; ++j) {
          uint32_t word;
          std::memcpy(&word, q + 4 * j, 4);
          word ^= 0x80808080u;
          std::memcpy(out + 32 * j + 4 * r, &word, 4);
        }
        std::memcpy(out + 256 + 2 * r, &d, 2);
      }
    }
  }
}

}  // namespace

void gguf_int4_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  switch (p.type) {
    case kF32: return int4_groups<kF32>(p, g0, g1);
    case kF16: return int4_groups<kF16>(p, g0, g1);
    case kBF16: return int4_groups<kBF16>(p, g0, g1);
    case kQ4_0: return int4_groups<kQ4_0>(p, g0, g1);
    case kQ4_1: return int4_groups<kQ4_1>(p, g0, g1);
    case kQ4_K: return int4_groups<kQ4_K>(p, g0, g1);
  }
}

void gguf_q4_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  if (p.type == kQ4_0) int4_groups<kQ4_0, true>(p, g0, g1);
}

void gguf_q4k_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  if (p.type == kQ4_K) q4k_groups(p, g0, g1);
}

void gguf_q5k_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  if (p.type == kQ5_K) q5k_groups(p, g0, g1);
}

void gguf_q6k_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  if (p.type == kQ6_K) q6k_groups(p, g0, g1);
}

void gguf_q8_groups(const GgufRepack& p, int64_t g0, int64_t g1) {
  switch (p.type) {
    case kF32: return q8_groups<kF32>(p, g0, g1);
    case kF16: return q8_groups<kF16>(p, g0, g1);
    case kBF16: return q8_groups<kBF16>(p, g0, g1);
    case kQ4_0: return q8_groups<kQ4_0>(p, g0, g1);
    case kQ4_1: return q8_groups<kQ4_1>(p, g0, g1);
    case kQ4_K: return q8_groups<kQ4_K>(p, g0, g1);
    case kQ5_0: return q8_groups<kQ5_0>(p, g0, g1);
    case kQ5_1: return q8_groups<kQ5_1>(p, g0, g1);
    case kQ5_K: return q8_groups<kQ5_K>(p, g0, g1);
    case kQ6_K: return q8_groups<kQ6_K>(p, g0, g1);
    case kQ8_0: return q8_groups<kQ8_0>(p, g0, g1);
  }
}

}  // namespace tern
