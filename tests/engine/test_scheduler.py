"""Scheduler and block allocator on their own: budgets, chunking, admission order and preemption."""
from __future__ import annotations

import pytest

from engine.kv_cache import BlockAllocator
from engine.params import SamplingParams
from engine.request import Request, Sequence, SequenceStatus
from engine.scheduler import Scheduler


def _seq(seq_id: int, prompt_len: int, params: SamplingParams | None = None) -> Sequence:
    request = Request(f"r{seq_id}", list(range(3, 3 + prompt_len)), params or SamplingParams())
    return Sequence(seq_id, request, 0, generator=None, output_text=None)


def _step(scheduler: Scheduler, new_token: int = 7):
    """One step as the engine does it: schedule, mark computed, append a token to whoever finished its prompt."""
    batch = scheduler.schedule()
    scheduler.mark_computed(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(new_token)
    return batch


def test_allocator_hands_out_and_takes_back_blocks():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(3)
    assert len(set(blocks)) == 3 and allocator.num_free == 1
    assert not allocator.can_allocate(2)
    with pytest.raises(MemoryError):
        allocator.allocate(2)
    allocator.free(blocks)
    assert allocator.num_free == 4
    with pytest.raises(AssertionError):
        allocator.free(blocks[:1])  # double free is our bug, caught loudly


def test_prefill_then_decode_within_the_token_budget():
    scheduler = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=8, max_num_batched_tokens=20)
    a, b, c = _seq(0, 8), _seq(1, 8), _seq(2, 8)
    for s in (a, b, c):
        scheduler.add(s)
    batch = _step(scheduler)
    # 20 tokens: a and b whole; c would fit only as a chunk of 4, and fits whole beside a and b next step.
    assert batch.seqs == [a, b] and batch.num_new_tokens == [8, 8]
    batch = _step(scheduler)
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [1, 1, 8]  # a and b decode while c prefills
    batch = _step(scheduler)
    assert batch.num_new_tokens == [1, 1, 1]


def test_max_num_seqs_caps_the_running_set():
    scheduler = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(i, 4) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    batch = _step(scheduler)
    assert batch.seqs == seqs[:2] and list(scheduler.waiting) == [seqs[2]]


def test_out_of_blocks_preempts_the_latest_arrival_and_recomputes_it_later():
    scheduler = Scheduler(BlockAllocator(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=100)
    first, second = _seq(0, 8), _seq(1, 7)
    scheduler.add(first)
    scheduler.add(second)
    _step(scheduler)  # 2 blocks each; all 4 used
    assert scheduler.allocator.num_free == 0
    batch = _step(scheduler)  # first needs a 3rd block: second is preempted
    assert batch.seqs == [first]
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0 and second.block_table == []
    assert scheduler.num_preemptions == 1
    scheduler.finish(first)
    tokens_before = second.num_tokens  # 7 prompt tokens + 1 generated before preemption
    batch = _step(scheduler)
    assert batch.seqs == [second] and batch.num_new_tokens == [tokens_before] == [8]  # all recomputed


def test_finish_frees_blocks_at_once():
    scheduler = Scheduler(BlockAllocator(10), block_size=4, max_num_seqs=8, max_num_batched_tokens=100)
    seq = _seq(0, 9)
    scheduler.add(seq)
    _step(scheduler)
    assert scheduler.allocator.num_used == 3
    scheduler.finish(seq)
    assert scheduler.allocator.num_used == 0 and not scheduler.has_work


def test_prefix_cache_reuses_full_blocks_of_a_shared_prompt():
    allocator = BlockAllocator(16)
    scheduler = Scheduler(allocator, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = _seq(0, 10)  # blocks [0-3] [4-7] full, [8-9] partial
    scheduler.add(first)
    _step(scheduler)
    first_blocks = list(first.block_table)
    scheduler.finish(first)  # its blocks go back to the free list but stay findable

    again = _seq(1, 10)  # the same tokens
    scheduler.add(again)
    batch = scheduler.schedule()
    assert again.block_table[:2] == first_blocks[:2]
    assert batch.num_new_tokens == [2]  # two full blocks reused; only the tail is computed
    assert allocator.num_cached_hits == 2


def test_prefix_cache_always_leaves_a_token_to_compute_and_stops_at_the_first_difference():
    allocator = BlockAllocator(16)
    scheduler = Scheduler(allocator, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = _seq(0, 8)
    scheduler.add(first)
    _step(scheduler)
    scheduler.finish(first)

    exact = _seq(1, 8)  # fully cached: the last block is recomputed so the step has logits to sample from
    scheduler.add(exact)
    assert scheduler.schedule().num_new_tokens == [4]
    scheduler.finish(exact)

    differs = _seq(2, 8)
    differs.token_ids[1] = 999  # the first block differs, so nothing after it can be reused either
    scheduler.add(differs)
    assert scheduler.schedule().num_new_tokens == [8]


def test_cached_blocks_are_reused_for_new_content_when_the_pool_runs_out():
    allocator = BlockAllocator(3)
    scheduler = Scheduler(allocator, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = _seq(0, 8)
    scheduler.add(first)
    _step(scheduler)
    scheduler.finish(first)
    other = Sequence(1, Request("r1", list(range(100, 111)), SamplingParams()), 0, generator=None, output_text=None)
    scheduler.add(other)  # needs all 3 blocks: the cached ones are evicted, not leaked
    assert scheduler.schedule().num_new_tokens == [11]
    assert allocator.num_free == 0


def test_the_batch_says_which_rows_sample_and_which_want_prompt_logits():
    scheduler = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=8, max_num_batched_tokens=12)
    # The scoring prompt (13) could never fit beside the chat's decoding token (12 - 1), so it is split at once.
    chat, scoring = _seq(0, 10), _seq(1, 13, SamplingParams(max_tokens=0, prompt_logprobs=1))
    chat.max_tokens = 5  # the engine resolves it at admission; scoring's stays 0
    scheduler.add(chat)
    scheduler.add(scoring)
    first = _step(scheduler)  # the chat's whole prompt and a chunk of the scoring prompt
    assert first.num_new_tokens == [10, 2]
    assert first.samples == [True, False] and first.wants_prompt_logits == [False, True]
    assert not first.is_decode
    second = scheduler.schedule()  # the chat decodes; the scoring prompt's last chunk samples nothing: max_tokens 0
    assert second.num_new_tokens == [1, 11]
    assert second.samples == [True, False] and second.wants_prompt_logits == [False, True]


def test_a_prompt_that_fits_a_coming_step_waits_for_it_rather_than_being_split():
    # A split point that depends on what else arrived changes the prompt's logits (their float order): a prompt
    # that fits whole beside the running sequences waits one step instead; a longer one is split at once.
    scheduler = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=8, max_num_batched_tokens=20)
    a, b, c = _seq(0, 14), _seq(1, 10), _seq(2, 3)
    for s in (a, b, c):
        scheduler.add(s)
    batch = _step(scheduler)
    assert batch.seqs == [a] and batch.num_new_tokens == [14]  # b (10) does not fit the 6 left: it and c wait
    batch = _step(scheduler)
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [1, 10, 3]


def test_a_prompt_too_long_for_any_step_beside_the_running_ones_is_still_split():
    scheduler = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=8, max_num_batched_tokens=20)
    a, b = _seq(0, 6), _seq(1, 18)
    for s in (a, b):
        scheduler.add(s)
    batch = _step(scheduler)
    # b (18) could never fit beside a's decoding token (20 - 1 = 19 would, so make it wait one step first).
    assert batch.seqs == [a] and batch.num_new_tokens == [6]
    batch = _step(scheduler)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 18]
    long = _seq(2, 45)
    scheduler.add(long)
    batch = _step(scheduler)  # 45 tokens never fit: split right away into the budget's 18 left
    assert batch.seqs == [a, b, long] and batch.num_new_tokens == [1, 1, 18]
