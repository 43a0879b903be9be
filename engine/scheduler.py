"""Scheduler: which sequences run in the next step and how many tokens each; preempts when KV blocks run out.

Plain Python, no tensors. One policy for prefill and decode (as vLLM v1): every step spends a token budget,
first on running sequences (one token each when decoding, a chunk when a long prompt is still prefilling), then
on waiting ones in arrival order. Prompts longer than the budget are prefilled in chunks across steps, so a long
prompt never stalls the sequences already decoding for more than one budget's worth of work. A prompt that fits
whole beside the running sequences is never split: it waits a step instead, so its logits are the same bits alone
or under load (the runner attends each prompt alone for the same reason).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import BlockAllocator, block_hash, blocks_needed, prefix_block_hashes
from engine.request import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: which sequences run, how many new tokens each computes, and what each row yields, decided
    in add() for every runner: a sampled token, the logits of every new position (prompt logprobs), and the final
    hidden states of the new positions (embeddings)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # its new tokens reach its end, and it may still grow
    wants_prompt_logits: list[bool] = field(default_factory=list)  # echo, scoring: logits at every new position
    wants_hidden_states: list[bool] = field(default_factory=list)  # embeddings: final hidden states of new positions

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        # A sequence still prefilling a chunk of its prompt samples nothing yet, nor does a prompt-only request
        # (max_tokens 0: echo, scoring).
        is_last_chunk = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        self.samples.append(is_last_chunk and seq.has_token_budget)
        self.wants_prompt_logits.append(seq.wants_prompt_logprobs)
        self.wants_hidden_states.append(seq.wants_hidden_states(num_new_tokens))

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds one token: the steady state of serving, which the fast decode paths serve."""
        return all(n == 1 for n in self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = False,
    ):
        self.allocator = allocator
        self.enable_prefix_caching = enable_prefix_caching
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow(seq, num_new):
                continue  # seq itself was preempted; running shrank, so index i is already the next one
            batch.add(seq, num_new)
            budget -= num_new
            i += 1
        # Admitting new work right after preempting would only preempt again.
        preempted = self.num_preemptions > preemptions_before
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._sibling_is_prefilling(seq):
                break  # n > 1: the other samples wait one step and then share the prompt's cached blocks
            reused = self._reuse_cached_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            # A prompt that fits whole beside the running sequences in a coming step waits for it rather than be
            # split here, where the split point depends on what else arrived (and with it the logits' float order).
            fits_a_coming_step = budget < remaining <= self.max_num_batched_tokens - len(self.running)
            num_new = min(remaining, budget)
            needed = blocks_needed(seq.num_computed_tokens + num_new, self.block_size) - len(seq.block_table)
            if fits_a_coming_step or not self.allocator.can_allocate(needed):
                if reused:  # hand the cached blocks back rather than hold them while waiting
                    self._free_blocks(seq)
                    seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            seq.block_table += self.allocator.allocate(needed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        return batch

    def mark_computed(self, batch: ScheduledBatch) -> None:
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            if self.enable_prefix_caching:
                self._register_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence for good (finished or aborted) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Give seq blocks for num_new more tokens, preempting the latest arrivals if needed.

        Returns False when seq itself had to be preempted."""
        needed = blocks_needed(seq.num_computed_tokens + num_new, self.block_size) - len(seq.block_table)
        while not self.allocator.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_table += self.allocator.allocate(needed)
        return True

    def _sibling_is_prefilling(self, seq: Sequence) -> bool:
        if not self.enable_prefix_caching or seq.index == 0 or seq.num_computed_tokens:
            return False
        return any(
            other.request is seq.request and other.num_computed_tokens < other.num_prompt_tokens for other in self.running
        )

    def _reuse_cached_prefix(self, seq: Sequence) -> bool:
        """Point a fresh sequence at cached blocks holding its leading tokens, so they are not computed again.
        At least one token is left to compute: the step needs it to produce the next token's logits (or an embedding's
        last hidden state)."""
        if (not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table
                or seq.needs_every_prompt_position):
            return False
        for content_hash in prefix_block_hashes(seq.token_ids, self.block_size):
            block = self.allocator.take_cached(content_hash)
            if block is None:
                break
            seq.block_table.append(block)
            seq.block_hashes.append(content_hash)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        if not seq.num_output_tokens:  # after a preemption with outputs, what is recomputed is not the prompt
            seq.num_cached_tokens = seq.num_computed_tokens
        return bool(seq.block_table)

    def _register_full_blocks(self, seq: Sequence) -> None:
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            content_hash = self._hash_of_block(seq, index)
            seq.block_hashes.append(content_hash)
            self.allocator.register(seq.block_table[index], content_hash)

    def _hash_of_block(self, seq: Sequence, index: int) -> bytes:
        """Hash of the seq's block `index`, chained to the blocks before it (block_hashes holds those)."""
        parent = seq.block_hashes[index - 1] if index else b""
        return block_hash(parent, seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and put it first in line; its tokens are recomputed when it returns."""
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free_blocks(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
