"""The int8, 4-bit (int4, q4, q4k), 5-bit (q5k), 6-bit (q6k) and bf16 matmul kernels of every path this CPU takes:
bit for bit their PyTorch reference at every batch size, each row independent of its batch, inside a compiled graph;
and the layer each path puts in a model (its kernel, or aten's op on `off`) close to the exact product."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.weights import layers, quant
from engine.kernels import layouts

import reference
from conftest import require_op as require

# Tiles of 8 rows (AVX512) or 4 (AVX2), with every remainder; from 64 rows the AVX512 q4, int4 and q4k loops take
# two pairs of groups at a time, a tile in halves of 4 rows (71: a last tile of 7, halves of 4 and 3).
ROWS = [1, 2, 3, 5, 6, 15, 17, 40, 71, 300]


def _activations(rows: int, k: int, dtype: torch.dtype, generator) -> torch.Tensor:
    # Columns of very different magnitude, as in real activations, so block scales matter; one block of zeros.
    x = (torch.randn(rows, k, generator=generator) * torch.logspace(-2, 1, k)).to(dtype)
    x[0, :64] = 0
    return x


def _int4_case(rows, n, k, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    d = (torch.rand(n, k // 32, generator=generator) / 50).half()
    m = (-torch.rand(n, k // 32, generator=generator) / 5).half()
    return _activations(rows, k, dtype, generator), q, d, m


def _q4k_case(rows, n, k, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scale, minimum = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator) for _ in range(2))
    d = (torch.rand(n, k // 256, generator=generator) / 1000).half()
    dmin = (torch.rand(n, k // 256, generator=generator) / 200).half()
    return _activations(rows, k, dtype, generator), (q, scale, minimum, d, dmin)


def _q5k_case(rows, n, k, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=generator)
    scale, minimum = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator) for _ in range(2))
    d = (torch.rand(n, k // 256, generator=generator) / 1000).half()
    dmin = (torch.rand(n, k // 256, generator=generator) / 200).half()
    return _activations(rows, k, dtype, generator), (q, scale, minimum, d, dmin)


def _q6k_case(rows, n, k, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=generator)
    scale = torch.randint(-128, 128, (n, k // 16), generator=generator).to(torch.int8)
    d = (torch.rand(n, k // 256, generator=generator) / 1000).half()
    return _activations(rows, k, dtype, generator), (q, scale, d)


def _q8_case(rows, n, k, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)  # -128 too: files may hold it
    d = (torch.rand(n, k // 32, generator=generator) / 50).half()
    return _activations(rows, k, dtype, generator), q, d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
def test_q8_kernel_equals_its_reference_bit_for_bit(path_kernels, dtype, rows):
    q8_mm = require(path_kernels.q8_mm, "q8")
    for n, k in [(8, 32), (24, 96), (112, 576), (576, 1536)]:
        x, q, d = _q8_case(rows, n, k, dtype, seed=rows)
        out = q8_mm(x, layouts.pack_q8(q, d))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, reference.q8_matmul(x, q, d)), (n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
def test_int4_kernel_equals_its_reference_bit_for_bit(path_kernels, dtype, rows):
    int4_mm = require(path_kernels.int4_mm, "int4")
    for n, k in [(8, 32), (24, 96), (112, 576), (576, 1536)]:
        x, q, d, m = _int4_case(rows, n, k, dtype, seed=rows)
        out = int4_mm(x, layouts.pack_int4(q, d, m))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, reference.int4_matmul(x, q, d, m)), (n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
def test_q4_kernel_equals_its_reference_bit_for_bit(path_kernels, dtype, rows):
    """GGUF's Q4_0 (w = d * (q - 8)) in its own 18 bytes per 32 values: q8's arithmetic on q - 8."""
    q4_mm = require(path_kernels.q4_mm, "q4")
    for n, k in [(8, 32), (24, 96), (112, 576), (576, 1536)]:
        x, q, d, _ = _int4_case(rows, n, k, dtype, seed=rows)
        out = q4_mm(x, layouts.pack_q4(q, d))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, reference.q4_matmul(x, q, d)), (n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
def test_q4k_kernel_equals_its_reference_bit_for_bit(path_kernels, dtype, rows):
    """GGUF's Q4_K in its own 144 bytes per 256 values: int4's arithmetic, each block's scale and minimum the
    exact products of its super-block's d and dmin with 6-bit integers (every top-bit combination drawn)."""
    q4k_mm = require(path_kernels.q4k_mm, "q4k")
    for n, k in [(8, 256), (24, 512), (112, 768), (576, 1536)]:
        x, parts = _q4k_case(rows, n, k, dtype, seed=rows)
        out = q4k_mm(x, layouts.pack_q4k(*parts))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, reference.q4k_matmul(x, *parts)), (n, k)


@pytest.mark.parametrize("rows", [1, 16, 48])
def test_q4k_kernel_is_exact_at_the_largest_integers(path_kernels, rows):
    """Activations at full scale against the largest nibbles and 6-bit scales, in odd mixtures: each super-block's
    integer sum near its bound (31M, past what fp32 holds exactly), where a kernel summing it in floats would
    round (the AMX kernel sums four sub-blocks at a time in fp32, exact below 2^24, and from 32 rows a whole
    super-block in int32 tiles, its scales split in two parts)."""
    q4k_mm = require(path_kernels.q4k_mm, "q4k")
    generator = torch.Generator().manual_seed(7)
    n, k = 32, 512
    q = torch.randint(14, 16, (n, k), dtype=torch.uint8, generator=generator)
    scale = torch.randint(61, 64, (n, k // 32), dtype=torch.uint8, generator=generator)
    minimum = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator)
    d, dmin = torch.full((n, k // 256), 1e-3).half(), torch.full((n, k // 256), 1e-3).half()
    x = torch.ones(rows, k) + torch.randint(0, 2, (rows, k), generator=generator) * 1e-2  # quantize to 125-127
    parts = (q, scale, minimum, d, dmin)
    assert torch.equal(q4k_mm(x, layouts.pack_q4k(*parts)), reference.q4k_matmul(x, *parts))


@pytest.mark.parametrize("rows", [1, 6, 16, 48])
def test_q4_kernel_is_exact_at_the_largest_integers(path_kernels, rows):
    """Activations at full scale (both signs) against nibbles of 0 (q - 8 = -8) and some of 15: where the AVX2 pair
    loop starts a row's int16 pair sums at -8 * sum(xq), one pair of each row ends at its bound (2 * 16 * 8 * 127 =
    32,512, one short of what wraps), after partial sums that wrap on the way."""
    q4_mm = require(path_kernels.q4_mm, "q4")
    generator = torch.Generator().manual_seed(13)
    n, k = 32, 512
    q = torch.where(torch.rand(n, k, generator=generator) < 0.9, 0, 15).to(torch.uint8)
    q[:8] = 0  # a whole group at the bound
    d = torch.full((n, k // 32), 1e-3).half()
    x = torch.ones(rows, k) * torch.where(torch.rand(rows, 1, generator=generator) < 0.5, 1.0, -1.0)
    assert torch.equal(q4_mm(x, layouts.pack_q4(q, d)), reference.q4_matmul(x, q, d))


@pytest.mark.parametrize("rows", [1, 16, 48])
def test_q6k_kernel_is_exact_at_the_largest_integers(path_kernels, rows):
    """Activations at full scale (both signs) against 6-bit values at their ends and scales of -128 and 127: each
    register's int16 pair sums at their bound (2 * 2 * 63 * 127, where a third product would saturate), each
    super-block's integer near its own (134M, far past what fp32 holds exactly)."""
    q6k_mm = require(path_kernels.q6k_mm, "q6k")
    generator = torch.Generator().manual_seed(11)
    n, k = 32, 512
    q = torch.where(torch.rand(n, k, generator=generator) < 0.9, 63, 0).to(torch.uint8)
    scale = torch.where(torch.rand(n, k // 16, generator=generator) < 0.5, -128, 127).to(torch.int8)
    d = torch.full((n, k // 256), 1e-3).half()
    x = torch.ones(rows, k) * torch.where(torch.rand(rows, 1, generator=generator) < 0.5, 1.0, -1.0)
    x = x + torch.randint(0, 2, (rows, k), generator=generator) * 1e-2  # quantize to +-125..127
    assert torch.equal(q6k_mm(x, layouts.pack_q6k(q, scale, d)), reference.q6k_matmul(x, q, scale, d))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
def test_q6k_kernel_equals_its_reference_bit_for_bit(path_kernels, dtype, rows):
    """GGUF's Q6_K in its own 210 bytes per 256 values: per sub-block of 16 the exact integer sum((q - 32) * xq)
    times its int8 scale, summed per super-block, then one float step (one and two rows take AVX512's one-group
    loop, more rows its two-group one; odd group counts the AVX2 loop)."""
    q6k_mm = require(path_kernels.q6k_mm, "q6k")
    for n, k in [(8, 256), (24, 512), (112, 768), (576, 1536)]:
        x, parts = _q6k_case(rows, n, k, dtype, seed=rows)
        out = q6k_mm(x, layouts.pack_q6k(*parts))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, reference.q6k_matmul(x, *parts)), (n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
def test_q5k_kernel_equals_its_reference_bit_for_bit(path_kernels, dtype, rows):
    """GGUF's Q5_K in its own 176 bytes per 256 values: q4k's integers and float steps on 5-bit values (one and
    two rows take AVX512's one-group loop, more rows its two-group one; odd group counts the one-group loop)."""
    q5k_mm = require(path_kernels.q5k_mm, "q5k")
    for n, k in [(8, 256), (24, 512), (112, 768), (576, 1536)]:
        x, parts = _q5k_case(rows, n, k, dtype, seed=rows)
        out = q5k_mm(x, layouts.pack_q5k(*parts))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert torch.equal(out, reference.q5k_matmul(x, *parts)), (n, k)


@pytest.mark.parametrize("threads", [2, 3])
def test_decode_rows_get_every_output_once_however_the_threads_share_them(path_kernels, threads):
    """A step of 1-3 rows gives each thread one contiguous share, and a thread done early takes chunks from the back of
    another's (matmul.h: parallel_share); 3 threads on 2 cores make one of them late. Every output is computed, once,
    in any timing: the outputs start as garbage where a kernel writes into torch.empty."""
    q4_mm, q8_mm = require(path_kernels.q4_mm, "q4"), require(path_kernels.q8_mm, "q8")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3):
            for n in (8 * 101, 4096):  # a split with a remainder, and one of 16 chunks a share
                x, q, d, _ = _int4_case(rows, n, 256, torch.float32, seed=n + rows)
                _, q8, d8 = _q8_case(rows, n, 256, torch.float32, seed=n + rows)
                packed_q4, packed_q8 = layouts.pack_q4(q, d), layouts.pack_q8(q8, d8)
                want_q4, want_q8 = reference.q4_matmul(x, q, d), reference.q8_matmul(x, q8, d8)
                for _ in range(30):
                    assert torch.equal(q4_mm(x, packed_q4), want_q4), (rows, n)
                    assert torch.equal(q8_mm(x, packed_q8), want_q8), (rows, n)
    finally:
        torch.set_num_threads(before)


def test_a_row_gets_the_same_bits_alone_as_in_any_batch(path_kernels):
    """What makes a sequence's tokens independent of the other sequences sharing its steps."""
    q8_mm, int4_mm = require(path_kernels.q8_mm, "q8"), require(path_kernels.int4_mm, "int4")
    q4_mm = require(path_kernels.q4_mm, "q4")
    x, q, d, m = _int4_case(37, 112, 576, torch.float32)
    _, q8, d8 = _q8_case(37, 112, 576, torch.float32)
    packed4, packed_q8, packed_q4 = layouts.pack_int4(q, d, m), layouts.pack_q8(q8, d8), layouts.pack_q4(q, d)
    batch4, batch_q8, batch_q4 = int4_mm(x, packed4), q8_mm(x, packed_q8), q4_mm(x, packed_q4)
    _, parts = _q4k_case(37, 112, 512, torch.float32)
    q4k_mm, packed_q4k = require(path_kernels.q4k_mm, "q4k"), layouts.pack_q4k(*parts)
    batch_q4k = q4k_mm(x[:, :512], packed_q4k)
    _, parts6 = _q6k_case(37, 112, 512, torch.float32)
    q6k_mm, packed_q6k = require(path_kernels.q6k_mm, "q6k"), layouts.pack_q6k(*parts6)
    batch_q6k = q6k_mm(x[:, :512], packed_q6k)
    _, parts5 = _q5k_case(37, 112, 512, torch.float32)
    q5k_mm, packed_q5k = require(path_kernels.q5k_mm, "q5k"), layouts.pack_q5k(*parts5)
    batch_q5k = q5k_mm(x[:, :512], packed_q5k)
    for row in (0, 5, 36):
        assert torch.equal(q5k_mm(x[row:row + 1, :512], packed_q5k)[0], batch_q5k[row])
        assert torch.equal(q4k_mm(x[row:row + 1, :512], packed_q4k)[0], batch_q4k[row])
        assert torch.equal(q6k_mm(x[row:row + 1, :512], packed_q6k)[0], batch_q6k[row])
        assert torch.equal(int4_mm(x[row:row + 1], packed4)[0], batch4[row])
        assert torch.equal(q8_mm(x[row:row + 1], packed_q8)[0], batch_q8[row])
        assert torch.equal(q4_mm(x[row:row + 1], packed_q4)[0], batch_q4[row])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_q4_layer_computes_the_q4_0_product_on_every_path(path_kernels, dtype):
    """What a GGUF's Q4_0 tensor becomes: the q4 kernel where the path has one, else aten's int4pack on the same
    weight put in int4's layout (m = -8 d); both close to the exact product with d * (q - 8)."""
    from engine.weights.layers import Q4Linear

    generator = torch.Generator().manual_seed(11)
    q = torch.randint(0, 16, (112, 576), dtype=torch.uint8, generator=generator)
    d = (torch.rand(112, 576 // 32, generator=generator) / 50).half()
    bias = torch.randn(112, generator=generator)
    model = nn.Sequential(Q4Linear(layouts.pack_q4(q, d), bias.to(dtype)))
    quant.pack_for_cpu(model, path_kernels)
    layer = model[0]
    assert type(layer) is (layers.PackedQ4Linear if path_kernels.q4_mm else layers.AtenInt4Linear)
    stored = ((q.float() - 8).reshape(112, -1, 32) * d.float()[..., None]).reshape(112, 576)
    assert torch.equal(layouts.dequantize_q4(layouts.pack_q4(q, d)), stored)
    for rows in (1, 9, 64):
        x = _activations(rows, 576, dtype, generator)
        exact = x.double() @ stored.double().T + bias.to(dtype).double()
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 112)
        assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02, rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_q4k_layer_computes_the_q4_k_product_on_every_path(path_kernels, dtype):
    """What a GGUF's Q4_K tensor becomes: the q4k kernel where the path has one (AVX512), else the int4 kernel or
    aten's int4pack on the same weight put in int4's layout (its scales rounded to fp16); all close to the exact
    product."""
    from engine.weights.layers import Q4KLinear

    generator = torch.Generator().manual_seed(12)
    _, parts = _q4k_case(1, 112, 512, dtype, seed=12)
    bias = torch.randn(112, generator=generator)
    model = nn.Sequential(Q4KLinear(layouts.pack_q4k(*parts), bias.to(dtype)))
    quant.pack_for_cpu(model, path_kernels)
    layer = model[0]
    expected = (layers.PackedQ4KLinear if path_kernels.q4k_mm else
                layers.PackedInt4Linear if path_kernels.int4_mm else layers.AtenInt4Linear)
    assert type(layer) is expected
    stored = layouts.dequantize_q4k(layouts.pack_q4k(*parts))
    for rows in (1, 9, 64):
        x = _activations(rows, 512, dtype, generator)
        exact = x.double() @ stored.double().T + bias.to(dtype).double()
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 112)
        assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02, rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_q5k_layer_computes_the_q5_k_product_on_every_path(path_kernels, dtype):
    """What a GGUF's Q5_K tensor becomes: the q5k kernel where the path has one, else per-row int8 for aten's op;
    both close to the exact product with (d * scale) * q - dmin * minimum."""
    generator = torch.Generator().manual_seed(13)
    _, parts = _q5k_case(1, 112, 512, dtype, seed=13)
    bias = torch.randn(112, generator=generator)
    model = nn.Sequential(layers.Q5KLinear(layouts.pack_q5k(*parts), bias.to(dtype)))
    quant.pack_for_cpu(model, path_kernels)
    layer = model[0]
    assert type(layer) is (layers.PackedQ5KLinear if path_kernels.q5k_mm else layers.Int8Linear)
    stored = layouts.dequantize_q5k(layouts.pack_q5k(*parts))
    for rows in (1, 9, 64):
        x = _activations(rows, 512, dtype, generator)
        exact = x.double() @ stored.double().T + bias.to(dtype).double()
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 112)
        assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02, rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_q6k_layer_computes_the_q6_k_product_on_every_path(path_kernels, dtype):
    """What a GGUF's Q6_K tensor becomes: the q6k kernel where the path has one, else per-row int8 for aten's op;
    both close to the exact product with (d * scale) * (q - 32)."""
    from engine.weights.layers import Q6KLinear

    generator = torch.Generator().manual_seed(13)
    _, parts = _q6k_case(1, 112, 512, dtype, seed=13)
    bias = torch.randn(112, generator=generator)
    model = nn.Sequential(Q6KLinear(layouts.pack_q6k(*parts), bias.to(dtype)))
    quant.pack_for_cpu(model, path_kernels)
    layer = model[0]
    assert type(layer) is (layers.PackedQ6KLinear if path_kernels.q6k_mm else layers.Int8Linear)
    stored = layouts.dequantize_q6k(layouts.pack_q6k(*parts))
    for rows in (1, 9, 64):
        x = _activations(rows, 512, dtype, generator)
        exact = x.double() @ stored.double().T + bias.to(dtype).double()
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 112)
        assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02, rows


def _layer_for(path_kernels, mode: str, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """The layer the engine builds for one nn.Linear with `mode` on this path: quantize, then pack."""
    model = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0]))
    with torch.no_grad():
        model[0].weight.copy_(weight)
        model[0].bias.copy_(bias)
    quant.quantize(model, mode, torch.device("cpu"), dtype)
    model.to(dtype)
    quant.pack_for_cpu(model, path_kernels)
    return model[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_layer_each_path_builds_computes_the_quantized_product(path_kernels, mode, dtype):
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(112, 576, generator=generator) / 24
    bias = torch.randn(112, generator=generator)
    layer = _layer_for(path_kernels, mode, weight, bias, dtype)
    # int8: per 32 values by the q8 kernel; without one, per row for aten's op.
    expected_type = {("int8", True): layers.PackedQ8Linear, ("int8", False): layers.Int8Linear,
                     ("int4", True): layers.PackedInt4Linear, ("int4", False): layers.AtenInt4Linear}
    kernel = path_kernels.q8_mm if mode == "int8" else path_kernels.int4_mm
    assert type(layer) is expected_type[mode, kernel is not None]
    # Against the exact product with the weights the layer stands for (what quantizing the weight gave).
    if mode == "int8" and kernel is not None:
        stored = layouts.dequantize_q8(quant.pack_q8(weight))
    elif mode == "int8":
        int8, scales = quant.quantize_int8(layouts.dequantize_q8(quant.pack_q8(weight)), torch.float32)
        stored = int8.float() * scales[:, None]
    else:
        stored = layouts.dequantize_int4(layouts.pack_int4(*quant.quantize_int4(weight)))
    for rows in (1, 9, 64):
        x = _activations(rows, 576, dtype, generator)
        exact = x.double() @ stored.double().T + bias.to(dtype).double()
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 112)
        relative = ((out.double() - exact).norm() / exact.norm()).item()
        # Measured 0.2-0.8%: int8 activations per block (kernels) or bf16 activations (aten's ops), bf16 output.
        assert relative < 0.02, (rows, relative)


def test_kernels_run_inside_a_compiled_graph(path_kernels):
    q8_mm, int4_mm = require(path_kernels.q8_mm, "q8"), require(path_kernels.int4_mm, "int4")
    x, q, d, m = _int4_case(3, 112, 576, torch.float32)
    _, q8, d8 = _q8_case(3, 112, 576, torch.float32)
    packed_q8, packed4 = layouts.pack_q8(q8, d8), layouts.pack_int4(q, d, m)

    packed_q4 = layouts.pack_q4(q, d)
    _, parts = _q4k_case(3, 112, 512, torch.float32)
    packed_q4k = layouts.pack_q4k(*parts)
    packed_q6k = layouts.pack_q6k(*_q6k_case(3, 112, 512, torch.float32)[1])
    packed_q5k = layouts.pack_q5k(*_q5k_case(3, 112, 512, torch.float32)[1])

    def block(x):
        q4 = path_kernels.q4_mm(x, packed_q4) if path_kernels.q4_mm else 0
        q4k = path_kernels.q4k_mm(x[:, :512], packed_q4k) if path_kernels.q4k_mm else 0
        q6k = path_kernels.q6k_mm(x[:, :512], packed_q6k) if path_kernels.q6k_mm else 0
        q5k = path_kernels.q5k_mm(x[:, :512], packed_q5k) if path_kernels.q5k_mm else 0
        return torch.relu(q8_mm(x, packed_q8)) * 2 + int4_mm(x, packed4) + q4 + q4k + q5k + q6k

    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(x), block(x))


def test_shapes_the_kernels_cannot_take_are_refused_with_a_message(path_kernels):
    q8_mm, int4_mm = require(path_kernels.q8_mm, "q8"), require(path_kernels.int4_mm, "int4")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q8_mm(torch.randn(2, 48), torch.zeros(8, 51, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="K \\* 17 / 16"):
        q8_mm(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="K \\* 160 / 256"):
        int4_mm(torch.randn(2, 64), torch.zeros(8, 30, dtype=torch.uint8))
    if path_kernels.q4_mm is not None:
        with pytest.raises(RuntimeError, match="K \\* 144 / 256"):
            path_kernels.q4_mm(torch.randn(2, 64), torch.zeros(8, 40, dtype=torch.uint8))  # int4's width
    if path_kernels.q4k_mm is not None:  # super-blocks of 256 columns
        with pytest.raises(RuntimeError, match="multiple of 256"):
            path_kernels.q4k_mm(torch.randn(2, 64), torch.zeros(8, 36, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        q8_mm(torch.randn(2, 64).half(), torch.zeros(8, 68, dtype=torch.uint8))


def _bf16_case(rows: int, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(torch.bfloat16)
    x = (torch.randn(rows, k, generator=generator) * torch.logspace(-2, 1, k)).to(torch.bfloat16)
    return x, weight


@pytest.mark.parametrize("rows", [1, 3, 5, 33, 100])
def test_bf16_kernel_is_the_exact_product_rounded_once_and_each_row_is_independent_of_the_batch(path_kernels, rows):
    bf16_mm = require(path_kernels.bf16_mm, "bf16")
    for n, k in [(4, 32), (12, 96), (100, 576), (576, 1536)]:
        x, weight = _bf16_case(rows, n, k, seed=rows)
        packed = layouts.pack_bf16(weight)
        out = bf16_mm(x, packed)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        exact = x.double() @ weight.double().T
        # One rounding to bf16 (half an ulp: 2^-9 relative) plus fp32 accumulation: at most one ulp off.
        error = (out.double() - exact).abs()
        assert (error <= exact.abs() * 2**-8 + 1e-6).all(), (n, k, error.max().item())
        aten_error = (torch.nn.functional.linear(x, weight).double() - exact).abs().max()
        assert error.max() <= aten_error * 1.5 + 1e-6, (n, k)  # as close as aten's own bf16 matmul
        for row in {0, rows // 2, rows - 1}:  # alone, a row gets the same bits as inside any batch
            assert torch.equal(bf16_mm(x[row:row + 1], packed)[0], out[row]), (n, k, row)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 70])
def test_bf16_kernel_without_avx512_bf16_is_its_reference_bit_for_bit(path_kernels, rows):
    """avx2 and avx512 without AVX512-BF16 compute vdpbf16ps's arithmetic in FMAs: both the same bits as
    reference.bf16_matmul (4 rows a pass and every remainder; 70: a second tile of split rows, 64 + 6)."""
    bf16_mm = require(path_kernels.bf16_mm, "bf16")
    if "avx512-bf16" in path_kernels.describe():
        pytest.skip("this CPU multiplies bf16 by vdpbf16ps, whose bits need not follow the SDM's definition")
    for n, k in [(4, 32), (12, 96), (100, 576)]:
        x, weight = _bf16_case(rows, n, k, seed=rows)
        assert torch.equal(bf16_mm(x, layouts.pack_bf16(weight)), reference.bf16_matmul(x, weight)), (n, k)


def test_bf16_layer_runs_inside_a_compiled_graph(path_kernels):
    bf16_mm = require(path_kernels.bf16_mm, "bf16")
    x, weight = _bf16_case(3, 100, 576)
    layer = layers.PackedBf16Linear(layouts.pack_bf16(weight), torch.randn(100).to(torch.bfloat16), bf16_mm)

    def block(x):
        return torch.relu(layer(x)) * 2

    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(x), block(x))
