"""The decode attention kernel of every path this CPU takes, against its plain-PyTorch twin (the matmul path), and
what it means for an engine's tokens."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import require_op, tiny_quantized_engine

from engine import SamplingParams
from engine.models.attention import _decode_attention_matmul


def _matmul_decode_attention(q, k_cache, v_cache, context_slots, context_lens, scale):
    """The plain-PyTorch decode attention (the kernel's twin), on the same inputs."""
    batch, length = context_slots.shape
    heads, dim = k_cache.shape[1:]
    keys = k_cache[context_slots.reshape(-1)].view(batch, length, heads, dim).transpose(1, 2)
    values = v_cache[context_slots.reshape(-1)].view(batch, length, heads, dim).transpose(1, 2)
    mask = (torch.arange(length)[None] < context_lens[:, None])[:, None, None]
    return _decode_attention_matmul(q, keys, values, mask, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,length,heads,kv_heads,dim", [(16, 243, 9, 3, 64), (1, 37, 4, 4, 128),
                                                             (5, 100, 8, 2, 32), (3, 1, 4, 2, 16)])
def test_decode_attention_kernel_reads_the_cache_in_place_as_its_matmul_twin_computes(path_kernels, dtype, batch,
                                                                                      length, heads, kv_heads, dim):
    attend = require_op(path_kernels.decode_attention, "decode attention")
    generator = torch.Generator().manual_seed(batch * length)
    slots = 4096
    k_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    q = torch.randn(batch, heads, dim, generator=generator).to(dtype)
    context_slots = torch.randperm(slots, generator=generator)[: batch * length].view(batch, length)
    context_lens = torch.randint(1, length + 1, (batch,), generator=generator)
    context_lens[0] = length
    out = attend(q, k_cache, v_cache, context_slots, context_lens, dim**-0.5)
    expected = _matmul_decode_attention(q, k_cache, v_cache, context_slots, context_lens, dim**-0.5)
    assert out.dtype == dtype and out.shape == (batch, heads * dim)
    # bf16: rounded where the matmuls round, so only fp32 summation order differs: a score rounded the other way
    # moves an output by up to 2**-9 (measured, 40 seeds, both paths). fp32: summation order, ~5e-7.
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    if dtype == torch.bfloat16:
        # And no less accurate than the twin: against attention computed in fp32 from the same bf16 inputs, the
        # kernel's largest and mean errors are the twin's within 5% (measured: within 0.2%).
        exact = _matmul_decode_attention(q.float(), k_cache.float(), v_cache.float(), context_slots, context_lens,
                                         dim**-0.5)
        ours, twins = (out.float() - exact).abs(), (expected.float() - exact).abs()
        assert ours.max() <= 1.05 * twins.max() and ours.mean() <= 1.05 * twins.mean(), \
            (ours.max().item(), twins.max().item(), ours.mean().item(), twins.mean().item())
    # Padding past a sequence's length is never read: scribbling over it changes nothing.
    garbage = context_slots.clone()
    for b in range(batch):
        garbage[b, context_lens[b]:] = 0
    k_cache[0] = float("nan")
    assert torch.equal(attend(q, k_cache, v_cache, garbage, context_lens, dim**-0.5), out)
    alone = attend(q[-1:], k_cache, v_cache, garbage[-1:], context_lens[-1:], dim**-0.5)
    assert torch.equal(alone[0], out[-1])  # a sequence's attention does not depend on its batch


@pytest.mark.parametrize("batch,length,heads,kv_heads,dim", [(16, 243, 9, 3, 64), (5, 100, 8, 2, 32), (3, 1, 4, 2, 16)])
def test_float32_queries_read_a_bf16_cache_as_their_twin_reads_its_values_widened(path_kernels, batch, length, heads,
                                                                                 kv_heads, dim):
    """--kv-cache-dtype bfloat16 on a float32 model: the kernel reads the bf16 cache and computes in float32, as the
    plain twin does on the cache's values widened to float32 (the rounding happened once, when they were stored)."""
    attend = require_op(path_kernels.decode_attention, "decode attention")
    generator = torch.Generator().manual_seed(length)
    k_cache, v_cache = (torch.randn(4096, kv_heads, dim, generator=generator).bfloat16() for _ in range(2))
    q = torch.randn(batch, heads, dim, generator=generator)
    context_slots = torch.randperm(4096, generator=generator)[: batch * length].view(batch, length)
    context_lens = torch.randint(1, length + 1, (batch,), generator=generator)
    out = attend(q, k_cache, v_cache, context_slots, context_lens, dim**-0.5)
    assert out.dtype == torch.float32 and out.shape == (batch, heads * dim)
    expected = _matmul_decode_attention(q, k_cache.float(), v_cache.float(), context_slots, context_lens, dim**-0.5)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    wide = attend(q, k_cache.float(), v_cache.float(), context_slots, context_lens, dim**-0.5)
    assert torch.allclose(out, wide, rtol=1e-6, atol=1e-6)  # the same arithmetic as on a float32 cache of them
    with pytest.raises(RuntimeError, match="bf16 or fp32 queries"):
        attend(q.bfloat16(), k_cache.float(), v_cache.float(), context_slots, context_lens, dim**-0.5)


@pytest.mark.parametrize("length", [17, 9, 33])
def test_decode_attention_with_every_score_far_below_zero_and_a_partial_last_register(path_kernels, length):
    """Scores all below -88 over a context that does not fill its last register: lanes past the end must not
    join the max (zeros there once made the softmax uniform instead of picking the best position)."""
    attend = require_op(path_kernels.decode_attention, "decode attention")
    dim = 64
    q = torch.ones(1, 2, dim)
    k_cache = torch.full((64, 1, dim), -3.0)  # every score: 64 * -3 = -192
    k_cache[5] = -2.5  # one position scores -160: softmax puts all the weight on it
    v_cache = torch.randn(64, 1, dim, generator=torch.Generator().manual_seed(0))
    context_slots, context_lens = torch.arange(length)[None], torch.tensor([length])
    out = attend(q, k_cache, v_cache, context_slots, context_lens, 1.0)
    expected = _matmul_decode_attention(q, k_cache, v_cache, context_slots, context_lens, 1.0)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(out[0, :dim], v_cache[5, 0], atol=1e-5)


@pytest.mark.parametrize("dtype,tie", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_engine_decodes_the_same_tokens_with_the_attention_kernel_as_with_its_matmul_twin(default_tokenizer, path_kernels,
                                                                                         dtype, tie):
    require_op(path_kernels.decode_attention, "decode attention")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2000, (n,), generator=generator).tolist() for n in (3, 17, 40, 90, 5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for has_kernel in (True, False):  # the twin: the same kernel path but for attention, planned without a kernel
        kernels = path_kernels if has_kernel else dataclasses.replace(path_kernels, decode_attention=None)
        engine, _ = tiny_quantized_engine("llama", "none", default_tokenizer, dtype=dtype, path=kernels, max_num_seqs=8)
        try:
            assert (engine.runner.path.attention_kernel is not None) == has_kernel
            runs[has_kernel] = [c.choices[0] for c in engine.generate(prompts, params)]
        finally:
            engine.stop()
    for ours, twin in zip(runs[True], runs[False]):
        for position, (mine, theirs) in enumerate(zip(ours.token_ids, twin.token_ids)):
            if mine != theirs:  # bf16 only: a near tie may flip, then the sequences part
                top = dict(twin.logprobs[position].top)
                assert dtype == "bfloat16" and mine in top and top[theirs] - top[mine] <= tie
                break
            assert abs(ours.logprobs[position].logprob - twin.logprobs[position].logprob) <= tie


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_a_prompt_attended_as_decode_rows_gets_the_bits_each_row_gets_alone(path_kernels, dtype, cache_dtype):
    """A prompt run as decode rows (one row per position, each attending to the positions up to its own: how the
    native step prefills) is served in tiles that read each key once (from a bf16 cache, widened once per tile).
    Each row's output must still be the exact bits that attending that row alone gives, which is what decoding that
    token computes: so a prompt token's logprob is the one it gets when generated. Two prompts of 37 and 21 rows
    (tiles of 16 and partial ones) between decode rows of other sequences; float32 queries over a bf16 cache are
    the engine's `--kv-cache-dtype bfloat16` on a float32 model."""
    attend = require_op(path_kernels.decode_attention, "decode attention")
    generator = torch.Generator().manual_seed(7)
    slots, heads, kv_heads, dim = 1024, 9, 3, 64
    k_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(cache_dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(cache_dtype)
    order = torch.randperm(slots, generator=generator)
    first, second, other = order[:60], order[60:90], order[90:]
    rows = [(other[:50], 50)]  # a decode row of another sequence
    rows += [(first, start + position + 1) for start, position in [(23, p) for p in range(37)]]
    rows += [(other[50:150], 100)]
    rows += [(second, 9 + position + 1) for position in range(21)]
    length = max(len(context) for context, _ in rows)
    context_slots = torch.stack([torch.nn.functional.pad(c, (0, length - len(c))) for c, _ in rows])
    context_lens = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), heads, dim, generator=generator).to(dtype)
    together = attend(q, k_cache, v_cache, context_slots, context_lens, dim**-0.5)
    for b in range(len(rows)):
        alone = attend(q[b:b + 1], k_cache, v_cache, context_slots[b:b + 1], context_lens[b:b + 1], dim**-0.5)
        assert torch.equal(alone[0], together[b]), b
    widened = (k_cache, v_cache) if dtype == cache_dtype else (k_cache.float(), v_cache.float())
    expected = _matmul_decode_attention(q, *widened, context_slots, context_lens, dim**-0.5)
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(together.float(), expected.float(), rtol=tolerance, atol=tolerance)
