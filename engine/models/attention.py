"""Paged attention in plain PyTorch (SDPA): write new K/V into cache slots, gather each sequence's context."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where a batch's tokens live, built once per step by the runner and shared by every layer.

    Tokens of all sequences are flattened into one dimension T. Attention works on a padded view:
    B sequences x Q query positions x L context positions.
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_index: torch.Tensor  # [B, Q] index into T for each padded query position (padding points at 0)
    output_index: torch.Tensor  # [T] index into B*Q of each real token (inverse of query_index)
    context_slots: torch.Tensor  # [B, L] cache slot of each context position (padding points at slot 0)
    attn_mask: torch.Tensor | None  # [B, 1, Q, L] True where attention is allowed; None: plain causal


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H*D]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)

    keys = k_flat[meta.context_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_flat[meta.context_slots].transpose(1, 2)
    queries = q[meta.query_index].transpose(1, 2)  # [B, H, Q, D]
    out = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=meta.attn_mask,
        is_causal=meta.attn_mask is None,
        scale=scale,
        enable_gqa=queries.shape[1] != keys.shape[1],
    )
    batch, num_heads, num_queries, _ = out.shape
    out = out.transpose(1, 2).reshape(batch * num_queries, num_heads * head_dim)
    return out[meta.output_index]
