"""Paged attention: write new K/V into cache slots, then attend. Prompts gather each sequence's context for SDPA;
decode steps use Tern's CPU kernel, which reads the cache in place, where the runner gives them one, and plain
matmuls (its twin) elsewhere. Gemma's and Phi-3's variants: scores soft-capped with tanh (plain matmuls: SDPA
cannot cap), and sliding-window layers (sliding_window_metadata: the same batch under a windowed mask)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attended together on a padded view: B sequences x Q query positions x L context positions.

    A batch that mixes decoding sequences (one new token each) with prompts being prefilled is split into a
    decode group and a prefill group, so one long prompt does not pad every decoding sequence to its length.
    """

    query_index: torch.Tensor | None  # [B, Q] index into T of each padded query position (padding: 0); None: decode
    output_index: torch.Tensor | None  # [rows] index into B*Q of each real token, in `rows` order; None: decode
    context_slots: torch.Tensor  # [B, L] cache slot of each context position (padding points at slot 0)
    attn_mask: torch.Tensor | None  # [B, 1, Q, L] True where attention is allowed; None: see is_causal
    is_causal: bool = True  # with no mask: causal over each sequence's own tokens (False: attend to all L)
    is_decode: bool = False  # one new token per sequence (Q == 1): no padding to gather or scatter
    rows: torch.Tensor | None = None  # the group's tokens in T; None: all of T, in order
    # [B] context positions each sequence attends to, and the CPU kernel that serves the group (see
    # engine.kernels: decode_attention): set only on decode groups it serves, which need no mask or copy.
    context_lens: torch.Tensor | None = None
    kernel: Callable | None = None


@dataclass
class AttentionMetadata:
    """Where a batch's tokens live, built once per step by the runner and shared by every layer. Tokens of all
    sequences are flattened into one dimension T."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]: slot = block * block_size + offset
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) (Gemma 2)
) -> torch.Tensor:  # [T, H*D]
    # The caches come flat and each layer's has its own storage: under torch.compile, a write through a view
    # of the cache (or into tensors sharing one storage) made inductor copy the layer's whole cache per step.
    # A cache of another dtype than the model's (--kv-cache-dtype) stores each value rounded once, as the native
    # step does, and every read below computes with those rounded values in the model's dtype.
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if len(meta.groups) == 1 and meta.groups[0].rows is None:
        return _attend(q, k_cache, v_cache, meta.groups[0], scale, softcap)
    out = q.new_empty(q.shape[0], q.shape[1] * k.shape[2])
    for group in meta.groups:
        out.index_copy_(0, group.rows, _attend(q, k_cache, v_cache, group, scale, softcap))
    return out


def sliding_window_metadata(meta: AttentionMetadata, positions: torch.Tensor, window: int) -> AttentionMetadata:
    """The same batch with each query seeing only the `window` latest positions, its own included: transformers'
    sliding_window_overlay (key > query - window). Built once per step and shared by the sliding layers; every
    group gets a mask (and no kernel: the kernel attends to the whole context). `positions`: the step's [T]."""
    groups = []
    for group in meta.groups:
        if group.is_decode:
            query_positions = (positions if group.rows is None else positions[group.rows])[:, None]  # [B, 1]
        else:
            query_positions = positions[group.query_index]  # [B, Q]; padding queries read row 0's, then drop out
        key_positions = torch.arange(group.context_slots.shape[1], device=positions.device)
        query_positions = query_positions[..., None]  # [B, Q, 1]
        mask = (key_positions <= query_positions) & (key_positions > query_positions - window)
        groups.append(replace(group, attn_mask=mask[:, None], is_causal=False, context_lens=None, kernel=None))
    return AttentionMetadata(meta.slot_mapping, groups)


def _attend(q, k_flat, v_flat, group: AttentionGroup, scale: float, softcap: float | None) -> torch.Tensor:
    """Attention output of the group's tokens, [rows, H*D], in the order of group.rows."""
    if group.kernel is not None:
        assert softcap is None, "the CPU decode-attention kernel does not soft-cap"
        q_rows = q if group.rows is None else q.index_select(0, group.rows)  # [B, H, D]
        return group.kernel(q_rows.contiguous(), k_flat, v_flat, group.context_slots, group.context_lens, scale)
    num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
    # index_select (one memcpy per row) rather than advanced indexing: several times faster on CPU.
    batch, context_len = group.context_slots.shape
    slots = group.context_slots.reshape(-1)
    keys = k_flat.index_select(0, slots).to(q.dtype).view(batch, context_len, num_kv_heads, head_dim).transpose(1, 2)
    values = v_flat.index_select(0, slots).to(q.dtype).view(batch, context_len, num_kv_heads, head_dim).transpose(1, 2)
    num_heads = q.shape[1]
    if group.is_decode:
        q_rows = q if group.rows is None else q.index_select(0, group.rows)  # [B, H, D]
        return _decode_attention_matmul(q_rows, keys, values, group.attn_mask, scale, softcap)
    num_queries = group.query_index.shape[1]
    queries = q.index_select(0, group.query_index.reshape(-1)).view(batch, num_queries, num_heads, head_dim)
    queries = queries.transpose(1, 2)  # [B, H, Q, D]
    if softcap is not None:
        out = _softcapped_attention(queries, keys, values, group, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=group.attn_mask,
            is_causal=group.attn_mask is None and group.is_causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    out = out.transpose(1, 2).reshape(batch * num_queries, num_heads * head_dim)
    return out.index_select(0, group.output_index)


def _decode_attention_matmul(q, keys, values, attn_mask, scale: float, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence, in plain matmuls: several times faster than SDPA's flash kernel on CPU, which is
    tuned for long queries, and on an H100 it beat memory-efficient SDPA 2.3x in a 64-sequence step. The CPU kernel's
    twin: it rounds where this rounds. In fp32, softmax then the weighted sum. In bf16/fp16 it rounds as SDPA's
    flash kernel (which serves prompts) does, so a prompt token's logprob is the one it gets when decoded: scores
    in fp32 (a half-precision matmul would round them, ~0.15 nats apart), exp(s - max) rounded to weight the
    values, their fp32 sum dividing the fp32 result, rounded once."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # heads sharing one KV head
    is_half = q.dtype != torch.float32
    scores = torch.matmul(grouped.float(), keys.float().transpose(-1, -2)) if is_half else torch.matmul(
        grouped, keys.transpose(-1, -2))
    scores = scores * scale  # [B, Hkv, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None:  # [B, 1, 1, L]
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    if not is_half:
        return torch.matmul(torch.softmax(scores, dim=-1), values).reshape(batch, num_heads * head_dim)
    exps = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weighted = torch.matmul(exps.to(values.dtype).float(), values.float()) / exps.sum(dim=-1, keepdim=True)
    return weighted.to(q.dtype).reshape(batch, num_heads * head_dim)


def _softcapped_attention(queries, keys, values, group: AttentionGroup, scale: float, softcap: float) -> torch.Tensor:
    """SDPA's result with each score capped before the mask and softmax, in transformers' eager order (Gemma 2
    runs eager for this reason). queries [B, H, Q, D]; keys, values [B, Hkv, L, D]; returns [B, H, Q, D]."""
    num_groups = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(num_groups, dim=1), values.repeat_interleave(num_groups, dim=1)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * scale  # [B, H, Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    mask = group.attn_mask
    if mask is None and group.is_causal:
        num_queries, context_len = scores.shape[-2:]
        mask = torch.ones(num_queries, context_len, dtype=torch.bool, device=scores.device).tril(context_len - num_queries)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values)
