"""Continuous batching, seeds, abort, KV exhaustion, stops, n > 1 and validation, through the real engine."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import (
    FINISH_ABORT,
    ContextLengthExceededError,
    DrainingError,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
)
from engine.params import MAX_LOGIT_BIAS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, 2000, (n,), generator=generator).tolist() for n in lengths]


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_staggered_arrivals_give_the_same_tokens_as_alone(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    prompts = _prompts(6)
    alone = [engine.generate([p], GREEDY)[0].choices[0].token_ids for p in prompts]
    streams = []
    for prompt in prompts:  # each joins while the earlier ones are mid-decode
        streams.append(engine.submit(prompt, GREEDY))
        time.sleep(0.01)
    together = [[t for out in stream for t in out.token_ids] for stream in streams]
    assert together == alone


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    target = _prompts(1, seed=7)[0]
    alone = engine.generate([target], params)[0].choices[0].token_ids
    # Among unseeded random requests, which draw in the same steps from generators of their own.
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    streams = [engine.submit(p, unseeded) for p in _prompts(5)]
    streams.insert(2, engine.submit(target, params))
    crowd = [list(stream) for stream in streams]
    assert [t for out in crowd[2] for t in out.token_ids] == alone
    for outs in crowd:  # and the crowd is served as it asked: 16 tokens each, one finish_reason, at the end
        assert sum(len(out.token_ids) for out in outs) == 16
        assert [out.finish_reason for out in outs if out.finish_reason] == ["length"] == [outs[-1].finish_reason]
    # Among requests with the same settings and seed.
    in_crowd = engine.generate([*_prompts(3, seed=3), target], params)[-1]
    assert in_crowd.choices[0].token_ids == alone
    other_seed = engine.generate([target], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed[0].choices[0].token_ids != alone  # the seed matters


def test_abort_frees_blocks_and_ends_the_stream(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    stream = engine.submit(_prompts(1)[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    first = next(stream)
    assert first.token_ids
    engine.abort(stream.request_id)
    rest = list(stream)
    assert all(out.finish_reason is None for out in rest)
    _wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_kv_blocks_used == 0)
    assert sum(len(out.token_ids) for out in [first, *rest]) < 400


def test_kv_exhaustion_preempts_and_every_request_still_finishes_correctly(tiny_engine_factory):
    # 12 blocks of 4 tokens hold 48 tokens; 6 requests of up to ~60 tokens each cannot all fit at once.
    engine, _ = tiny_engine_factory(num_kv_blocks=16, block_size=4, max_model_len=64)
    prompts = [p[:20] for p in _prompts(6, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = [engine.generate([p], params)[0].choices[0].token_ids for p in prompts]
    together = engine.generate(prompts, params)
    assert [c.choices[0].token_ids for c in together] == alone
    assert all(len(c.choices[0].token_ids) == 30 for c in together)
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_kv_blocks_used == 0


def test_long_prompt_is_prefilled_in_chunks_with_the_same_result(tiny_engine_factory):
    engine_chunked, _ = tiny_engine_factory(max_num_batched_tokens=16)
    engine_whole, _ = tiny_engine_factory(max_num_batched_tokens=4096)
    prompt = _prompts(1, seed=11)[0] * 4  # > 16 tokens: several chunks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    chunked = engine_chunked.generate([prompt], params)[0]
    whole = engine_whole.generate([prompt], params)[0]
    assert chunked.choices[0].token_ids == whole.choices[0].token_ids
    assert len(chunked.prompt_logprobs) == len(prompt)
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_default_step_budget_is_small_on_cpu_and_fits_every_running_sequence(tiny_engine_factory):
    from engine.config import batched_tokens_for

    engine, _ = tiny_engine_factory()  # CPU, max_num_seqs 64
    assert engine.max_num_batched_tokens == 256
    assert batched_tokens_for("cuda", 64) == 2048
    assert batched_tokens_for("cpu", 300) == 300  # a decode step always has room for every sequence


def test_n_samples_have_their_own_index_and_text(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    [completion] = engine.generate(_prompts(1), SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True))
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in completion.choices)
    assert len({tuple(c.token_ids) for c in completion.choices}) > 1


def test_min_tokens_and_ignore_eos(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    prompt = _prompts(1)[0]
    # Bias EOS (id 2) up so that it would always be chosen, then check what the knobs do with it.
    eos_forced = dict(temperature=0, max_tokens=10, logit_bias={2: 100.0})
    [plain] = engine.generate([prompt], SamplingParams(**eos_forced))
    assert plain.choices[0].token_ids == [2] and plain.choices[0].finish_reason == "stop"
    [held] = engine.generate([prompt], SamplingParams(**eos_forced, min_tokens=4))
    assert len(held.choices[0].token_ids) == 5 and held.choices[0].token_ids[-1] == 2
    [ignored] = engine.generate([prompt], SamplingParams(**eos_forced, ignore_eos=True))
    assert len(ignored.choices[0].token_ids) == 10 and ignored.choices[0].finish_reason == "length"


def test_stop_token_ids_end_with_stop_reason(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    prompt = _prompts(1)[0]
    [reference] = engine.generate([prompt], GREEDY)
    third = reference.choices[0].token_ids[2]
    [stopped] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[third]))
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == third
    assert choice.token_ids == reference.choices[0].token_ids[: reference.choices[0].token_ids.index(third) + 1]


@pytest.mark.slow
def test_stop_string_spanning_tokens_is_cut_from_the_text(default_engine, default_tokenizer):
    prompt = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = default_tokenizer.encode(prompt, add_special_tokens=False)
    [full] = default_engine.generate([ids], SamplingParams(temperature=0, max_tokens=20))
    text = full.choices[0].text
    assert "Paris" in text
    stop = "of Fra"  # spans "of", " France" tokens
    [cut] = default_engine.generate([ids], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop


@pytest.mark.slow
def test_streamed_deltas_are_utf8_safe_and_add_up(default_engine, default_tokenizer):
    ids = default_tokenizer.encode("Emoji party: 🎉🚀🌍 and 中文字符 and", add_special_tokens=False)
    params = SamplingParams(temperature=0.8, max_tokens=48, seed=3, ignore_eos=True)
    stream = default_engine.submit(ids, params)
    deltas, tokens = [], []
    for out in stream:
        deltas.append(out.text)
        tokens += out.token_ids
    decoded = default_tokenizer.decode(tokens, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in decoded.removesuffix("\ufffd")
    # max_tokens may end the reply inside a character (with this seed it cuts an emoji): the deltas leave it out,
    # where a plain decode shows U+FFFD.
    assert "".join(deltas) == decoded.removesuffix("\ufffd")


def test_max_tokens_zero_returns_prompt_logprobs_only(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    prompt = _prompts(1)[0]
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert completion.choices[0].token_ids == [] and completion.choices[0].finish_reason == "length"
    assert completion.prompt_logprobs[0] is None
    assert [e.token_id for e in completion.prompt_logprobs[1:]] == prompt[1:]
    assert all(e.logprob <= 0 and len(e.top) == 1 for e in completion.prompt_logprobs[1:])


def test_score_ranks_the_models_own_greedy_continuation_first(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    context = _prompts(1)[0]
    [greedy] = engine.generate([context], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    good = greedy.choices[0].token_ids
    bad = [(t + 17) % 1000 + 3 for t in good]
    scores = asyncio.run(engine.score(context, [good, bad]))
    assert scores[0].is_greedy and not scores[1].is_greedy
    assert scores[0].logprob > scores[1].logprob
    assert scores[0].top_token_ids == good


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompts_logprobs_are_the_same_bits_whatever_arrives_with_it(tiny_engine_factory, dtype):
    # lm-evaluation-harness scores must not depend on what else the server is doing: the prompt is scored alone,
    # then together with prompts of other lengths (shorter, longer, long enough to take most of the step) and
    # beside decoding sequences, and every logprob must be equal, not merely close.
    engine, _ = tiny_engine_factory(dtype=dtype, max_num_batched_tokens=96)
    target = _prompts(1, seed=11)[0]
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)

    def logprobs(completion):
        return [(e.token_id, e.logprob) for e in completion.prompt_logprobs[1:]]

    alone = logprobs(engine.generate([target], scored)[0])
    for others in ([5], [len(target) + 30], [90], [3, 20, 7]):
        neighbours = [list(range(100, 100 + n)) for n in others]
        completions = engine.generate([*neighbours, target], scored)
        assert logprobs(completions[-1]) == alone, f"beside prompts of {others} tokens"
    long_decode = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    decoding = [engine.submit(p, long_decode) for p in _prompts(3, seed=5)]
    _wait_until(lambda: engine.stats().num_running == 3)
    assert logprobs(engine.generate([target], scored)[0]) == alone, "beside decoding sequences"
    for stream in decoding:
        engine.abort(stream.request_id)


def test_a_bf16_kv_cache_on_a_float32_model_holds_twice_the_tokens_and_answers_alike(tiny_engine_factory):
    """--kv-cache-dtype bfloat16 on whatever path this machine takes (the kernels' or, with TERN_CPU_KERNELS=off,
    plain PyTorch): twice the blocks in the same memory; a sequence's tokens are the same alone or batched; and its
    logprobs stay near the float32 cache's (each key and value rounded once to bf16 as stored)."""
    prompts = _prompts(4, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs, blocks = {}, {}
    for kv_cache_dtype in ("auto", "bfloat16"):
        engine, _ = tiny_engine_factory(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=1 << 20)
        assert engine.kv_cache.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
        assert engine.info().kv_cache_dtype == str(engine.kv_cache.dtype).removeprefix("torch.")  # what /v1/models says
        blocks[kv_cache_dtype] = engine.kv_cache.num_blocks
        batched = [c.choices[0] for c in engine.generate(prompts, greedy)]
        alone = [engine.generate([p], greedy)[0].choices[0] for p in prompts]
        assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
        runs[kv_cache_dtype] = batched
        engine.stop()
    assert blocks["bfloat16"] == 2 * blocks["auto"]
    for wide, narrow in zip(runs["auto"], runs["bfloat16"]):
        assert abs(wide.logprobs[0].logprob - narrow.logprobs[0].logprob) < 0.05


def test_bad_requests_raise_before_anything_is_queued(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_model_len=64)
    with pytest.raises(ContextLengthExceededError) as info:
        engine.submit(list(range(3, 60)), SamplingParams(max_tokens=10))
    assert "maximum context length is 64" in info.value.message and "57 in the prompt" in info.value.message
    assert info.value.param == "max_tokens"  # the prompt fits: asking for fewer tokens would do
    with pytest.raises(ContextLengthExceededError) as info:
        engine.submit(list(range(3, 73)), SamplingParams(max_tokens=1))
    assert info.value.param == "prompt" and "70 in the prompt" in info.value.message
    with pytest.raises(InvalidRequestError):
        engine.submit([5, 10**9], SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.submit([], SamplingParams())
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError):
        SamplingParams(logprobs=21)
    [ok] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # the engine still serves
    assert len(ok.choices[0].token_ids) == 2


@pytest.mark.parametrize(
    ("param", "at_limit", "over"),
    [
        ("stop", tuple(f"s{i}" for i in range(MAX_STOP_STRINGS)), tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))),
        ("stop", ("x" * MAX_STOP_LENGTH,), ("x" * (MAX_STOP_LENGTH + 1),)),
        ("stop_token_ids", tuple(range(MAX_STOP_TOKEN_IDS)), tuple(range(MAX_STOP_TOKEN_IDS + 1))),
        ("logit_bias", dict.fromkeys(range(MAX_LOGIT_BIAS), 1.0), dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
    ],
)
def test_lists_that_every_step_walks_are_bounded(param, at_limit, over):
    SamplingParams(**{param: at_limit})
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{param: over})
    assert info.value.param == param and "at most" in info.value.message


def test_a_draining_engine_finishes_what_runs_and_refuses_the_rest(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    prompt = _prompts(1)[0]
    [alone] = engine.generate([prompt], GREEDY)
    stream = engine.submit(prompt, GREEDY)
    engine.drain()
    assert engine.is_draining and engine.has_requests
    with pytest.raises(DrainingError):
        engine.submit(prompt, GREEDY)
    outputs = list(stream)  # the request admitted before the drain runs to its own end
    assert [t for out in outputs for t in out.token_ids] == alone.choices[0].token_ids
    assert outputs[-1].finish_reason == "length"
    _wait_until(lambda: not engine.has_requests)


def test_abort_all_ends_every_sample_with_abort_and_frees_the_cache(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, n=2)
    running = engine.submit(_prompts(1)[0], params)
    next(running)  # decoding
    waiting = engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    engine.drain()
    engine.abort_all()
    for stream, num_samples in ((running, 2), (waiting, 1)):
        finishes = [out.finish_reason for out in stream if out.finish_reason is not None]
        assert finishes == [FINISH_ABORT] * num_samples  # every sample learns how it ended, once
    _wait_until(lambda: not engine.has_requests and engine.stats().num_kv_blocks_used == 0)


def test_a_full_queue_refuses_instead_of_growing(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_waiting=2, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    streams = [engine.submit([5, 6, 7], params)]
    _wait_until(lambda: engine.stats().num_running == 1)
    streams += [engine.submit([5, 6, 7], params) for _ in range(2)]
    with pytest.raises(QueueFullError):
        engine.submit([5, 6, 7], params)
    for stream in streams:
        engine.abort(stream.request_id)
    for stream in streams:
        list(stream)


def test_async_consumers_on_an_event_loop(tiny_engine_factory):
    engine, _ = tiny_engine_factory()

    async def main():
        completions = await asyncio.gather(*(engine.complete(p, GREEDY) for p in _prompts(4)))
        return [len(c.choices[0].token_ids) for c in completions]

    assert asyncio.run(main()) == [16] * 4


def test_cancelled_async_consumer_aborts_its_request(tiny_engine_factory):
    engine, _ = tiny_engine_factory()

    async def main():
        task = asyncio.create_task(engine.complete([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_kv_blocks_used == 0)


def test_a_consumer_that_closes_its_stream_aborts_the_request(tiny_engine_factory):
    """Nobody calls engine.abort: leaving the stream (contextlib.aclosing, closing) ends the request early and
    frees its blocks, while the consumer's event loop is still alive to receive the rest."""
    engine, _ = tiny_engine_factory()
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    def ended_early(tokens_before: int) -> bool:
        _wait_until(lambda: not engine.has_requests and engine.stats().num_kv_blocks_used == 0)
        return engine.stats().num_generated_tokens - tokens_before < 400

    blocking = engine.submit([8, 9, 10], long)
    with contextlib.closing(blocking):
        assert next(blocking).token_ids
    assert ended_early(0)

    async def read_one_then_leave() -> bool:
        tokens_before = engine.stats().num_generated_tokens
        stream = engine.submit([5, 6, 7], long)
        async with contextlib.aclosing(stream):
            async for out in stream:
                assert out.token_ids
                break
        deadline = time.monotonic() + 30
        while engine.has_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # the loop stays alive: outputs could still be delivered
        return ended_early(tokens_before)

    assert asyncio.run(read_one_then_leave())


def test_many_threads_submitting_at_once(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    prompts = _prompts(8, seed=2)
    expected = [c.choices[0].token_ids for c in engine.generate(prompts, GREEDY)]
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = engine.generate([prompts[i]], GREEDY)[0].choices[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(8)] == expected


def test_stats_count_every_token_a_consumer_has_already_received(tiny_engine_factory):
    # /metrics and the UI read stats() right after a reply: its last token must be counted by then.
    engine, _ = tiny_engine_factory()
    received = 0
    before = engine.stats().num_generated_tokens
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the GIL changes hands often, as on a loaded machine: a late count shows
    try:
        for prompt in _prompts(40, seed=5):
            [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            received += len(out.choices[0].token_ids)
            assert engine.stats().num_generated_tokens - before == received
    finally:
        sys.setswitchinterval(interval)


def test_a_repeated_prompt_prefix_is_served_from_the_cache_with_the_same_result(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    uncached, _ = tiny_engine_factory(enable_prefix_caching=False)
    system = _prompts(1, seed=21)[0] * 3  # a long shared prefix (several 16-token blocks)
    first_prompt, second_prompt = system + [11, 12, 13], system + [14, 15]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    [first] = engine.generate([first_prompt], params)
    hits_before = engine.stats().num_prefix_cache_hits
    [second] = engine.generate([second_prompt], params)
    assert engine.stats().num_prefix_cache_hits - hits_before == len(system) // 16
    # What usage's cached_tokens reports: the prompt tokens whose blocks came from the cache, none the first time.
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, len(system) // 16 * 16)
    [reference] = uncached.generate([second_prompt], params)
    assert second.choices[0].token_ids == reference.choices[0].token_ids
    for ours, theirs in zip(second.choices[0].logprobs, reference.choices[0].logprobs):
        assert abs(ours.logprob - theirs.logprob) < 1e-4
    assert uncached.stats().num_prefix_cache_hits == 0


def test_n_samples_share_the_prompts_cached_blocks(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    prompt = _prompts(1, seed=22)[0] * 3  # several full 16-token blocks
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=9, ignore_eos=True)
    [completion] = engine.generate([prompt], params)
    assert engine.stats().num_prefix_cache_hits == 2 * ((len(prompt) - 1) // 16)  # samples 1 and 2 reuse them
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in completion.choices)
    [again] = engine.generate([prompt], params)  # same seed, now with every block cached: same samples
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in completion.choices]


def test_a_script_that_ends_without_stopping_its_engine_exits_cleanly():
    """A script that ends while its Engine is still decoding, without stop(): the engine is stopped at exit, so
    Python does not halt its thread inside a step (it used to die by std::terminate, exit status 134)."""
    code = ("from engine import Engine, EngineConfig, SamplingParams\n"
            "engine = Engine(EngineConfig.serving()).start()\n"
            "[completion] = engine.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=8))\n"
            "print(completion.choices[0].text, flush=True)\n"
            "stream = engine.submit('Once upon a time', SamplingParams(max_tokens=500, ignore_eos=True))\n"
            "next(iter(stream))\n")  # decoding when the script ends
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Paris" in done.stdout
