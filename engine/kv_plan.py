"""KVPlan: how many KV-cache blocks an engine allocates, and the context length it then serves.

The context length is the model's position limit, cut to its sliding window where attention here is full, to the
configured max_model_len, and (native models) to what the blocks that fit the memory budget hold.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache, blocks_needed
from engine.weights.loader import LoadedModel


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    max_model_len: int
    kv_args: tuple[int, int, int, int] | None  # KVCache's (num_layers, block_size, num_kv_heads, head_dim); None:
    # the generic path, which recomputes every step and keeps no cache, but whose allocator still bounds context
    dtype: torch.dtype | None = None  # the cache's: the model's, or bf16 for a float32 one (config.kv_cache_dtype)


def plan_kv_cache(config: EngineConfig, loaded: LoadedModel) -> KVPlan:
    """Blocks for max_num_seqs sequences of the full context, fewer when the memory budget holds fewer (never none);
    num_kv_blocks, when set, overrides both."""
    limit = _context_limit(config, loaded)
    blocks_for_every_seq = config.max_num_seqs * blocks_needed(limit, config.block_size)
    if not loaded.is_native:
        return KVPlan(config.num_kv_blocks or blocks_for_every_seq, limit, None)
    hf_config, model = loaded.hf_config, loaded.model
    kv_args = (hf_config.num_hidden_layers, config.block_size, model.num_kv_heads, model.head_dim)
    # bfloat16 narrows a float32 model's cache only: a half-precision model's is half precision already.
    dtype = torch.bfloat16 if config.kv_cache_dtype == "bfloat16" and loaded.dtype == torch.float32 else loaded.dtype
    bytes_per_block = KVCache.bytes_per_block(*kv_args, dtype)
    num_blocks = config.num_kv_blocks or max(min(config.kv_cache_memory_bytes // bytes_per_block,
                                                 blocks_for_every_seq), 1)
    return KVPlan(num_blocks, min(limit, num_blocks * config.block_size), kv_args, dtype)


def _context_limit(config: EngineConfig, loaded: LoadedModel) -> int:
    hf_config = loaded.hf_config
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    applies_window = loaded.is_native and loaded.model.applies_sliding_window
    if window and getattr(hf_config, "use_sliding_window", True) and not applies_window:
        limit = min(limit, window)  # attention here is full: stay inside the window the model was trained on
    return min(config.max_model_len or limit, limit)
