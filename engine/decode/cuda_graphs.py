"""Decode steps on CUDA replayed from captured CUDA graphs, one per (batch size, context length) bucket.

An eager decode step of a 1B model launches about a thousand kernels; from Python that takes ~12 ms on the
H100 box, while the GPU needs ~1 ms to read the weights. A CUDA graph replays the whole step, lm_head included,
with one launch. Graphs need fixed shapes and fixed addresses, so every decode step is padded up to a bucket:
- batch: padding rows decode token 0 at position 0, write their K/V into the cache's scratch slot (a row past
  the last block that no sequence owns) and attend to one key; their logits are dropped;
- context: every sequence attends over the bucket's length, masked to its own context.
The host writes one small int64 table per step (token, position, slot, context length, block table per row)
and copies it into a static buffer; slot indices and the mask are computed inside the graph.

The same padded step runs uncaptured on CPU (capture=False), so the tests check the padding on every machine;
the CUDA tests check the captured step against the eager step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.models.attention import AttentionGroup, AttentionMetadata

logger = logging.getLogger(__name__)

# Quantizations whose decode steps are captured. bitsandbytes layers are left eager: capturing the 4-bit ones
# failed and left the CUDA context unusable, and LLM.int8() splits outliers with shapes read back from the GPU.
# int4 compiles (engine/decode/compiled.py) but is not here: it runs on CPUs only, so no capture of it was ever verified.
CAPTURABLE_QUANTIZATIONS = ("none", "int8")
FIRST_CONTEXT_BUCKET = 256  # tokens; buckets double from here up to the model's context length
COLUMNS = 4  # token id, position, cache slot, context length; the block table follows


def unsupported_reason(quantization: str) -> str | None:
    """None when decode steps of the native model with this quantization can be captured, else why not."""
    if quantization not in CAPTURABLE_QUANTIZATIONS:
        return f"--quantization {quantization} layers are not captured in CUDA graphs"
    return None


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs: a step pads to the next one, wasting at most 15 rows
    (a row costs little next to reading the weights)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def context_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Context lengths that double from 256, each a whole number of blocks, the last covering max_model_len."""
    largest = -(-max_model_len // block_size) * block_size
    sizes, size = [], -(-FIRST_CONTEXT_BUCKET // block_size) * block_size
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def _bucket(sizes: list[int], value: int) -> int | None:
    return next((size for size in sizes if size >= value), None)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the graph's output buffer, [batch bucket, V] float32


class DecodeGraphs:
    """Padded decode steps for every (batch, context) bucket; run() takes a decode batch and returns logits."""

    def __init__(self, forward, model, kv_cache, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        self.forward = forward  # model.forward or its compiled twin
        self.model = model
        self.kv_layers = kv_cache.layers()
        self.block_size = kv_cache.block_size
        self.scratch_slot = kv_cache.scratch_slot
        self.capture = capture
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.context_sizes = context_buckets(max_model_len, self.block_size)
        device = kv_cache.keys[0].device
        self.max_blocks = self.context_sizes[-1] // self.block_size
        width = COLUMNS + self.max_blocks
        self.inputs = torch.zeros(self.batch_sizes[-1], width, dtype=torch.long, device=device)
        self.host_inputs = torch.zeros(self.batch_sizes[-1], width, dtype=torch.long,
                                       pin_memory=device.type == "cuda")
        self.key_positions = torch.arange(self.context_sizes[-1], device=device)
        self._captured: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def covers(self, num_seqs: int, max_context: int) -> bool:
        return num_seqs <= self.batch_sizes[-1] and max_context <= self.context_sizes[-1]

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (smaller graphs then reuse the largest one's memory pool), so
        no request waits on a capture."""
        started = time.monotonic()
        for context in reversed(self.context_sizes):
            for batch in reversed(self.batch_sizes):
                self._get(batch, context)
        logger.info("captured %d CUDA graphs of the decode step (batch sizes %s, contexts up to %d) in %.1f s",
                    len(self._captured), self.batch_sizes, self.context_sizes[-1], time.monotonic() - started)

    @torch.inference_mode()
    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Logits [len(token_ids), V] float32 of one decode step: each sequence adds token_ids[i] at positions[i]."""
        num_seqs = len(token_ids)
        max_context = max(positions) + 1
        batch = _bucket(self.batch_sizes, num_seqs)
        context = _bucket(self.context_sizes, max_context)
        self._fill(token_ids, positions, block_tables, batch, context)
        if not self.capture:
            return self._step(batch, context)[:num_seqs]
        captured = self._get(batch, context)
        captured.graph.replay()
        # A copy: the graphs share one memory pool, so the next replay of another bucket may overwrite this one.
        return captured.logits[:num_seqs].clone()

    def _fill(self, token_ids, positions, block_tables, batch: int, context: int) -> None:
        block_size, num_blocks = self.block_size, context // self.block_size
        rows = []
        for token, position, table in zip(token_ids, positions, block_tables):
            slot = table[position // block_size] * block_size + position % block_size
            blocks = table[:num_blocks]
            rows.append([token, position, slot, position + 1, *blocks, *[0] * (num_blocks - len(blocks))])
        padding = [0, 0, self.scratch_slot, 1] + [0] * num_blocks  # writes the scratch slot, attends to one key
        rows += [padding] * (batch - len(rows))
        host = self.host_inputs[:batch, : COLUMNS + num_blocks]
        host.copy_(torch.tensor(rows, dtype=torch.long))
        self.inputs[:batch, : COLUMNS + num_blocks].copy_(host, non_blocking=True)

    def _step(self, batch: int, context: int) -> torch.Tensor:
        """The padded decode step on the static buffers (what a graph captures)."""
        table = self.inputs[:batch]
        token_ids, positions, slots, context_lens = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
        blocks = table[:, COLUMNS : COLUMNS + context // self.block_size]
        key_positions = self.key_positions[:context]
        context_slots = blocks[:, key_positions // self.block_size] * self.block_size + key_positions % self.block_size
        attn_mask = (key_positions[None] < context_lens[:, None])[:, None, None]  # [B, 1, 1, L]
        group = AttentionGroup(None, None, context_slots, attn_mask, is_causal=False, is_decode=True)
        hidden = self.forward(token_ids, positions, self.kv_layers, AttentionMetadata(slots, [group]))
        return self.model.compute_logits(hidden)

    def _get(self, batch: int, context: int) -> _Captured:
        key = (batch, context)
        if key not in self._captured:
            self._captured[key] = self._capture(batch, context)
        return self._captured[key]

    @torch.inference_mode()
    def _capture(self, batch: int, context: int) -> _Captured:
        # Padding rows only: what the warm-up and capture runs write lands in the scratch slot.
        self._fill([], [], [], batch, context)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS workspaces, compiled-graph guards)
            for _ in range(2):
                self._step(batch, context)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(batch, context)
        return _Captured(graph, logits)
