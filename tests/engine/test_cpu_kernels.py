"""Tern's CPU kernels (engine/cpu_kernels.py), int8 (VNNI) and bf16: their packed layout, the int8 kernel's PyTorch
reference bit for bit, their error against the float matmul, their place in the compiled step, and what they mean
for an engine's tokens."""
from __future__ import annotations

import time

import pytest
import torch
from conftest import build_tiny, tiny_config, tiny_quantized_engine

from engine import SamplingParams
from engine import cpu_kernels, quant

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no VNNI kernel: {cpu_kernels.unsupported_reason()}")
needs_bf16_kernel = pytest.mark.skipif(not cpu_kernels.bf16_available(), reason="no AVX512-BF16 kernel on this CPU")
SHAPES = [(16, 64), (32, 192), (48, 320), (112, 576), (576, 1536)]  # (N, K): activation blocks of 64, 192, 64, 192, 256


def _case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = (torch.rand(n, generator=generator) / 100).to(dtype)
    # Columns of very different magnitude, as in real activations, so block scales matter.
    x = (torch.randn(rows, k, generator=generator) * torch.logspace(-2, 1, k)).to(dtype)
    return x, weight, scales


def test_pack_round_trips_and_rows_read_from_the_packed_layout():
    weight = torch.randint(-127, 128, (32, 192), dtype=torch.int8)
    packed = cpu_kernels.pack(weight)
    assert packed.dtype == torch.uint8 and packed.shape == weight.shape and not torch.equal(packed.view(torch.int8), weight)
    assert torch.equal(cpu_kernels.unpack(packed), weight)
    ids = torch.tensor([[0, 5, 31], [17, 17, 7]])
    assert torch.equal(cpu_kernels.packed_rows(packed, ids), weight[ids])


def test_activation_block_is_the_largest_that_divides_the_row():
    assert [cpu_kernels.activation_block(k) for k in (576, 1536, 640, 320, 64)] == [192, 256, 128, 64, 64]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 32, 40, 300])
def test_kernel_equals_the_pytorch_reference_bit_for_bit_at_every_batch_size(dtype, rows):
    for n, k in SHAPES:
        x, weight, scales = _case(rows, n, k, dtype, seed=rows)
        x[0, :64] = 0  # a block of zeros has no scale to divide by
        expected = cpu_kernels.int8_reference(x, weight, scales)
        packed = cpu_kernels.pack(weight)
        out = cpu_kernels.int8_vnni_mm(x, packed, scales)
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, expected), (n, k)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_error_against_the_float_matmul_is_small(dtype):
    for n, k in SHAPES:
        x, weight, scales = _case(9, n, k, dtype)
        exact = x.float() @ weight.float().T * scales.float()
        out = cpu_kernels.int8_vnni_mm(x, cpu_kernels.pack(weight), scales).float()
        relative = ((out - exact).norm() / exact.norm()).item()
        assert relative < 0.02, (n, k, relative)  # measured 0.5-0.8%: int8 activations in blocks, as llama.cpp


@needs_kernel
def test_kernel_runs_inside_a_compiled_graph():
    x, weight, scales = _case(3, 112, 576, torch.bfloat16)
    packed = cpu_kernels.pack(weight)

    def layer(x):
        return torch.relu(quant.packed_int8_linear(x, packed, scales)) * 2

    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


@needs_kernel
def test_int8_engine_packs_its_matrices_and_a_decode_does_not_depend_on_its_neighbours(default_tokenizer):
    engine, _ = tiny_quantized_engine("llama", "int8", default_tokenizer)
    try:
        modules = list(engine.loaded.model.modules())
        linears = [m for m in modules if isinstance(m, quant.Int8Linear)]
        assert linears and all(m.packed and m.weight_int8.dtype == torch.uint8 for m in linears)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
        prompt, long_prompt = list(range(5, 15)), list(range(100, 160))
        [alone] = engine.generate([prompt], params)
        # The long prompt joins mid-decode: its prefill (60 rows) shares steps with the decode, whose row must
        # come out of the kernel with the same bits as when it ran alone.
        stream = engine.submit(prompt, params)
        outputs = [next(stream)]
        other = engine.submit(long_prompt, params)
        time.sleep(0.01)
        outputs += list(stream)
        list(other)
        assert [t for o in outputs for t in o.token_ids] == alone.choices[0].token_ids
        assert [e.logprob for o in outputs for e in o.logprobs] == [e.logprob for e in alone.choices[0].logprobs]
    finally:
        engine.stop()


def test_bf16_rows_round_trip_through_the_packed_layout():
    weight = torch.randn(12, 96).to(torch.bfloat16)
    packed = cpu_kernels.pack_rows(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == weight.shape and not torch.equal(packed, weight)
    assert torch.equal(cpu_kernels.unpack_rows(packed), weight)
    ids = torch.tensor([[0, 5, 11], [3, 3, 7]])
    assert torch.equal(cpu_kernels.gather_rows(packed, ids), weight[ids])


def _bf16_case(rows: int, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(torch.bfloat16)
    x = (torch.randn(rows, k, generator=generator) * torch.logspace(-2, 1, k)).to(torch.bfloat16)
    return x, weight


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 3, 5, 33, 100])
def test_bf16_kernel_is_the_exact_product_rounded_once_and_each_row_is_independent_of_the_batch(rows):
    for n, k in [(4, 32), (12, 96), (100, 576), (576, 1536)]:
        x, weight = _bf16_case(rows, n, k, seed=rows)
        packed = cpu_kernels.pack_rows(weight)
        out = cpu_kernels.bf16_packed_mm(x, packed)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        exact = x.double() @ weight.double().T
        # One rounding to bf16 (half an ulp: 2^-9 relative) plus fp32 accumulation: at most one ulp off.
        error = (out.double() - exact).abs()
        assert (error <= exact.abs() * 2**-8 + 1e-6).all(), (n, k, error.max().item())
        aten_error = (torch.nn.functional.linear(x, weight).double() - exact).abs().max()
        assert error.max() <= aten_error * 1.5 + 1e-6, (n, k)  # as close as aten's own bf16 matmul
        for row in {0, rows // 2, rows - 1}:  # alone, a row gets the same bits as inside any batch
            alone = cpu_kernels.bf16_packed_mm(x[row:row + 1], packed)
            assert torch.equal(alone[0], out[row]), (n, k, row)


@needs_bf16_kernel
def test_bf16_kernel_runs_inside_a_compiled_graph():
    x, weight = _bf16_case(3, 100, 576)
    layer = quant.PackedBf16Linear(cpu_kernels.pack_rows(weight), torch.randn(100).to(torch.bfloat16))

    def block(x):
        return torch.relu(layer(x)) * 2

    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(x), block(x))


@needs_bf16_kernel
def test_bf16_engine_packs_its_matrices_once_and_agrees_with_its_unpacked_twin(default_tokenizer):
    import copy

    from engine import Engine, EngineConfig

    _, loaded = build_tiny(tiny_config("llama", tie_word_embeddings=True), default_tokenizer, dtype=torch.bfloat16)
    twin = copy.deepcopy(loaded)  # aten's F.linear on the same bf16 weights
    quant.quantize(loaded.model, "none", loaded.device, loaded.dtype)
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, quant.PackedBf16Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the lm_head
    assert model.lm_head.weight_packed is model.model.embed_tokens.weight_packed  # tied: one matrix
    assert quant.weight_bytes(model) == quant.weight_bytes(twin.model)
    assert quant.num_parameters(model) == quant.num_parameters(twin.model)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompt, long_prompt = list(range(5, 15)), list(range(100, 160))
    results = {}
    for name, which in (("packed", loaded), ("twin", twin)):
        engine = Engine(EngineConfig(dtype="bfloat16", device="cpu"), loaded=which).start()
        try:
            [alone] = engine.generate([prompt], params)
            stream = engine.submit(prompt, params)  # the long prompt's prefill joins this decode mid-way
            outputs = [next(stream)]
            other = engine.submit(long_prompt, params)
            time.sleep(0.01)
            outputs += list(stream)
            list(other)
            results[name] = alone.choices[0], outputs
        finally:
            engine.stop()
    alone, outputs = results["packed"]
    # Every step computes a row the same way, so a sequence's tokens do not depend on what shares its steps.
    assert [t for o in outputs for t in o.token_ids] == alone.token_ids
    assert [e.logprob for o in outputs for e in o.logprobs] == [e.logprob for e in alone.logprobs]
    # Against aten's bf16 matmul: the first token's distribution agrees to bf16 rounding (later tokens may part
    # at a near tie: the tiny random model's distribution is nearly uniform).
    twin_first = dict(results["twin"][0].logprobs[0].top)
    for token, logprob in alone.logprobs[0].top:
        assert abs(twin_first.get(token, -99.0) - logprob) < 0.05


def _matmul_decode_attention(q, k_cache, v_cache, context_slots, context_lens, scale):
    """The plain-PyTorch decode attention (the kernel's twin), on the same inputs."""
    from engine.models.attention import _decode_attention_matmul

    batch, length = context_slots.shape
    heads, dim = k_cache.shape[1:]
    keys = k_cache[context_slots.reshape(-1)].view(batch, length, heads, dim).transpose(1, 2)
    values = v_cache[context_slots.reshape(-1)].view(batch, length, heads, dim).transpose(1, 2)
    mask = (torch.arange(length)[None] < context_lens[:, None])[:, None, None]
    return _decode_attention_matmul(q, keys, values, mask, scale)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,length,heads,kv_heads,dim", [(16, 243, 9, 3, 64), (1, 37, 4, 4, 128), (5, 100, 8, 2, 32),
                                                             (3, 1, 4, 2, 16)])
def test_decode_attention_kernel_reads_the_cache_in_place_as_its_matmul_twin_computes(dtype, batch, length, heads,
                                                                                      kv_heads, dim):
    generator = torch.Generator().manual_seed(batch * length)
    slots = 4096
    k_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    q = torch.randn(batch, heads, dim, generator=generator).to(dtype)
    context_slots = torch.randperm(slots, generator=generator)[: batch * length].view(batch, length)
    context_lens = torch.randint(1, length + 1, (batch,), generator=generator)
    context_lens[0] = length
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, context_slots, context_lens, dim**-0.5)
    expected = _matmul_decode_attention(q, k_cache, v_cache, context_slots, context_lens, dim**-0.5)
    assert out.dtype == dtype and out.shape == (batch, heads * dim)
    # bf16: rounded where the matmuls round, so only fp32 summation order differs (measured: equal bits).
    # fp32: a few ulps.
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert (out == expected).float().mean() > (0.99 if dtype == torch.bfloat16 else 0.0)
    # Padding past a sequence's length is never read: scribbling over it changes nothing.
    garbage = context_slots.clone()
    for b in range(batch):
        garbage[b, context_lens[b]:] = 0
    k_cache[0] = float("nan")
    assert torch.equal(cpu_kernels.paged_decode_attention(q, k_cache, v_cache, garbage, context_lens, dim**-0.5), out)
    alone = cpu_kernels.paged_decode_attention(q[-1:], k_cache, v_cache, garbage[-1:], context_lens[-1:], dim**-0.5)
    assert torch.equal(alone[0], out[-1])  # a sequence's attention does not depend on its batch


@needs_kernel
@pytest.mark.parametrize("dtype,tie", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_engine_decodes_the_same_tokens_with_the_attention_kernel_as_with_its_matmul_twin(default_tokenizer, dtype, tie):
    engine, _ = tiny_quantized_engine("llama", "none", default_tokenizer, dtype=dtype, max_num_seqs=8)
    try:
        assert engine.runner.decode_kernel
        generator = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 2000, (n,), generator=generator).tolist() for n in (3, 17, 40, 90, 5)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
        runs = {}
        for kernel in (True, False):
            engine.runner.decode_kernel = kernel  # read by the engine thread at its next step
            runs[kernel] = [c.choices[0] for c in engine.generate(prompts, params)]
    finally:
        engine.stop()
    for ours, twin in zip(runs[True], runs[False]):
        for position, (mine, theirs) in enumerate(zip(ours.token_ids, twin.token_ids)):
            if mine != theirs:  # bf16 only: a near tie may flip, then the sequences part
                top = dict(twin.logprobs[position].top)
                assert dtype == "bfloat16" and mine in top and top[theirs] - top[mine] <= tie
                break
            assert abs(ours.logprobs[position].logprob - twin.logprobs[position].logprob) <= tie
