// Tern's CPU kernels as plain functions on raw pointers, one file per kernel and instruction set.
//
// Each <kernel>_<isa>.cpp is compiled with its own instruction-set flags and includes no torch header, so it
// builds in about a second; ops.cpp (generic x86-64 or any CPU) checks tensors, splits the work across threads
// with at::parallel_for and registers the torch.ops.tern.* operators that call these. A function here computes
// a range of its problem (groups of weight rows, or attention tasks) so that threading stays in one place.
#pragma once

#include <cstdint>
#include <cstring>

namespace tern {

// A float's bf16 bits, rounded to nearest, ties to even, as torch's conversion rounds (finite values).
inline uint16_t round_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Activations quantized to int8, one scale per block of `block` values (llama.cpp's Q8_K / Q8_1 idea):
// values [M, K], and per (row, block) its scale (absmax / 127) and the sum of its int8 values.
struct QuantizedRows {
  int64_t K, block, blocks;
  int8_t* values;
  float* scales;
  int32_t* sums;
  float* sum_scales;  // scales[i] * sums[i] (the int4 minimum's factor): computed once, not once per weight group
  int16_t* sums32 = nullptr;  // where given (q4k's blocks of 256): the sum of each 32 values' int8s, per (row, 32)
  int16_t* sums16 = nullptr;  // where given (q6k's blocks of 256): the sum of each 16 values' int8s, per (row, 16)
  // Where given (blocks of 32): per (row, block) -8 * sums[i] as an int16 in the low half of the word, the high half
  // 0: q4's centring, where the AVX2 pair loop starts its int16 sums (int4_avx2.cpp).
  int32_t* q4_offsets = nullptr;
};

// Rows [m0, m1) of x [M, K] (float32, or bfloat16 bits when bf16) into q: q = round_half_even(x * 127 / absmax).
// Exact operations only (absmax, one division, one product, one rounding): every instruction set gets the same
// bits, and so does the PyTorch reference in the tests.
void quantize_rows_avx2(const void* x, bool bf16, int64_t m0, int64_t m1, const QuantizedRows& q);

// 4-bit weights with a scale d and a minimum m per 32 values of a row (w = d * q + m, q in 0..15: GGUF's Q4_1),
// packed per group of 8 rows and 32 columns as 128 bytes of nibbles, then 8 fp16 d, then 8 fp16 m
// (engine/kernels/layouts.py). Activations come in blocks of 32 (Q8_1): per group
// acc += dot * (d * x_scale), then acc += m * (x_scale * sum(xq)).
struct Int4Problem {
  const QuantizedRows* x;
  int64_t M, N;  // N: the output's row stride, the weight's rows unless it writes some columns of a wider output
  const uint8_t* w;
  void* out;  // [M, N] float32 or bfloat16
  bool out_bf16;
};
constexpr int64_t kInt4GroupRows = 8, kInt4GroupCols = 32, kInt4GroupBytes = 160;
void int4_groups_avx2(const Int4Problem& p, int64_t g0, int64_t g1);
void int4_groups_avx512(const Int4Problem& p, int64_t g0, int64_t g1);

// 4-bit weights with a scale d per 32 values of a row and no minimum (w = d * (q - 8), q in 0..15: GGUF's Q4_0),
// packed as int4 is without its minimums: 128 bytes of nibbles, then 8 fp16 d, 144 bytes a group (a Q4_0 file's
// own 18 bytes per 32 values). The arithmetic is q8's on q - 8: dot = sum(q * xq) - 8 * sum(xq), an exact
// integer, then acc += dot * (d * x_scale) (llama.cpp's Q4_0 x Q8_0): one float step per group where int4 takes two.
using Q4Problem = Int4Problem;
constexpr int64_t kQ4GroupBytes = 144;
void q4_groups_avx2(const Q4Problem& p, int64_t g0, int64_t g1);
void q4_groups_avx512(const Q4Problem& p, int64_t g0, int64_t g1);
// Pairs of groups [g0, g1) (an even count) for activation rows m0.. only: what the AMX kernel leaves to AVX512.
void q4_pairs_avx512(const Q4Problem& p, int64_t m0, int64_t g0, int64_t g1);
// The same on AMX-INT8 (int4_amx.cpp): tiles of 16 activation rows, the rows past the last full tile as
// q4_groups_avx512 does them, the same bits. Only once Linux has granted the process the tile state.
void q4_groups_amx(const Q4Problem& p, int64_t g0, int64_t g1);

// 4-bit weights in GGUF's Q4_K form: per super-block of 256 values of a row an fp16 d and dmin, and per sub-block j
// of 32 a 6-bit scale s_j and minimum m_j (w = (d * s_j) * q - dmin * m_j), held in the file's own 144 bytes per
// 256 values. Per group of 8 rows and super-block, 1152 bytes: the 8 rows' fp16 d, their fp16 dmin, a uint32 per
// row holding the top 2 bits of s_j (bits 2j, 2j + 1) and of m_j (bits 16 + 2j, 17 + 2j), 64 bytes of
// (s_j & 15) | (m_j & 15) << 4 (byte 8j + row), then the 8 sub-blocks' 128 bytes of nibbles in int4's order
// (engine/kernels/layouts.py: pack_q4k): the file's values, where int4 rounds d * s_j and dmin * m_j to fp16.
// The arithmetic is llama.cpp's Q4_K x Q8_K: activations come in blocks of 256 (one scale x_scale) with the sum of
// each 32 of their int8s (sums32); per super-block each row sums in integers isum = sum_j s_j * dot_j and
// msum = sum_j m_j * sums32_j (exact: at most 31M and 2M), then acc += isum * (d * x_scale), then
// acc += msum * (-dmin * x_scale): two float steps per 256 values where int4 takes two per 32, and no scale is
// decoded into a float.
using Q4KProblem = Int4Problem;
constexpr int64_t kQ4KSuperCols = 256, kQ4KSuperBytes = 1152;
void q4k_groups_avx2(const Q4KProblem& p, int64_t g0, int64_t g1);
void q4k_groups_avx512(const Q4KProblem& p, int64_t g0, int64_t g1);
// Pairs of groups [g0, g1) (an even count) for activation rows m0.. only: what the AMX kernel leaves to AVX512.
void q4k_pairs_avx512(const Q4KProblem& p, int64_t m0, int64_t g0, int64_t g1);
// The same on AMX-INT8 (int4_amx.cpp): tiles of 16 activation rows, the rows past the last full tile as
// q4k_groups_avx512 does them, the same bits. Only once Linux has granted the process the tile state
// (engine/kernels/dispatch.py).
void q4k_groups_amx(const Q4KProblem& p, int64_t g0, int64_t g1);

// 5-bit weights in GGUF's Q5_K form: Q4_K's super-block with a fifth bit per value (w = (d * s_j) * q - dmin * m_j,
// q in 0..31), held in the file's own 176 bytes per 256 values. Per group of 8 rows and super-block, 1408 bytes:
// q4k's 128 header bytes (the rows' d and dmin, the scales' and minimums' top and low bits), then per sub-block j
// of 32 columns 160 bytes: its 128 bytes of nibbles in int4's order, then 32 bytes of fifth bits: byte 4r + t holds
// at bit k the fifth bit of nibble register k's byte 4r + t low nibble, at bit 4 + k that of its high nibble
// (engine/kernels/layouts.py: pack_q5k), so one shift and an and/or (one vpternlogd) join a register's fifth bits to
// its nibbles. The arithmetic is q4k's (llama.cpp's Q5_K x Q8_K) on values 0..31: the same activations (blocks of
// 256, sums32), isum = sum_j s_j * dot_j (exact: at most 64M) and msum, and the same two float steps.
using Q5KProblem = Int4Problem;
constexpr int64_t kQ5KSuperBytes = 1408, kQ5KHeaderBytes = 128, kQ5KBlockBytes = 160;
constexpr int64_t kQ5KGroupBytes = 176;  // per 8 rows and 32 columns on average: a row of K values is K * 11 / 16 bytes
void q5k_groups_avx2(const Q5KProblem& p, int64_t g0, int64_t g1);
void q5k_groups_avx512(const Q5KProblem& p, int64_t g0, int64_t g1);

// 6-bit weights in GGUF's Q6_K form: per super-block of 256 values of a row an fp16 d, and per sub-block j of 16 an
// int8 scale s_j (w = d * s_j * (q - 32), q in 0..63), held in the file's own 210 bytes per 256 values. Per group
// of 8 rows and super-block, 1680 bytes: the 8 rows' fp16 d, then 128 bytes of scales (byte 8j + row: sub-block j's
// s_j of that row), then per block of 32 columns 192 bytes: the low 4 bits of q as int4 lays out its nibbles
// (128 bytes), then the top 2 bits in two 32-byte registers: register a's byte 4r + t holds, at bits 2k and
// 2k + 1, the top bits of the value whose low bits are nibble register 2a + k / 2's byte 4r + t, low nibble for
// even k, high for odd (engine/kernels/layouts.py: pack_q6k). The arithmetic is llama.cpp's Q6_K x Q8_K:
// activations come in blocks of 256 (one scale x_scale) with the sum of each 16 of their int8s (sums16); per
// super-block each row sums in integers isum = sum_j s_j * (dot_j - 32 * sums16_j) (exact: at most 134M), then
// acc += isum * (d * x_scale): one float step per 256 values.
using Q6KProblem = Int4Problem;
constexpr int64_t kQ6KSuperCols = 256, kQ6KSuperBytes = 1680, kQ6KHeaderBytes = 144, kQ6KBlockBytes = 192;
constexpr int64_t kQ6KGroupBytes = 210;  // per 8 rows and 32 columns on average: a row of K values is K * 105 / 128 bytes
void q6k_groups_avx2(const Q6KProblem& p, int64_t g0, int64_t g1);
void q6k_groups_avx512(const Q6KProblem& p, int64_t g0, int64_t g1);
// Pairs of groups [g0, g1) (an even count) for activation rows m0.. only: what the AMX kernel leaves to AVX512.
void q6k_pairs_avx512(const Q6KProblem& p, int64_t m0, int64_t g0, int64_t g1);
// The same on AMX-INT8 (q6k_amx.cpp): tiles of 16 activation rows, the rows past the last full tile as
// q6k_groups_avx512 does them, the same bits. Only once Linux has granted the process the tile state.
void q6k_groups_amx(const Q6KProblem& p, int64_t g0, int64_t g1);

// int8 weights with one fp16 scale d per 32 values of a row (w = d * q: GGUF's Q8_0), packed per group of 8 rows
// and 32 columns as 256 bytes of q + 128, then 8 fp16 d (engine/kernels/layouts.py). Activations come in blocks
// of 32 with their sums: per group dot = sum((q + 128) * xq) - 128 * sum(xq), an exact integer, then
// acc += dot * (d * x_scale). The problem is the int4 kernel's: activations, the packed weight, the output.
using Q8Problem = Int4Problem;
constexpr int64_t kQ8GroupRows = 8, kQ8GroupCols = 32, kQ8GroupBytes = 272;
void q8_groups_avx2(const Q8Problem& p, int64_t g0, int64_t g1);
void q8_groups_avx512(const Q8Problem& p, int64_t g0, int64_t g1);
// Rows [m0, M) against pairs of groups [g0, g1) (an even count): q8_groups_avx512's loop, for the rows past AMX's tiles.
void q8_pairs_avx512(const Q8Problem& p, int64_t m0, int64_t g0, int64_t g1);
// The same on AMX-INT8 (q8_amx.cpp): tiles of 16 activation rows, the rows past the last full tile as
// q8_groups_avx512 does them, the same bits. Only once Linux has granted the process the tile state.
void q8_groups_amx(const Q8Problem& p, int64_t g0, int64_t g1);

// bf16 x bf16 -> bf16, weights packed [N/4][K/32][4][32] (engine/kernels/layouts.py), over groups of 4 weight rows
// [g0, g1): by vdpbf16ps on AVX512-BF16 (bf16_avx512.cpp), elsewhere by its arithmetic in fp32 FMAs (bf16_fma.h).
struct Bf16Problem {
  const uint16_t* x;
  int64_t M, K, N;
  const uint16_t* w;
  uint16_t* out;
};
using Bf16Groups = void (*)(const Bf16Problem& p, int64_t g0, int64_t g1);
void bf16_groups_avx512(const Bf16Problem& p, int64_t g0, int64_t g1);
void bf16_fma_groups_avx2(const Bf16Problem& p, int64_t g0, int64_t g1);
void bf16_fma_groups_avx512(const Bf16Problem& p, int64_t g0, int64_t g1);

// Decode attention read in place from a paged KV cache: tasks are (sequence, KV head) pairs, b * Hkv + h.
struct AttentionProblem {
  const void* q;  // [B, H, D]
  const void* k_cache;  // [slots, Hkv, D]
  const void* v_cache;
  bool bf16;  // q and the output bf16 (else float32); the caches too
  bool kv_bf16;  // the caches bf16 (true when bf16 is; float32 queries may read a bf16 cache)
  const int64_t* slots;  // [B, L]
  const int64_t* lengths;  // [B]
  int64_t B, H, D, Hkv, L;
  float scale;
  void* out;  // [B, H * D]
  // Rows [tiles[t], tiles[t + 1]) attend as tile t (decode_attention sets them: attention_tiles in matmul.h).
  const int64_t* tiles = nullptr;
  int64_t num_tiles = 0;
};
void decode_attention_avx2(const AttentionProblem& p, int64_t task0, int64_t task1);
// act[i] = SiLU(gate) * up for i in [i0, i1) of rows x inter, each row of gate_up its inter gates then its inter ups
// (silu.h).
void silu_mul_avx2(const float* gate_up, float* act, int64_t inter, int64_t i0, int64_t i1);
using SiluMul = void (*)(const float* gate_up, float* act, int64_t inter, int64_t i0, int64_t i1);

// A GGUF matrix's raw blocks ([rows, gguf_row_bytes(type, cols)], ggml type ids) into Tern's int4 layout (Q4_0,
// Q4_1, Q4_K; F16, BF16, F32 quantized per 32 values as quant.quantize_int4 does: gguf_has_int4), q4 layout (Q4_0 as it is), q4k layout (Q4_K as it is), q5k layout (Q5_K as it is), q6k layout (Q6_K as it is) or q8 layout (Q8_0 as it is; Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
// Q5_K, Q6_K, F16, BF16, F32 re-quantized per 32 values as quant.quantize_q8 does), groups of 8 rows [g0, g1)
// (gguf_repack_avx2.cpp).
struct GgufRepack {
  const uint8_t* raw;
  int type;
  int64_t cols;
  uint8_t* out;
};
enum class GgufLayout : int64_t { kQ8 = 0, kInt4 = 1, kQ4 = 2, kQ4K = 3, kQ6K = 4, kQ5K = 5 };  // the `layout` argument of torch.ops.tern.gguf_repack
int64_t gguf_row_bytes(int type, int64_t cols);  // -1: a type this file does not read
bool gguf_has_int4(int type);
bool gguf_has_q4(int type);  // Q4_0
bool gguf_has_q4k(int type);  // Q4_K
bool gguf_has_q5k(int type);  // Q5_K
bool gguf_has_q6k(int type);  // Q6_K
void gguf_int4_groups(const GgufRepack& p, int64_t g0, int64_t g1);
void gguf_q4_groups(const GgufRepack& p, int64_t g0, int64_t g1);
void gguf_q4k_groups(const GgufRepack& p, int64_t g0, int64_t g1);
void gguf_q5k_groups(const GgufRepack& p, int64_t g0, int64_t g1);
void gguf_q6k_groups(const GgufRepack& p, int64_t g0, int64_t g1);
void gguf_q8_groups(const GgufRepack& p, int64_t g0, int64_t g1);
void decode_attention_avx512(const AttentionProblem& p, int64_t task0, int64_t task1);
void silu_mul_avx512(const float* gate_up, float* act, int64_t inter, int64_t i0, int64_t i1);

}  // namespace tern
