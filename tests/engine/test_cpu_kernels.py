"""Tern's int8 VNNI kernel (engine/cpu_kernels.py): its packed layout, its PyTorch reference bit for bit, its error
against the float matmul, its place in the compiled step, and what it means for an engine's tokens."""
from __future__ import annotations

import time

import pytest
import torch
from conftest import tiny_quantized_engine

from engine import SamplingParams
from engine import cpu_kernels, quant

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no VNNI kernel: {cpu_kernels.unsupported_reason()}")
SHAPES = [(4, 64), (8, 192), (12, 320), (100, 576), (576, 1536)]  # (N, K): activation blocks of 64, 192, 64, 192, 256


def _case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = (torch.rand(n, generator=generator) / 100).to(dtype)
    # Columns of very different magnitude, as in real activations, so block scales matter.
    x = (torch.randn(rows, k, generator=generator) * torch.logspace(-2, 1, k)).to(dtype)
    return x, weight, scales


def test_pack_round_trips_and_rows_read_from_the_packed_layout():
    weight = torch.randint(-127, 128, (12, 192), dtype=torch.int8)
    packed = cpu_kernels.pack(weight)
    assert packed.dtype == torch.uint8 and packed.shape == weight.shape and not torch.equal(packed.view(torch.int8), weight)
    assert torch.equal(cpu_kernels.unpack(packed), weight)
    ids = torch.tensor([[0, 5, 11], [3, 3, 7]])
    assert torch.equal(cpu_kernels.packed_rows(packed, ids), weight[ids])
    for block, k in ((64, 192), (192, 192), (64, 64)):  # one block of 64: the permuted view is the packed tensor
        weight = torch.randint(-127, 128, (12, k), dtype=torch.int8)
        packed = cpu_kernels.pack(weight)
        before = packed.clone()
        expected = torch.stack(weight.split(block, dim=1))  # [K/block, N, block]
        assert torch.equal(cpu_kernels.unpack_blocks(packed, block), expected)
        assert torch.equal(packed, before)


def test_activation_block_is_the_largest_that_divides_the_row():
    assert [cpu_kernels.activation_block(k) for k in (576, 1536, 640, 320, 64)] == [192, 256, 128, 64, 64]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 32, 40])
def test_kernel_and_the_batch_path_equal_the_pytorch_reference_bit_for_bit(dtype, rows):
    for n, k in SHAPES:
        x, weight, scales = _case(rows, n, k, dtype, seed=rows)
        x[0, :64] = 0  # a block of zeros has no scale to divide by
        expected = cpu_kernels.int8_reference(x, weight, scales)
        packed = cpu_kernels.pack(weight)
        out = cpu_kernels.int8_vnni_mm(x, packed, scales)
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, expected), (n, k)
        assert torch.equal(cpu_kernels.int8_batch_mm(x, packed, scales), expected), (n, k)


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
    x, weight, scales = _case(3, 100, 576, torch.bfloat16)
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
        # The long prompt joins mid-decode: its prefill (60 rows, past the kernel's limit) shares steps with
        # the decode, which then runs through int8_batch_mm instead of the kernel.
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
