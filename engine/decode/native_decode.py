"""The decode step in C++ (engine/kernels/csrc/decode_step.cpp): every decoder layer of a decode step in one call.

On a small CPU a decode step run from Python, even compiled, spends about as long in dynamo's guards, the generated
wrapper and the dispatcher as in its matmuls (the default model: ~4-5 of ~10 ms a token on 2 cores). The native
step runs the layers with Tern's kernels in one call, so a token costs its matmuls and attention plus the
embedding, the final norm and the lm_head. It serves Llama-family models whose linear layers are packed q8 or
4-bit (int4, q4, q4k), 5-bit (q5k) or 6-bit (q6k) weights, in float32 on a CPU with a kernel path; elsewhere
`unsupported_reason` says why and torch.compile (or the eager model) serves. The eager model is its twin: the same steps, the tests hold it to the same tokens.
"""
from __future__ import annotations

import torch

from engine.kernels import CpuKernels
from engine.kv_cache import KVCache
from engine.weights.layers import (PackedInt4Linear, PackedQ4KLinear, PackedQ4Linear, PackedQ5KLinear, PackedQ6KLinear,
                                   PackedQ8Linear, SplitLinear)
from engine.models.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM

# The packed layers the step multiplies, by the number decode_step.h's WeightKind gives each.
WEIGHT_KINDS = {PackedQ8Linear: 0, PackedInt4Linear: 1, PackedQ4Linear: 2, PackedQ4KLinear: 3, PackedQ6KLinear: 4,
                PackedQ5KLinear: 5}


def unsupported_reason(model, kv_cache: KVCache, kernels: CpuKernels, dtype: torch.dtype) -> str | None:
    """None when the native step can serve this model's decode steps here, else why not (one line)."""
    if type(model) is not LlamaForCausalLM:  # subclasses (Phi-3) change what a layer computes
        return f"it serves the Llama family only ({type(model).__name__} here)"
    if kernels.path == "off" or kernels.decode_attention is None:
        return f"the CPU kernel path is {kernels.path}"
    if dtype != torch.float32:
        return f"it computes in float32, and the model runs in {str(dtype).removeprefix('torch.')}"
    if kv_cache.head_dim % 16:
        return f"head_dim {kv_cache.head_dim} is not a multiple of 16"
    config = model.config
    if config.hidden_act != "silu":
        return f"its MLP is SiLU-gated only ({config.hidden_act!r} here)"
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            for part in _parts(linear):
                if type(part) not in WEIGHT_KINDS:
                    return (f"its linear layers must be packed q8, int4, q4, q4k, q5k or q6k weights "
                            f"({type(part).__name__} here)")
    return None


def _parts(linear) -> list:
    """A linear layer's packed parts: itself, or a SplitLinear's parts (their outputs side by side)."""
    return list(linear.parts) if isinstance(linear, SplitLinear) else [linear]


class NativeDecode:
    """Callable like the model's forward for decode steps whose attention the CPU kernel serves."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, kernels: CpuKernels) -> None:
        self.model = model
        empty = torch.empty(0)
        tensors, kinds = [], []
        for layer, (k_cache, v_cache) in zip(model.model.layers, kv_cache.layers()):
            attn, mlp = layer.self_attn, layer.mlp
            tensors += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            if attn.has_qk_norm:
                tensors += [attn.q_norm.weight.detach(), attn.k_norm.weight.detach()]
            else:
                tensors += [empty, empty]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                parts = _parts(linear)
                tensors += [empty if linear.bias is None else linear.bias.detach(), *(p.weight_packed for p in parts)]
                kinds += [len(parts), *(WEIGHT_KINDS[type(p)] for p in parts)]
            tensors += [k_cache, v_cache]
        attn = model.model.layers[0].self_attn
        self.step = torch.classes.tern.DecodeStep(kernels.path, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                  float(model.model.layers[0].input_layernorm.eps), tensors, kinds)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers, meta: AttentionMetadata):
        [group] = meta.groups
        x = self.model.model.embed_tokens(input_ids)
        cos, sin = self.model.rope_cos[positions], self.model.rope_sin[positions]
        x = self.step.forward(x, cos, sin, meta.slot_mapping, group.context_slots, group.context_lens)
        return self.model.model.norm(x)
