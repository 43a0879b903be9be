"""Native Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) running batched prefill/decode on a paged KV cache.

Module and parameter names mirror transformers' so a Hugging Face state dict loads as is; the numerics follow
transformers' eager code (RMSNorm in fp32, RoPE tables cast to the model dtype) so greedy tokens match.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionMetadata, paged_attention

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # the config.model_type values LlamaForCausalLM serves
# Served layers built from several checkpoint tensors (fuse_projections; engine/weights/streamed_load.py): by module name.
FUSED_FROM = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(rotary: nn.Module, max_len: int, device, dtype, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, rotary dims] of every position, from a transformers rotary embedding (its own
    rope_type variants); kwargs go to its forward (Gemma 3's layer_type)."""
    positions = torch.arange(max_len, device=device)[None]
    cos, sin = rotary.to(device)(torch.empty(0, device=device, dtype=dtype), positions, **kwargs)
    return cos[0], sin[0]


# The activations native families name (hidden_act), as transformers' ACT2FN computes them, without importing
# transformers.activations or modeling_llama: with what they pull in (most of transformers' modeling code), ~1-2 s of
# a server's start before its weights could begin to load. Other names still go to ACT2FN.
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
                "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
# RoPE types whose tables are the default formula over transformers' own inverse frequencies (modeling_rope_utils,
# light to import); "dynamic" and "longrope" change theirs with the sequence, so their tables come from the module.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def activation(name: str):
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def static_rope_tables(config, max_len: int, device, dtype, layer_type: str | None = None):
    """The cos/sin tables transformers' rotary embedding of the Llama and Gemma families gives (their modules share
    one formula; Gemma 3 has parameters per layer type), the same arithmetic in the same order, computed here so a
    start does not import their modeling code. None for the RoPE types whose tables change with the sequence: the
    family's module computes those."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        parameters = parameters[layer_type]
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        return None
    if rope_type == "default":  # the modules' compute_default_rope_parameters
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    positions = torch.arange(max_len, device=device)[None]
    freqs = positions[..., None].float() * inv_freq.to(device=device, dtype=torch.float)  # as their forward
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype)[0], (emb.sin() * scaling).to(dtype)[0]


def llama_rope_tables(config, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What rope_tables(LlamaRotaryEmbedding(config), ...) gives."""
    tables = static_rope_tables(config, max_len, device, dtype)
    if tables is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        tables = rope_tables(LlamaRotaryEmbedding(config), max_len, device, dtype)
    return tables


def uninitialized_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An embedding without nn.Embedding's random init: the checkpoint's weight replaces it. Models are built on the
    meta device, where that init (normal_) imports torch._dynamo: 1.1-1.3 s of a server's start, on 2 cores."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def _fused_linear(*parts: nn.Linear) -> nn.Linear:
    first = parts[0]
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias,
                      device=first.weight.device, dtype=first.weight.dtype)
    if first.weight.is_meta:  # nothing to copy yet (the checkpoint fills it); torch.cat on meta imports torch._dynamo
        return fused
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, R]. R < D (Phi-3's partial_rotary_factor): the first R dims rotate, the
    rest pass through, as transformers does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rotated * cos + _rotate_half(rotated) * sin, passed], dim=-1)


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.has_qk_norm = config.model_type == "qwen3"
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def fuse(self) -> None:
        """One matmul instead of three: at batch 1 each call's fixed cost matters as much as its bytes."""
        self.qkv_proj = _fused_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(paged_attention(q, k, v, kv[0], kv[1], meta, self.scale))

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [T, heads, D] of x, normed (Qwen3) and rotated."""
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, config, hidden_act: str | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = activation(hidden_act or config.hidden_act)

    def fuse(self) -> None:
        self.gate_up_proj = _fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward() takes flattened tokens of a whole batch and returns their final hidden states."""

    fused_from = FUSED_FROM
    # Softmax of q.k * scale over the whole context: what Tern's CPU decode-attention kernel computes.
    has_plain_attention = True
    applies_sliding_window = False  # Mistral's window: the engine keeps contexts within it instead
    # A prompt computed one row per position (engine/decode/runner.py) gives what this model's own prefill gives:
    # nothing a forward computes depends on the rest of the prompt beside it.
    prefills_alike_by_rows = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """Merge q/k/v and gate/up weights after loading (the checkpoint keeps them apart)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def build_rope_tables(self, max_len: int, device, dtype) -> None:
        """Precompute cos/sin for every position once, as transformers' RoPE does (all rope_type variants)."""
        self.rope_cos, self.rope_sin = llama_rope_tables(self.config, max_len, device, dtype)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
