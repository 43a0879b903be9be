"""Native Phi-3 / Phi-4 (model_type "phi3") on the paged KV cache: Llama's layers with what Phi-3 changes.

Its checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj (loaded as they are); RoPE may rotate
only the first partial_rotary_factor of each head (Phi-4-mini) and may be `longrope` (Phi-3.5, Phi-4-mini: short
factors within the original context, long ones beyond it, chosen as transformers chooses them); a sliding_window
in the config limits every layer's attention (Phi-3-mini).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import AttentionMetadata, sliding_window_metadata
from engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, rope_tables

MODEL_TYPES = ("phi3",)


class Phi3Attention(Attention):
    def __init__(self, config) -> None:
        super().__init__(config)
        del self.q_proj, self.k_proj, self.v_proj
        size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, size, bias=False)

    def fuse(self) -> None:
        pass  # the checkpoint's qkv_proj is fused already


class Phi3MLP(MLP):
    def __init__(self, config) -> None:
        super().__init__(config)
        del self.gate_proj, self.up_proj
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)

    def fuse(self) -> None:
        pass


class Phi3DecoderLayer(DecoderLayer):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.self_attn, self.mlp = Phi3Attention(config), Phi3MLP(config)


class Phi3ForCausalLM(LlamaForCausalLM):
    """A subclass for its pieces only: the native C++ step serves LlamaForCausalLM itself, never this."""

    fused_from: dict = {}
    applies_sliding_window = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model.layers = nn.ModuleList(Phi3DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.sliding_window = getattr(config, "sliding_window", None)
        # The CPU decode-attention kernel attends to the whole context: not for a sliding window.
        self.has_plain_attention = self.sliding_window is None
        self.original_max_len = config.rope_parameters.get("original_max_position_embeddings")
        self.short_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # longrope within the original context

    @property
    def prefills_alike_by_rows(self) -> bool:
        # longrope picks a prompt's factors from its last position (as transformers does), which a row alone lacks
        return self.short_rope is None

    def build_rope_tables(self, max_len: int, device, dtype) -> None:
        """transformers' Phi-3 RoPE computes its short factors for a sequence within original_max_len and its long
        ones beyond; both are kept when the engine's context can pass it (rope_cos/sin: long, short_rope: short)."""
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        rotary = Phi3RotaryEmbedding(self.config)
        self.rope_cos, self.rope_sin = rope_tables(rotary, max_len, device, dtype)
        is_longrope = self.config.rope_parameters.get("rope_type") == "longrope"
        if is_longrope and max_len > self.original_max_len:
            self.short_rope = rope_tables(rotary, self.original_max_len, device, dtype)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(positions, meta)
        if self.sliding_window is not None:
            meta = sliding_window_metadata(meta, positions, self.sliding_window)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.model.norm(x)

    def _rope(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.short_rope is None:
            return self.rope_cos[positions], self.rope_sin[positions]
        # transformers picks the factors once per forward pass, from the longest position in it: a decoded token
        # is long once its own position is past the original context; a prompt's every token once its last is.
        # One difference remains: transformers' generate() re-encodes a sequence's whole cache with the long
        # factors when it grows past the original context; here the keys cached before that keep their short ones.
        is_long = positions >= self.original_max_len
        for group in meta.groups:
            if not group.is_decode:
                rows = slice(None) if group.rows is None else group.rows
                is_long[rows] = is_long[rows].any()
        short_cos, short_sin = self.short_rope
        within = positions.clamp(max=self.original_max_len - 1)
        is_long = is_long[:, None]
        cos = torch.where(is_long, self.rope_cos[positions], short_cos[within])
        sin = torch.where(is_long, self.rope_sin[positions], short_sin[within])
        return cos, sin
