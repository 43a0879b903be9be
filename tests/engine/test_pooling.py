"""Embeddings through the real engine: each vector is the plain forward pass's pooled, normalised final hidden state,
whatever chunking, prefix cache, step path or batch serves it; decoding streams keep going meanwhile."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from engine import (ContextLengthExceededError, DrainingError, Engine, EngineConfig, InvalidRequestError, QueueFullError,
                    SamplingParams)
from conftest import build_tiny, tiny_config, tiny_quantized_engine

HIDDEN_SIZE = 64  # tiny_config's


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 2000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(hf_model, prompt_ids: list[int], method: str = "last") -> torch.Tensor:
    """The transformers model's final hidden states (after its final norm) of the whole prompt, pooled, normalised."""
    with torch.no_grad():
        hidden = hf_model.base_model(torch.tensor([prompt_ids])).last_hidden_state[0].float()
    pooled = hidden[-1] if method == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)


def _embed(engine: Engine, prompts) -> list[torch.Tensor]:
    return [torch.tensor(e.vector) for e in asyncio.run(engine.embed(prompts))]


def _assert_close(vector: torch.Tensor, reference: torch.Tensor) -> None:
    assert vector.shape == reference.shape
    assert abs(float(vector.norm()) - 1.0) < 1e-5
    assert torch.allclose(vector, reference, atol=1e-5), float((vector - reference).abs().max())


def test_a_batch_of_short_single_token_and_chunked_prompts_match_the_plain_forward_pass(tiny_engine_factory):
    engine, hf_model = tiny_engine_factory(max_num_batched_tokens=32)
    prompts = [_prompt(7, seed=1), _prompt(1, seed=2), _prompt(100, seed=3), _prompt(33, seed=4)]  # 100, 33: chunked
    embeddings = asyncio.run(engine.embed(prompts))
    assert [e.num_prompt_tokens for e in embeddings] == [7, 1, 100, 33]
    for embedding, prompt in zip(embeddings, prompts):
        assert len(embedding.vector) == HIDDEN_SIZE
        _assert_close(torch.tensor(embedding.vector), _reference(hf_model, prompt))
    # Different inputs, different vectors (the pooled row is each prompt's own).
    assert not torch.allclose(torch.tensor(embeddings[0].vector), torch.tensor(embeddings[2].vector), atol=1e-3)


def test_text_input_is_tokenized_as_a_completion_prompt_is(tiny_engine_factory, default_tokenizer):
    engine, hf_model = tiny_engine_factory()
    [vector] = _embed(engine, ["The quick brown fox"])
    _assert_close(vector, _reference(hf_model, engine.tokenizer.encode("The quick brown fox")))


def test_a_prompt_whose_prefix_is_cached_gets_the_same_vector(tiny_engine_factory):
    engine, hf_model = tiny_engine_factory()
    prefix = _prompt(48, seed=5)  # three full 16-token blocks
    engine.generate([prefix + [7, 8]], SamplingParams(max_tokens=2))  # a completion caches the prefix's blocks
    hits_before = engine.stats().num_prefix_cache_hits
    prompts = [prefix + [9], prefix + [10, 11, 12], prefix]  # the last: every block but the last token's is cached
    vectors = _embed(engine, prompts)
    assert engine.stats().num_prefix_cache_hits > hits_before
    for vector, prompt in zip(vectors, prompts):
        _assert_close(vector, _reference(hf_model, prompt))


def test_the_native_step_pools_a_cached_prompts_last_token_as_the_eager_prefill_does(default_tokenizer):
    engine, _ = tiny_quantized_engine("llama", "int8", default_tokenizer)
    try:
        if engine.runner.decode_step != "native":
            pytest.skip(f"no native decode step here ({engine.runner.decode_step})")
        prompt = _prompt(33, seed=6)  # two cached blocks, then one token: a step of one token runs natively
        [whole] = _embed(engine, [prompt])  # all 33 prefilled by the eager model
        native_before = engine.runner.decode_steps["native"]
        [cached] = _embed(engine, [prompt])
        assert engine.runner.decode_steps["native"] == native_before + 1
        assert torch.allclose(cached, whole, atol=1e-4), float((cached - whole).abs().max())
    finally:
        engine.stop()


def test_the_generic_transformers_path_pools_its_final_hidden_state(tiny_engine_factory):
    engine, hf_model = tiny_engine_factory("gpt2")
    assert not engine.loaded.is_native
    prompts = [_prompt(12, seed=7), _prompt(5, seed=8)]
    for vector, prompt in zip(_embed(engine, prompts), prompts):
        _assert_close(vector, _reference(hf_model, prompt))


def _sentence_transformers_engine(tokenizer, folder, **pooling_modes):
    """A tiny engine loaded from a folder that holds a sentence-transformers Pooling config asking for pooling_modes."""
    (folder / "1_Pooling").mkdir()
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": HIDDEN_SIZE, "pooling_mode_cls_token": False, **pooling_modes}))
    hf_model, loaded = build_tiny(tiny_config(), tokenizer)
    loaded.folder = folder
    return Engine(EngineConfig(dtype="float32", max_num_batched_tokens=32), loaded=loaded).start(), hf_model


def test_a_sentence_transformers_checkpoint_asking_for_mean_pooling_gets_it(default_tokenizer, tmp_path):
    engine, hf_model = _sentence_transformers_engine(default_tokenizer, tmp_path, pooling_mode_mean_tokens=True)
    try:
        assert engine.pooling.method == "mean"
        prompt = _prompt(70, seed=9)  # chunked, and its second request finds its blocks cached but may not use them
        first, second = _embed(engine, [prompt]), _embed(engine, [prompt])
        for [vector] in (first, second):
            _assert_close(vector, _reference(hf_model, prompt, "mean"))
    finally:
        engine.stop()


def test_a_pooling_mode_tern_does_not_serve_refuses_embeddings_and_nothing_else(default_tokenizer, tmp_path):
    engine, _ = _sentence_transformers_engine(default_tokenizer, tmp_path, pooling_mode_max_tokens=True)
    try:
        with pytest.raises(InvalidRequestError) as info:
            asyncio.run(engine.embed(["a text"]))
        assert info.value.param == "model" and "pooling_mode_max_tokens" in info.value.message
        [completion] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert len(completion.choices[0].token_ids) == 2
    finally:
        engine.stop()


def test_decoding_streams_keep_producing_tokens_while_embeddings_are_prefilled(tiny_engine_factory):
    engine, hf_model = tiny_engine_factory(max_num_batched_tokens=32)
    stream = engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=480, ignore_eos=True))
    next(stream)  # the stream is decoding
    generated_before = engine.stats().num_generated_tokens
    prompts = [_prompt(200, seed=10), _prompt(150, seed=11)]  # 350 tokens: at least 11 steps of 32
    vectors = _embed(engine, prompts)
    generated_during = engine.stats().num_generated_tokens - generated_before
    # Every step that prefilled a chunk also gave the stream its token (running sequences come first).
    assert generated_during >= 350 // 32 - 1
    for vector, prompt in zip(vectors, prompts):
        _assert_close(vector, _reference(hf_model, prompt))
    outputs = list(stream)
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 480


def test_bad_inputs_are_refused_before_anything_is_queued(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_model_len=64)
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(engine.embed([[5, 6], []]))
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(engine.embed([[5, 10**9]]))
    assert "outside the vocabulary" in info.value.message
    with pytest.raises(ContextLengthExceededError):
        asyncio.run(engine.embed([list(range(3, 70))]))
    assert len(_embed(engine, [list(range(3, 67))])) == 1  # the whole context is allowed: nothing is generated
    assert engine.stats().num_running == 0 and engine.stats().num_kv_blocks_used == 0


def test_a_full_queue_refuses_the_whole_batch(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_waiting=2, max_num_seqs=1)
    stream = engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    _wait_until(lambda: engine.stats().num_running == 1)
    with pytest.raises(QueueFullError):
        asyncio.run(engine.embed([[5, 6], [7, 8], [9, 10]]))
    engine.abort(stream.request_id)
    list(stream)
    _wait_until(lambda: not engine.has_requests and engine.stats().num_kv_blocks_used == 0)
    assert len(_embed(engine, [[5, 6]])) == 1


def test_cancelling_an_embedding_aborts_it(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_num_seqs=1)
    stream = engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    _wait_until(lambda: engine.stats().num_running == 1)

    async def main():
        task = asyncio.create_task(engine.embed([_prompt(40, seed=12)]))
        await asyncio.to_thread(_wait_until, lambda: engine.stats().num_waiting == 1)  # queued behind the stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_until(lambda: engine.stats().num_waiting == 0)
    engine.abort(stream.request_id)
    list(stream)
    _wait_until(lambda: not engine.has_requests and engine.stats().num_kv_blocks_used == 0)


def test_a_draining_engine_refuses_new_embeddings_and_ends_waiting_ones_as_shut_down(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_num_seqs=1)
    stream = engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    _wait_until(lambda: engine.stats().num_running == 1)

    async def main():
        task = asyncio.create_task(engine.embed([_prompt(40, seed=13)]))
        await asyncio.to_thread(_wait_until, lambda: engine.stats().num_waiting == 1)
        engine.drain()
        with pytest.raises(DrainingError):
            await engine.embed([[5, 6]])
        engine.abort_all()  # the shutdown's grace period is over
        with pytest.raises(DrainingError):
            await task

    asyncio.run(main())
    assert list(stream)[-1].finish_reason == "abort"
    _wait_until(lambda: not engine.has_requests and engine.stats().num_kv_blocks_used == 0)


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
