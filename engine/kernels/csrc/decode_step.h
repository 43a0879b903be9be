// Tern's native decode step: every decoder layer of a Llama-family model for one new token per sequence, in one
// call; ops.cpp registers it as the TorchScript class torch.classes.tern.DecodeStep.
//
// Run from Python, a decode step of the 135M default model is ~400 small torch calls: compiled, its dynamo guards,
// the generated wrapper and the dispatcher took ~4-5 ms of a ~10 ms token on 2 cores, while the matmuls took ~4.5.
// Here a step is one call: per layer RMSNorm, the qkv matmul (+ bias), Qwen3's q/k norms, RoPE, the new keys
// and values into the paged cache, decode attention, the o matmul and residual, RMSNorm, gate_up, SiLU * up, down
// and residual; matmuls and attention use the kernels of kernels.h (q8, int4, q4, q4k, q5k or q6k weights).
// Activations are float32. The math is the eager model's (engine/models/llama.py), step for step and without fused multiply-adds,
// so the two differ only in summation order; the tests hold it to the eager model's tokens.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels.h"
#include "matmul.h"

namespace tern {
namespace {

// What a linear layer's packed weight holds; the numbers are engine/decode/native_decode.py's WEIGHT_KINDS.
enum class WeightKind : int64_t { kQ8 = 0, kInt4 = 1, kQ4 = 2, kQ4K = 3, kQ6K = 4, kQ5K = 5 };

// One run of a linear layer's output rows in one packed weight, with the kernel that reads its layout and how that
// kernel wants its activations (chosen once, when the step is built).
struct Part {
  at::Tensor packed;
  Int4Groups groups = nullptr;
  ActivationBlocks activations = kPer32Activations;
  int64_t N = 0;
};

// A linear layer: one part, or several where a fused projection's parts keep layouts of their own (a Q4_K_M file's
// q and k in q4k beside v in q6k), their outputs side by side.
struct Linear {
  std::vector<Part> parts;
  at::Tensor bias;  // undefined when the layer has none
  int64_t N = 0, K = 0;
};

struct Layer {
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm and k_norm: Qwen3 only
  Linear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [slots, Hkv, D] float32 or bf16 (--kv-cache-dtype), the engine's own
};

constexpr int64_t kElementwiseGrain = 4096;  // values per thread's share of an elementwise step, at least

at::Tensor defined_or_empty(const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); }

const float* data(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// values[0, n) into a cache's row `slot`: as they are in a float32 cache, rounded to bf16 (kernels.h's rounding,
// torch's, as the eager step's index_copy_ rounds) in a bf16 one.
void store_row(const at::Tensor& cache, int64_t slot, const float* values, int64_t n) {
  if (cache.scalar_type() == at::kBFloat16) {
    uint16_t* row = static_cast<uint16_t*>(cache.data_ptr()) + slot * n;
    for (int64_t i = 0; i < n; ++i) row[i] = round_to_bf16_bits(values[i]);
  } else {
    std::copy(values, values + n, cache.data_ptr<float>() + slot * n);
  }
}

class DecodeStep : public torch::CustomClassHolder {
 public:
  // tensors: per layer input_norm, post_norm, q_norm, k_norm, then for qkv, o, gate_up and down its bias and its
  // parts' packed weights, then k_cache, v_cache; an absent one is an empty tensor. kinds: per layer and linear
  // layer, its number of parts, then each part's WeightKind.
  DecodeStep(std::string isa, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
             std::vector<at::Tensor> tensors, std::vector<int64_t> kinds)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(head_dim % 16 == 0, "DecodeStep: head_dim must be a multiple of 16");
    // Per WeightKind (q8, int4, q4, q4k, q6k, q5k): the kernel of this instruction set.
    Int4Groups kernels[6];
    if (isa == "avx2") {
      kernels[0] = q8_groups_avx2, kernels[1] = int4_groups_avx2, kernels[2] = q4_groups_avx2;
      kernels[3] = q4k_groups_avx2, kernels[4] = q6k_groups_avx2, kernels[5] = q5k_groups_avx2;
      attention_ = decode_attention_avx2, silu_ = silu_mul_avx2;
#ifdef TERN_WITH_AVX512
    } else if (isa == "avx512") {
      kernels[0] = q8_groups_avx512, kernels[1] = int4_groups_avx512, kernels[2] = q4_groups_avx512;
      kernels[3] = q4k_groups_avx512, kernels[4] = q6k_groups_avx512, kernels[5] = q5k_groups_avx512;
      attention_ = decode_attention_avx512, silu_ = silu_mul_avx512;
#endif
#ifdef TERN_WITH_AMX
    } else if (isa == "amx") {  // avx512's kernels, with AMX tiles where a kernel has them
      kernels[0] = q8_groups_amx, kernels[1] = int4_groups_avx512, kernels[2] = q4_groups_amx;
      kernels[3] = q4k_groups_amx, kernels[4] = q6k_groups_amx, kernels[5] = q5k_groups_avx512;
      attention_ = decode_attention_avx512, silu_ = silu_mul_avx512;
#endif
    } else {
      TORCH_CHECK(false, "DecodeStep: no kernels for ", isa, " in this build");
    }
    size_t t = 0, k = 0;
    auto next_tensor = [&]() -> const at::Tensor& {
      TORCH_CHECK(t < tensors.size(), "DecodeStep: fewer tensors than the weight kinds name");
      return tensors[t++];
    };
    auto next_kind = [&]() -> int64_t {
      TORCH_CHECK(k < kinds.size(), "DecodeStep: fewer weight kinds than layers");
      return kinds[k++];
    };
    while (t < tensors.size()) {
      Layer layer;
      layer.input_norm = next_tensor();
      layer.post_norm = next_tensor();
      layer.q_norm = defined_or_empty(next_tensor());
      layer.k_norm = defined_or_empty(next_tensor());
      Linear* linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (Linear* linear : linears) {
        const int64_t num_parts = next_kind();
        TORCH_CHECK(num_parts >= 1, "DecodeStep: a linear layer has at least one part");
        linear->bias = defined_or_empty(next_tensor());
        TORCH_CHECK(!linear->bias.defined() || linear->bias.scalar_type() == at::kFloat, "DecodeStep: float32 biases");
        for (int64_t i = 0; i < num_parts; ++i) {
          const int64_t kind = next_kind();
          TORCH_CHECK(kind >= 0 && kind <= 5,
                      "DecodeStep: weight kinds are 0 (q8), 1 (int4), 2 (q4), 3 (q4k), 4 (q6k), 5 (q5k)");
          const WeightKind weight = static_cast<WeightKind>(kind);
          Part part;
          part.packed = next_tensor();
          TORCH_CHECK(part.packed.scalar_type() == at::kByte && part.packed.is_contiguous() && part.packed.dim() == 2,
                      "DecodeStep: packed weights must be contiguous uint8");
          part.groups = kernels[kind];
          part.activations = weight == WeightKind::kQ4K || weight == WeightKind::kQ5K ? kQ4KActivations :
                             weight == WeightKind::kQ6K ? kQ6KActivations : kPer32Activations;
          part.N = part.packed.size(0);
          // per row: K * 5 / 8 int4, K * 9 / 16 q4 and q4k, K * 11 / 16 q5k, K * 105 / 128 q6k, K * 17 / 16 q8
          const int64_t bytes = part.packed.size(1);
          const int64_t K = weight == WeightKind::kInt4 ? bytes * 8 / 5 :
                            weight == WeightKind::kQ8 ? bytes * 16 / 17 :
                            weight == WeightKind::kQ5K ? bytes * 16 / 11 :
                            weight == WeightKind::kQ6K ? bytes * 128 / 105 : bytes * 16 / 9;
          TORCH_CHECK(K % part.activations.block == 0,
                      "DecodeStep: a weight's K must be a multiple of its activation blocks (256: q4k, q5k, q6k)");
          TORCH_CHECK(i == 0 || K == linear->K, "DecodeStep: a linear layer's parts take one input width");
          linear->K = K;
          linear->N += part.N;
          linear->parts.push_back(std::move(part));
        }
      }
      layer.k_cache = next_tensor();
      layer.v_cache = next_tensor();
      TORCH_CHECK((layer.k_cache.scalar_type() == at::kFloat || layer.k_cache.scalar_type() == at::kBFloat16) &&
                      layer.v_cache.scalar_type() == layer.k_cache.scalar_type() && layer.k_cache.is_contiguous() &&
                      layer.v_cache.is_contiguous() && layer.k_cache.size(1) == num_kv_heads &&
                      layer.k_cache.size(2) == head_dim,
                  "DecodeStep: caches must be contiguous float32 or bf16 [slots, Hkv, D]");
      TORCH_CHECK(layer.qkv.N == (num_heads + 2 * num_kv_heads) * head_dim, "DecodeStep: qkv rows");
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(k == kinds.size(), "DecodeStep: more weight kinds than the tensors hold");
  }

  // x [B, H] after the embedding; cos, sin [B, D] at each sequence's position; slot_mapping [B] where its new key
  // and value go; context_slots [B, L] and context_lens [B] what it attends to (the new token included).
  // Returns the hidden states after the last layer (before the final norm).
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                     const at::Tensor& slot_mapping, const at::Tensor& context_slots, const at::Tensor& context_lens) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "DecodeStep: x must be float32 [B, H]");
    at::Tensor x = x_in.contiguous().clone();  // the residual stream, updated in place
    const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
    const at::Tensor slots = slot_mapping.contiguous(), context = context_slots.contiguous();
    const at::Tensor lengths = context_lens.contiguous();
    const int64_t B = x.size(0), H = x.size(1), D = head_dim_, Hq = num_heads_, Hkv = num_kv_heads_;
    TORCH_CHECK(cos.size(0) == B && cos.size(1) == D && slots.numel() == B && context.size(0) == B &&
                    lengths.numel() == B && slots.scalar_type() == at::kLong && context.scalar_type() == at::kLong &&
                    lengths.scalar_type() == at::kLong,
                "DecodeStep: one position, slot and context per sequence (int64)");
    float* xs = x.data_ptr<float>();
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (const Layer& layer : layers_) {
      const int64_t inter = layer.gate_up.N / 2, qkv_width = layer.qkv.N;
      h_.resize(B * H);
      qkv_.resize(B * qkv_width);
      q_.resize(B * Hq * D);
      k_rope_.resize(Hkv * D);  // one row's keys after rope, before they go into the cache
      attn_.resize(B * Hq * D);
      gate_up_.resize(B * 2 * inter);
      act_.resize(B * inter);
      out_.resize(B * H);

      rms_norm(xs, layer.input_norm.data_ptr<float>(), h_.data(), B, H);
      linear(layer.qkv, h_.data(), B, qkv_.data());
      for (int64_t b = 0; b < B; ++b) {
        float* row = &qkv_[b * qkv_width];
        float* k = row + Hq * D;
        const float* v = k + Hkv * D;
        if (layer.q_norm.defined()) {
          rms_norm(row, layer.q_norm.data_ptr<float>(), row, Hq, D);
          rms_norm(k, layer.k_norm.data_ptr<float>(), k, Hkv, D);
        }
        for (int64_t h = 0; h < Hq; ++h) rope(row + h * D, cs + b * D, sn + b * D, &q_[(b * Hq + h) * D]);
        for (int64_t h = 0; h < Hkv; ++h) rope(k + h * D, cs + b * D, sn + b * D, &k_rope_[h * D]);
        store_row(layer.k_cache, slot[b], k_rope_.data(), Hkv * D);
        store_row(layer.v_cache, slot[b], v, Hkv * D);
      }
      const AttentionProblem problem{q_.data(), layer.k_cache.data_ptr(), layer.v_cache.data_ptr(), false,
                                     layer.k_cache.scalar_type() == at::kBFloat16,
                                     context.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), B, Hq, D, Hkv,
                                     context.size(1), 1.0f / std::sqrt(static_cast<float>(D)), attn_.data()};
      decode_attention(attention_, problem);
      linear(layer.o, attn_.data(), B, out_.data());
      for (int64_t i = 0; i < B * H; ++i) xs[i] += out_[i];

      rms_norm(xs, layer.post_norm.data_ptr<float>(), h_.data(), B, H);
      linear(layer.gate_up, h_.data(), B, gate_up_.data());
      // SiLU(gate) * up (silu.h), split over the threads: one exp per value.
      at::parallel_for(0, B * inter, kElementwiseGrain,
                       [&](int64_t i0, int64_t i1) { silu_(gate_up_.data(), act_.data(), inter, i0, i1); });
      linear(layer.down, act_.data(), B, out_.data());
      for (int64_t i = 0; i < B * H; ++i) xs[i] += out_[i];
    }
    return x;
  }

 private:
  // out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) for rows of `width`, as the eager RMSNorm (in place is fine).
  void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t width) const {
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + r * width;
      float sum = 0.0f;
      for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps_);
      for (int64_t i = 0; i < width; ++i) out[r * width + i] = w[i] * (row[i] * scale);
    }
  }

  // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], as engine/models/llama.py applies it.
  void rope(const float* x, const float* cos, const float* sin, float* out) const {
    const int64_t half = head_dim_ / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (int64_t i = half; i < head_dim_; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
  }

  // out [M, l.N] = x [M, l.K] @ w.T (+ bias): each part writes its columns of every row (the kernels' output row
  // stride is the whole layer's N).
  void linear(const Linear& l, const float* x, int64_t M, float* out) {
    int64_t column = 0;
    for (const Part& part : l.parts) {
      block_matmul(part.groups, part.activations, scratch_, x, false, M, l.K, part.packed.data_ptr<uint8_t>(), part.N,
                   out + column, l.N);
      column += part.N;
    }
    if (l.bias.defined()) {
      const float* bias = l.bias.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < l.N; ++n) out[m * l.N + n] += bias[n];
    }
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  float eps_;
  AttentionTasks attention_ = nullptr;
  SiluMul silu_ = nullptr;
  std::vector<Layer> layers_;
  QuantizedScratch scratch_;
  std::vector<float> h_, qkv_, q_, attn_, gate_up_, act_, out_, k_rope_;  // per-step buffers, reused
};

}  // namespace
}  // namespace tern
