"""Native Gemma family (Gemma, Gemma 2, Gemma 3 text) on the paged KV cache, built from llama.py's pieces.

What differs from Llama, each as transformers computes it: RMSNorm scales by (1 + weight), in fp32; the embedding
is multiplied by sqrt(hidden_size); the MLP is GeLU-tanh gated. Gemma 2 and 3 add a norm after attention and after
the MLP (around a pre-MLP norm), score queries by query_pre_attn_scalar**-0.5, alternate sliding-window and global
layers (config.layer_types) and may soft-cap the final logits; Gemma 2 also soft-caps attention scores; Gemma 3
norms q and k per head and rotates sliding layers with a local RoPE base, global ones with the global base.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import AttentionMetadata, paged_attention, sliding_window_metadata
from engine.models.llama import FUSED_FROM, MLP, Attention, rope_tables, static_rope_tables, uninitialized_embedding

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32 and cast back once: checkpoints store the weight around zero."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(Attention):
    def __init__(self, config, layer_type: str) -> None:
        super().__init__(config)
        if config.model_type != "gemma":
            self.scale = config.query_pre_attn_scalar**-0.5
        # transformers' Gemma 3 has the config field but never passes it to attention: neither do we.
        self.softcap = getattr(config, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None
        self.is_sliding = layer_type == SLIDING
        self.has_qk_norm = config.model_type == "gemma3_text"
        if self.has_qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.softcap))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer_type
        self.self_attn = GemmaAttention(config, layer_type)
        # Gemma 1 names its activation hidden_act, Gemma 2 and 3 hidden_activation.
        self.mlp = MLP(config, getattr(config, "hidden_activation", None) or config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        # Gemma 2 and 3 wrap attention and the MLP in norms on both sides; Gemma 1's second norm is before the MLP.
        self.has_sandwich_norms = config.model_type != "gemma"
        if self.has_sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, cos, sin, kv, meta):
        if not self.has_sandwich_norms:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config, layer_types: list[str]) -> None:
        super().__init__()
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, layer_type) for layer_type in layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    """The interface of llama.LlamaForCausalLM: forward() takes a batch's flattened tokens and returns their final
    hidden states; compute_logits() soft-caps them where the config says so."""

    fused_from = FUSED_FROM
    applies_sliding_window = True
    prefills_alike_by_rows = True  # as llama.LlamaForCausalLM's: a row's forward reads nothing of the rest of its prompt

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.layer_types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
        self.sliding_window = config.sliding_window if SLIDING in self.layer_types else None
        self.model = GemmaModel(config, self.layer_types)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # The CPU decode-attention kernel attends plainly to the whole context: no window, no soft-cap.
        self.has_plain_attention = self.sliding_window is None and attn.softcap is None
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer type -> cos, sin of every position

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def build_rope_tables(self, max_len: int, device, dtype) -> None:
        """Gemma 3 rotates sliding layers with its local base and global layers with its global one (and their
        own scaling); Gemma 1 and 2 have one table for every layer. Computed here (static_rope_tables) unless a
        RoPE type changes with the sequence."""
        per_type = self.config.model_type == "gemma3_text"
        self.rope = {t: static_rope_tables(self.config, max_len, device, dtype, t if per_type else None)
                     for t in set(self.layer_types)}
        if all(table is not None for table in self.rope.values()):
            return
        if per_type:
            from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

            rotary = Gemma3RotaryEmbedding(self.config)
            self.rope = {t: rope_tables(rotary, max_len, device, dtype, layer_type=t) for t in set(self.layer_types)}
            return
        from transformers.models.gemma.modeling_gemma import GemmaRotaryEmbedding
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

        rotary = (GemmaRotaryEmbedding if self.config.model_type == "gemma" else Gemma2RotaryEmbedding)(self.config)
        table = rope_tables(rotary, max_len, device, dtype)
        self.rope = {t: table for t in set(self.layer_types)}

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the model's dtype, as transformers does
        rope = {t: (cos[positions], sin[positions]) for t, (cos, sin) in self.rope.items()}
        metas = {FULL: meta}
        if self.sliding_window is not None:
            metas[SLIDING] = sliding_window_metadata(meta, positions, self.sliding_window)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, *rope[layer.layer_type], kv, metas[layer.layer_type])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
