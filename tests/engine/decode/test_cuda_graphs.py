"""Decode steps padded to (batch, context) buckets and replayed from CUDA graphs give the eager step's tokens.

The padding (scratch slot, masks, buckets) runs uncaptured on CPU, so CI checks it; the captured graphs need a GPU.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.decode import decode_path
from engine.decode.cuda_graphs import batch_buckets, context_buckets

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_buckets_cover_every_size_with_little_padding():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    assert context_buckets(8192, 16) == [256, 512, 1024, 2048, 4096, 8192]
    assert context_buckets(600, 16) == [256, 512, 608]  # the last covers max_model_len in whole blocks
    assert context_buckets(100, 16) == [112]


def _prompts(count: int, seed: int, longest: int = 60) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, longest, (count,), generator=generator).tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def _padded_twin(factory, monkeypatch, **engine_config):
    """An engine on CPU whose decode steps run padded to buckets as CUDA graphs would (uncaptured: the planner
    plans graphs on CUDA only, so this one is told to), and its plain twin."""
    plain, _ = factory("llama", device="cpu", **engine_config)
    planned = decode_path.plan_decode_path
    with monkeypatch.context() as patch:
        patch.setattr(decode_path, "plan_decode_path", lambda *args: dataclasses.replace(planned(*args), graphs=True))
        padded, _ = factory("llama", device="cpu", **engine_config)
    assert padded.info().decode_graphs and not plain.info().decode_graphs and not padded.runner.graphs.capture
    return plain, padded


def _same_completions(plain, padded, prompts, params, tolerance=1e-4):
    ours = padded.generate(prompts, params)
    theirs = plain.generate(prompts, params)
    for a, b in zip(ours, theirs):
        assert a.choices[0].token_ids == b.choices[0].token_ids
        for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=tolerance)


def test_padded_decode_steps_give_the_eager_tokens_on_cpu(tiny_engine_factory, monkeypatch):
    # 5 sequences pad to a batch of 6; contexts cross the 256-token bucket into the last one (512) mid-decode.
    plain, padded = _padded_twin(tiny_engine_factory, monkeypatch, max_num_seqs=6)
    assert padded.runner.graphs.batch_sizes == [1, 2, 4, 6]
    prompts = _prompts(4, seed=1) + [_prompts(1, seed=2)[0] * 40][:1]
    prompts[-1] = prompts[-1][:240]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    _same_completions(plain, padded, prompts, params)
    # A sequence alone (batch bucket 1) after the others finished, and seeded sampling.
    _same_completions(plain, padded, prompts[:1], SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=0))


def test_padding_rows_write_only_the_scratch_slot(tiny_engine_factory, monkeypatch):
    _, padded = _padded_twin(tiny_engine_factory, monkeypatch, max_num_seqs=4)
    cache = padded.kv_cache
    before = [k[: cache.scratch_slot].clone() for k in cache.keys]
    graphs = padded.runner.graphs
    graphs._fill([], [], [], 4, graphs.context_sizes[0])  # a step of padding rows only
    with torch.inference_mode():
        graphs._step(4, graphs.context_sizes[0])
    assert all(torch.equal(k[: cache.scratch_slot], b) for k, b in zip(cache.keys, before))
    assert any(k[cache.scratch_slot].abs().sum() > 0 for k in cache.keys)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_captured_decode_gives_the_eager_tokens_on_cuda(tiny_engine_factory, compile):
    plain, _ = tiny_engine_factory("llama", device="cuda", cuda_graphs=False)
    graphed, _ = tiny_engine_factory("llama", device="cuda", compile=compile)
    assert graphed.info().decode_graphs and not plain.info().decode_graphs
    assert graphed.info().compiled_decode == compile
    prompts = _prompts(11, seed=4) + [_prompts(1, seed=5)[0] * 40][:1]
    prompts[-1] = prompts[-1][:250]  # crosses into the second context bucket
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    _same_completions(plain, graphed, prompts, params, tolerance=1e-3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, n=3)
    assert [c.token_ids for c in graphed.generate(prompts[:2], seeded)[1].choices] == \
        [c.token_ids for c in plain.generate(prompts[:2], seeded)[1].choices]
