"""One forward pass for a scheduled batch: build the input tensors, run the model, return the logits asked for.

ModelRunner owns every way a decode step can run (the native C++ step, the compiled step and its build, CUDA
graphs, the CPU attention kernel), built as engine/decode/decode_path.py planned them; run() alone picks the one that
serves a step.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from engine.decode import compiled
from engine.decode.compiled import CompiledDecode
from engine.decode.cuda_graphs import DecodeGraphs
from engine.kv_cache import BlockAllocator, KVCache
from engine.models.attention import AttentionGroup, AttentionMetadata
from engine.decode.native_decode import NativeDecode
from engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from engine.decode.decode_path import DecodePath

logger = logging.getLogger(__name__)


@dataclass
class StepLogits:
    sample_logits: torch.Tensor  # [number of sampling sequences, V] float32, in batch order
    prompt_logits: dict[int, torch.Tensor]  # batch index -> [chunk length, V]: logits at every new position
    # batch index -> [chunk length, H]: final hidden states (after the final norm) of every new position (embeddings)
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class Runner(Protocol):
    """What the engine asks of a runner: ModelRunner, or RecomputeRunner on the generic transformers path."""

    def run(self, batch: ScheduledBatch) -> StepLogits: ...

    @property
    def decode_step(self) -> str:
        """`native`, `compiled`, `compiling` (the eager step serves until the compiled one is ready) or `eager`."""

    @property
    def decode_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs."""

    # Decode steps run so far, by what ran them ("graphs", "native", "compiled", "eager"): what /metrics shows, so
    # a client can tell which step served its request (e.g. that the first request after ready ran full speed).
    decode_steps: Counter

    @property
    def num_reserved_blocks(self) -> int:
        """KV blocks the runner holds for itself: the compiled step's warm-up, until the engine thread frees them."""

    @property
    def has_reserved_blocks_to_free(self) -> bool:
        """Whether free_reserved_blocks() has blocks to give back now."""

    def free_reserved_blocks(self) -> None:
        """Engine thread: give the warm-up's blocks back to the allocator once the warm-up has ended."""

    def wait_for_compiled_decode(self, timeout_s: float | None = None) -> bool:
        """Block until a compile of the decode step has ended (at once when none runs); True when it serves."""

    def stop_compiling(self) -> None:
        """End a compile of the decode step under way (interrupted: compiled.py, CompiledDecode.cancel) and wait for
        its thread."""


class ModelRunner:
    """Runs the native model against the paged KV cache on the decode path it is built with. Called from one
    thread; the compiled step's build may run on another, in KV blocks reserved for it."""

    def __init__(self, model, kv_cache: KVCache, device: torch.device, path: DecodePath, allocator: BlockAllocator,
                 max_num_seqs: int, max_model_len: int, on_compiled: Callable[[], None] = lambda: None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_layers = kv_cache.layers()
        self.block_size = kv_cache.block_size
        self.device = device
        self.path = path
        self.max_num_seqs = max_num_seqs
        self.native_step = NativeDecode(model, kv_cache, path.kernels) if path.step == "native" else None
        self.compiled: CompiledDecode | None = None
        if path.step == "compiled":
            self.compiled = CompiledDecode(model, self.warm_up, allocator, path.is_compiled_in_background, on_compiled)
        self.graphs = self._build_graphs(max_model_len) if path.graphs else None
        self.decode_steps: Counter = Counter()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepLogits:
        """One step, on the paths this function alone picks. A decode step replays a CUDA graph where one covers it
        and no prompt logits nor hidden states are wanted (a graph keeps only the logits). Otherwise every row that
        computes one token (decoding sequences, and every prompt token where the path prefills as decode rows:
        decode_path.py) runs on the decode step: the native step, else the compiled step once built, else the eager
        model; its attention on CPU is the path's kernel (see _group). Prompt chunks otherwise run the eager model, in
        a forward of their own. Every forward returns the final-normed hidden states, so an embedding's rows are read
        alike on each."""
        wants_more_than_tokens = any(batch.wants_prompt_logits) or any(batch.wants_hidden_states)
        if batch.is_decode and self.graphs is not None and not wants_more_than_tokens:
            positions = [seq.num_computed_tokens for seq in batch.seqs]
            if self.graphs.covers(len(positions), max(positions) + 1):
                token_ids = [seq.token_ids[p] for seq, p in zip(batch.seqs, positions)]
                logits = self.graphs.run(token_ids, positions, [seq.block_table for seq in batch.seqs])
                self.decode_steps["graphs"] += 1
                if not all(batch.samples):
                    logits = logits[[i for i, s in enumerate(batch.samples) if s]]
                return StepLogits(logits, {})
        as_rows = [n == 1 or self.path.prefills_as_decode_rows for n in batch.num_new_tokens]
        # A rowwise forward counts as a decode step where it decodes a sequence, not where it only prefills.
        decodes = any(n == 1 for n in batch.num_new_tokens)
        hidden_of: list[torch.Tensor | None] = [None] * len(batch)
        for rowwise in (True, False):
            members = [i for i, r in enumerate(as_rows) if r == rowwise]
            if not members:
                continue
            spans = [(batch.seqs[i], batch.seqs[i].num_computed_tokens, batch.num_new_tokens[i]) for i in members]
            if rowwise:  # each token its own row, attending to the context before it: what decoding it computes
                spans = [(seq, start + j, 1) for seq, start, n in spans for j in range(n)]
            input_ids, positions, meta = self._prepare(spans)
            forward = self._decode_forward(input_ids, positions, meta, decodes) if rowwise else self.model.forward
            hidden = forward(input_ids, positions, self.kv_layers, meta)
            for i, part in zip(members, hidden.split([batch.num_new_tokens[i] for i in members])):
                hidden_of[i] = part
        return _select_logits(self.model, hidden_of, batch)

    def _decode_forward(self, input_ids, positions, meta, counts: bool):
        """The forward that serves decode rows now, counted by name in decode_steps if `counts`."""
        compiled_forward = None if self.compiled is None else self.compiled.forward  # once: the build's thread sets it
        name, forward = "eager", self.model.forward
        if self.native_step is not None:
            name, forward = "native", self.native_step
        elif compiled_forward is not None:
            compiled.mark_dynamic(input_ids, positions, meta)
            name, forward = "compiled", compiled_forward
        if counts:
            self.decode_steps[name] += 1
        return forward

    @property
    def decode_step(self) -> str:
        if self.native_step is not None:
            return "native"
        return "eager" if self.compiled is None else self.compiled.state

    @property
    def decode_graphs(self) -> bool:
        return self.graphs is not None

    @property
    def num_reserved_blocks(self) -> int:
        return 0 if self.compiled is None else self.compiled.num_reserved_blocks

    @property
    def has_reserved_blocks_to_free(self) -> bool:
        return self.compiled is not None and self.compiled.has_blocks_to_free

    def free_reserved_blocks(self) -> None:
        if self.compiled is not None:
            self.compiled.free_blocks()

    def wait_for_compiled_decode(self, timeout_s: float | None = None) -> bool:
        return self.compiled is not None and self.compiled.wait(timeout_s)

    def stop_compiling(self) -> None:
        if self.compiled is not None:
            self.compiled.cancel()

    @torch.inference_mode()
    def warm_up(self, compiled_forward, block_table: list[int], cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Compile `compiled_forward` for every batch-size regime by decoding fake sequences whose keys and values
        land in block_table's blocks, which the caller has reserved: so it may run on another thread while this
        runner serves requests from the rest of the cache. False when `cancelled` said to stop first."""
        started = time.monotonic()
        sizes = compiled.warmup_batch_sizes(self.max_num_seqs)
        context_len = compiled.warmup_context_len(sizes, self.block_size, len(block_table))
        for size in sizes:
            if cancelled():
                logger.info("compiling the decode step stopped: the engine stopped")
                return False
            seqs = [compiled.WarmupSequence([0] * context_len, context_len - 1, block_table) for _ in range(size)]
            input_ids, positions, meta = self._prepare([(seq, seq.num_computed_tokens, 1) for seq in seqs])
            compiled.mark_dynamic(input_ids, positions, meta)
            compiled_forward(input_ids, positions, self.kv_layers, meta)
        logger.info("compiled the decode step for batch sizes %s in %.1f s", sizes, time.monotonic() - started)
        return True

    def _build_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        """Decode steps padded to (batch, context) buckets and captured in CUDA graphs, of the compiled step when
        there is one; on CPU the same padded steps run uncaptured (how the tests check the padding)."""
        forward = self.model.forward
        if self.compiled is not None and self.compiled.forward is not None:
            forward = _marked_dynamic(self.compiled.forward)
        capture = self.device.type == "cuda"
        try:
            graphs = DecodeGraphs(forward, self.model, self.kv_cache, self.max_num_seqs, max_model_len, capture)
            if capture:
                graphs.capture_all()
            return graphs
        except Exception as exc:  # e.g. a layer that syncs with the host (bnb-int8's outlier split): eager works
            logger.warning("capturing the decode step in CUDA graphs failed, running eager: %s: %s",
                           type(exc).__name__, exc)
            if capture:
                torch.cuda.synchronize()
            return None

    def _prepare(self, spans: list[tuple]):
        """Input tensors for `spans`: (sequence, first new position, number of new tokens) each, in row order."""
        block_size, device = self.block_size, self.device
        seqs = [seq for seq, _, _ in spans]
        starts = [start for _, start, _ in spans]
        lengths = [n for _, _, n in spans]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []  # where each sequence's tokens start in T
        for seq, start, length in spans:
            offsets.append(len(token_ids))
            token_ids += seq.token_ids[start : start + length]
            positions += range(start, start + length)
            table = seq.block_table
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + length)]

        # Decoding rows attend together (the decode kernels compute each row alone). Each prompt attends alone, on
        # a view of exactly its own length: padded into one SDPA call with its neighbours, its rows came out in
        # another float order, which the int8 activations magnified to ~0.5 nats in a score. Alone, a prompt's
        # logits are the same bits whatever arrives with it.
        decoding = [i for i, n in enumerate(lengths) if n == 1]
        parts = ([decoding] if decoding else []) + [[i] for i, n in enumerate(lengths) if n > 1]
        with_rows = len(parts) > 1
        groups = [self._group(seqs, starts, lengths, offsets, part, with_rows) for part in parts]

        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), groups)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=device), meta

    def _group(self, seqs, starts, lengths, offsets, members: list[int], with_rows: bool) -> AttentionGroup:
        block_size, device = self.block_size, self.device
        seqs = [seqs[i] for i in members]
        starts = [starts[i] for i in members]
        lengths = [lengths[i] for i in members]
        num_seqs, max_query = len(seqs), max(lengths)
        context_lens = torch.tensor([s + n for s, n in zip(starts, lengths)], device=device)
        max_context = int(context_lens.max())
        max_blocks = -(-max_context // block_size)
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long, device=device)
        for i, seq in enumerate(seqs):
            row = seq.block_table[:max_blocks]
            tables[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        key_pos = torch.arange(max_context, device=device)
        context_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [B, L]

        query_j = torch.arange(max_query, device=device)
        is_decode = max_query == 1
        query_index = output_index = None  # a decode group reads its queries straight from its rows
        if not is_decode:
            lengths_t = torch.tensor(lengths, device=device)
            offsets_t = torch.tensor([offsets[i] for i in members], device=device)
            query_index = torch.where(query_j[None] < lengths_t[:, None], offsets_t[:, None] + query_j[None], 0)
            output_index = torch.tensor([b * max_query + j for b, n in enumerate(lengths) for j in range(n)], device=device)
        rows = None
        if with_rows:
            rows = torch.tensor([offsets[i] + j for i, n in zip(members, lengths) for j in range(n)], device=device)

        kernel = self.path.attention_kernel if is_decode else None  # reads context_lens and needs no mask
        is_causal = True
        if all(start == 0 for start in starts):
            attn_mask = None  # a fresh prefill of every sequence: plain causal attention over its own tokens
        elif is_decode and (num_seqs == 1 or kernel is not None):
            attn_mask, is_causal = None, False  # one query per sequence that sees its whole context
        else:
            starts_t = torch.tensor(starts, device=device)
            query_pos = starts_t[:, None] + query_j[None]  # [B, Q]
            attn_mask = (key_pos[None, None] <= query_pos[:, :, None]) & (key_pos[None, None] < context_lens[:, None, None])
            attn_mask = attn_mask[:, None]  # [B, 1, Q, L]
        return AttentionGroup(query_index, output_index, context_slots, attn_mask, is_causal, is_decode, rows,
                              None if kernel is None else context_lens, kernel)


def _marked_dynamic(compiled_forward):
    """The compiled forward, told that batch and context sizes vary, so the buckets share one traced graph."""

    def forward(input_ids, positions, kv_layers, meta):
        compiled.mark_dynamic(input_ids, positions, meta)
        return compiled_forward(input_ids, positions, kv_layers, meta)

    return forward


def _select_logits(model, hidden_of: list[torch.Tensor], batch: ScheduledBatch) -> StepLogits:
    """From each sequence's new rows (`hidden_of`), what someone reads: a sampler's last row's logits, every row's
    logits where prompt logprobs were asked for (echo, scoring), the rows themselves for an embedding."""
    last_rows = [hidden[-1] for hidden, s in zip(hidden_of, batch.samples) if s]
    sample_logits = model.compute_logits(torch.stack(last_rows)) if last_rows else hidden_of[0].new_empty(0, 0)
    prompt_logits = {i: model.compute_logits(hidden_of[i]) for i, wanted in enumerate(batch.wants_prompt_logits)
                     if wanted}
    hidden_states = {i: hidden_of[i] for i, wanted in enumerate(batch.wants_hidden_states) if wanted}
    return StepLogits(sample_logits, prompt_logits, hidden_states)
