// torch.ops.tern.*: tensor checks, buffers and threading around the plain kernels of kernels.h, and the native
// decode step (decode_step.h) as torch.classes.tern.DecodeStep.
//
// The one file that includes torch's headers (~15 s to compile; the kernels take ~1 s each). Compiled for AVX2,
// which every kernel path needs; it calls only the <kernel>_<isa>.cpp functions the build compiled for this CPU
// (TERN_WITH_AVX512, TERN_WITH_AVX512_BF16). Which of the registered operators runs is engine/kernels' decision,
// made once per process.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "decode_step.h"
#include "kernels.h"
#include "matmul.h"

namespace tern {
namespace {

void check_activations(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, ": x must be bfloat16 or float32");
}

// w_packed: uint8 [N, K * GroupBytes / 256]: int4, 160 bytes per group of 8 rows and 32 columns ([N, K * 5 / 8]),
// q4 or q4k, 144 bytes ([N, K * 9 / 16]; q4k: K a multiple of 256, its super-blocks), q6k, 210 bytes on average
// ([N, K * 105 / 128], K a multiple of 256), q5k, 176 bytes ([N, K * 11 / 16], K a multiple of 256) (kernels.h).
template <Int4Groups Groups, int64_t GroupBytes, const ActivationBlocks& Activations = kPer32Activations>
at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& w_packed) {
  const at::Tensor x = x_in.contiguous();
  check_activations(x, "int4_mm");
  TORCH_CHECK(w_packed.dim() == 2 && w_packed.scalar_type() == at::kByte && w_packed.is_contiguous(),
              "int4_mm: w_packed must be packed uint8 [N, K * ", GroupBytes, " / 256]");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0), Cols = Activations.block;
  TORCH_CHECK(K % Cols == 0 && N % kInt4GroupRows == 0 &&
                  w_packed.size(1) * kInt4GroupRows * kInt4GroupCols == K * GroupBytes,
              "int4_mm: K must be a multiple of ", Cols, ", N of 8, and w_packed [N, K * ", GroupBytes, " / 256]");
  at::Tensor out = at::empty({M, N}, x.options());
  QuantizedScratch scratch;
  block_matmul(Groups, Activations, scratch, x.data_ptr(), x.scalar_type() == at::kBFloat16, M, K,
               w_packed.data_ptr<uint8_t>(), N, out.data_ptr());
  return out;
}

// w_packed: uint8 [N, K * 17 / 16], 272 bytes per group of 8 rows and 32 columns (kernels.h).
template <Int4Groups Groups>
at::Tensor q8_mm(const at::Tensor& x_in, const at::Tensor& w_packed) {
  const at::Tensor x = x_in.contiguous();
  check_activations(x, "q8_mm");
  TORCH_CHECK(w_packed.dim() == 2 && w_packed.scalar_type() == at::kByte && w_packed.is_contiguous(),
              "q8_mm: w_packed must be packed uint8 [N, K * 17 / 16]");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0);
  TORCH_CHECK(K % kQ8GroupCols == 0 && N % kQ8GroupRows == 0 && w_packed.size(1) * 16 == K * 17,
              "q8_mm: K must be a multiple of 32, N of 8, and w_packed [N, K * 17 / 16]");
  at::Tensor out = at::empty({M, N}, x.options());
  QuantizedScratch scratch;
  block_matmul(Groups, kPer32Activations, scratch, x.data_ptr(), x.scalar_type() == at::kBFloat16, M, K,
               w_packed.data_ptr<uint8_t>(), N, out.data_ptr());
  return out;
}

template <Bf16Groups Groups>
at::Tensor bf16_mm(const at::Tensor& x_in, const at::Tensor& w_packed) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && w_packed.dim() == 2 && x.size(1) == w_packed.size(1),
              "bf16_mm: x must be [M, K] and w_packed [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous(),
              "bf16_mm: x and w_packed must be bfloat16, w_packed contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0);
  TORCH_CHECK(K % 32 == 0 && N % 4 == 0, "bf16_mm: K must be a multiple of 32 and N of 4");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const Bf16Problem p{static_cast<const uint16_t*>(x.data_ptr()), M, K, N,
                      static_cast<const uint16_t*>(w_packed.data_ptr()), static_cast<uint16_t*>(out.data_ptr())};
  at::parallel_for(0, N / 4, 16, [&](int64_t g0, int64_t g1) { Groups(p, g0, g1); });
  return out;
}

template <AttentionTasks Attend>
at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& context_slots, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: q [B, H, D], caches [slots, Hkv, D]");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(2) % 16 == 0, "head_dim must match and be a multiple of 16");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the caches must share a dtype");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  (k_cache.scalar_type() == q.scalar_type() || k_cache.scalar_type() == at::kBFloat16),
              "decode_attention takes bf16 or fp32 queries over caches of their dtype or bf16");
  TORCH_CHECK(context_slots.dim() == 2 && context_slots.size(0) == q.size(0) &&
                  context_slots.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  context_lens.numel() == q.size(0),
              "context_slots [B, L] and context_lens [B] must be int64");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  const at::Tensor slots = context_slots.contiguous(), lengths = context_lens.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  const AttentionProblem p{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.scalar_type() == at::kBFloat16,
                           k_cache.scalar_type() == at::kBFloat16, slots.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), q.size(0), q.size(1), q.size(2),
                           k_cache.size(1), slots.size(1), static_cast<float>(scale), out.data_ptr()};
  decode_attention(Attend, p);
  return out;
}

// gate_up [M, 2 * inter] (each row its inter gates, then its inter ups) -> SiLU(gate) * up [M, inter]: the decode
// step's activation (silu.h), as an operator for its tests.
template <SiluMul Silu>
at::Tensor silu_mul_op(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kFloat,
              "silu_mul: gate_up must be float32 [M, 2 * inter]");
  const at::Tensor x = gate_up.contiguous();
  const int64_t inter = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), inter}, x.options());
  const float* in = x.data_ptr<float>();
  float* act = out.data_ptr<float>();
  at::parallel_for(0, x.size(0) * inter, kElementwiseGrain,
                   [&](int64_t i0, int64_t i1) { Silu(in, act, inter, i0, i1); });
  return out;
}

// raw: uint8 [rows, bytes per row], a GGUF matrix's blocks of ggml type `type` -> the bytes of `layout`
// (GgufLayout: 0 q8, 1 int4, 2 q4, 3 q4k, 4 q6k, 5 q5k). out: where to write (e.g. a fused projection's rows of this part), else a new
// tensor.
at::Tensor gguf_repack(const at::Tensor& raw, int64_t type, int64_t cols, int64_t layout_in,
                       const std::optional<at::Tensor>& out_in) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(),
              "gguf_repack: raw must be contiguous uint8 [rows, bytes per row] on the CPU");
  TORCH_CHECK(layout_in >= 0 && layout_in <= 5,
              "gguf_repack: layout is 0 (q8), 1 (int4), 2 (q4), 3 (q4k), 4 (q6k) or 5 (q5k)");
  const GgufLayout layout = static_cast<GgufLayout>(layout_in);
  const char* name = layout == GgufLayout::kQ8 ? "q8" : layout == GgufLayout::kInt4 ? "int4" :
                     layout == GgufLayout::kQ4 ? "q4" : layout == GgufLayout::kQ4K ? "q4k" :
                     layout == GgufLayout::kQ5K ? "q5k" : "q6k";
  const int64_t rows = raw.size(0);
  const int64_t bytes = gguf_row_bytes(static_cast<int>(type), cols);
  const bool fits = layout == GgufLayout::kQ8 || (layout == GgufLayout::kInt4 && gguf_has_int4(static_cast<int>(type))) ||
                    (layout == GgufLayout::kQ4 && gguf_has_q4(static_cast<int>(type))) ||
                    (layout == GgufLayout::kQ4K && gguf_has_q4k(static_cast<int>(type))) ||
                    (layout == GgufLayout::kQ5K && gguf_has_q5k(static_cast<int>(type))) ||
                    (layout == GgufLayout::kQ6K && gguf_has_q6k(static_cast<int>(type)));
  TORCH_CHECK(bytes > 0 && fits, "gguf_repack: ggml type ", type, " cannot be repacked into ", name);
  TORCH_CHECK(rows % kInt4GroupRows == 0 && cols % kInt4GroupCols == 0 && raw.size(1) == bytes,
              "gguf_repack: rows must be a multiple of 8, cols of 32 (256 for K-quants), raw [rows, ", bytes, "]");
  const int64_t group_bytes = layout == GgufLayout::kQ8 ? kQ8GroupBytes :
                              layout == GgufLayout::kInt4 ? kInt4GroupBytes :
                              layout == GgufLayout::kQ5K ? kQ5KGroupBytes :
                              layout == GgufLayout::kQ6K ? kQ6KGroupBytes : kQ4GroupBytes;  // q4k: 144 on average
  const int64_t out_cols = cols * group_bytes / (kInt4GroupRows * kInt4GroupCols);
  at::Tensor out = out_in.has_value() ? *out_in : at::empty({rows, out_cols}, raw.options());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == out_cols && out.scalar_type() == at::kByte &&
                  out.is_contiguous(), "gguf_repack: out must be contiguous uint8 [", rows, ", ", out_cols, "]");
  const GgufRepack p{raw.data_ptr<uint8_t>(), static_cast<int>(type), cols, out.data_ptr<uint8_t>()};
  at::parallel_for(0, rows / kInt4GroupRows, 16, [&](int64_t g0, int64_t g1) {
    switch (layout) {
      case GgufLayout::kInt4: gguf_int4_groups(p, g0, g1); break;
      case GgufLayout::kQ4: gguf_q4_groups(p, g0, g1); break;
      case GgufLayout::kQ4K: gguf_q4k_groups(p, g0, g1); break;
      case GgufLayout::kQ5K: gguf_q5k_groups(p, g0, g1); break;
      case GgufLayout::kQ6K: gguf_q6k_groups(p, g0, g1); break;
      case GgufLayout::kQ8: gguf_q8_groups(p, g0, g1); break;
    }
  });
  return out;
}

}  // namespace
}  // namespace tern

TORCH_LIBRARY(tern, m) {
  m.def("gguf_repack(Tensor raw, int type, int cols, int layout, Tensor(a!)? out=None) -> Tensor");
  m.def("int4_mm_avx2(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q4_mm_avx2(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q4k_mm_avx2(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q5k_mm_avx2(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q6k_mm_avx2(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q8_mm_avx2(Tensor x, Tensor w_packed) -> Tensor");
  m.def("decode_attention_avx2(Tensor q, Tensor k_cache, Tensor v_cache, Tensor context_slots, Tensor context_lens, "
        "float scale) -> Tensor");
  m.def("silu_mul_avx2(Tensor gate_up) -> Tensor");
  m.def("bf16_mm_avx2(Tensor x, Tensor w_packed) -> Tensor");
#ifdef TERN_WITH_AVX512
  m.def("int4_mm_avx512(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q4_mm_avx512(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q4k_mm_avx512(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q5k_mm_avx512(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q6k_mm_avx512(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q8_mm_avx512(Tensor x, Tensor w_packed) -> Tensor");
  m.def("decode_attention_avx512(Tensor q, Tensor k_cache, Tensor v_cache, Tensor context_slots, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("silu_mul_avx512(Tensor gate_up) -> Tensor");
  m.def("bf16_mm_avx512(Tensor x, Tensor w_packed) -> Tensor");
#endif
#ifdef TERN_WITH_AVX512_BF16
  m.def("bf16_mm_avx512bf16(Tensor x, Tensor w_packed) -> Tensor");
#endif
#ifdef TERN_WITH_AMX
  m.def("q8_mm_amx(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q4_mm_amx(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q4k_mm_amx(Tensor x, Tensor w_packed) -> Tensor");
  m.def("q6k_mm_amx(Tensor x, Tensor w_packed) -> Tensor");
#endif
}

TORCH_LIBRARY_FRAGMENT(tern, m) {
  m.class_<tern::DecodeStep>("DecodeStep")
      .def(torch::init<std::string, int64_t, int64_t, int64_t, double, std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("forward", &tern::DecodeStep::forward);
}

TORCH_LIBRARY_IMPL(tern, CPU, m) {
  m.impl("gguf_repack", &tern::gguf_repack);
  m.impl("int4_mm_avx2", &tern::int4_mm<tern::int4_groups_avx2, tern::kInt4GroupBytes>);
  m.impl("q4_mm_avx2", &tern::int4_mm<tern::q4_groups_avx2, tern::kQ4GroupBytes>);
  m.impl("q4k_mm_avx2", &tern::int4_mm<tern::q4k_groups_avx2, tern::kQ4GroupBytes, tern::kQ4KActivations>);
  m.impl("q5k_mm_avx2", &tern::int4_mm<tern::q5k_groups_avx2, tern::kQ5KGroupBytes, tern::kQ4KActivations>);
  m.impl("q6k_mm_avx2", &tern::int4_mm<tern::q6k_groups_avx2, tern::kQ6KGroupBytes, tern::kQ6KActivations>);
  m.impl("q8_mm_avx2", &tern::q8_mm<tern::q8_groups_avx2>);
  m.impl("decode_attention_avx2", &tern::decode_attention_op<tern::decode_attention_avx2>);
  m.impl("silu_mul_avx2", &tern::silu_mul_op<tern::silu_mul_avx2>);
  m.impl("bf16_mm_avx2", &tern::bf16_mm<tern::bf16_fma_groups_avx2>);
#ifdef TERN_WITH_AVX512
  m.impl("int4_mm_avx512", &tern::int4_mm<tern::int4_groups_avx512, tern::kInt4GroupBytes>);
  m.impl("q4_mm_avx512", &tern::int4_mm<tern::q4_groups_avx512, tern::kQ4GroupBytes>);
  m.impl("q4k_mm_avx512", &tern::int4_mm<tern::q4k_groups_avx512, tern::kQ4GroupBytes, tern::kQ4KActivations>);
  m.impl("q5k_mm_avx512", &tern::int4_mm<tern::q5k_groups_avx512, tern::kQ5KGroupBytes, tern::kQ4KActivations>);
  m.impl("q6k_mm_avx512", &tern::int4_mm<tern::q6k_groups_avx512, tern::kQ6KGroupBytes, tern::kQ6KActivations>);
  m.impl("q8_mm_avx512", &tern::q8_mm<tern::q8_groups_avx512>);
  m.impl("decode_attention_avx512", &tern::decode_attention_op<tern::decode_attention_avx512>);
  m.impl("silu_mul_avx512", &tern::silu_mul_op<tern::silu_mul_avx512>);
  m.impl("bf16_mm_avx512", &tern::bf16_mm<tern::bf16_fma_groups_avx512>);
#endif
#ifdef TERN_WITH_AVX512_BF16
  m.impl("bf16_mm_avx512bf16", &tern::bf16_mm<tern::bf16_groups_avx512>);
#endif
#ifdef TERN_WITH_AMX
  m.impl("q8_mm_amx", &tern::q8_mm<tern::q8_groups_amx>);
  m.impl("q4_mm_amx", &tern::int4_mm<tern::q4_groups_amx, tern::kQ4GroupBytes>);
  m.impl("q4k_mm_amx", &tern::int4_mm<tern::q4k_groups_amx, tern::kQ4GroupBytes, tern::kQ4KActivations>);
  m.impl("q6k_mm_amx", &tern::int4_mm<tern::q6k_groups_amx, tern::kQ6KGroupBytes, tern::kQ6KActivations>);
#endif
}
