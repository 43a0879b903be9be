"""The bnb modes on a CPU (engine/weights/bnb_rows.py) give a row the same bits in any batch. bnb-int8: LLM.int8()
computed row by row, which bitsandbytes' own layer does not do (it picks outlier columns over the batch), while a row
alone gets what bitsandbytes gives it, and its int8 GEMM is exact both ways of computing it. bnb-nf4/fp4 in bf16:
bitsandbytes' de-quantized weight through Tern's bf16 kernel."""
from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.config import default_cache_dir
from engine.weights import bnb, quant
from engine.weights.bnb_rows import EXACT_FP32_COLUMNS, Bf16KernelLinear4bit, RowwiseInt8LtLinear, int8_matmul

CPU = torch.device("cpu")


def skip_without_bitsandbytes(dtype: torch.dtype) -> None:
    reason = quant.unsupported_reason("bnb-int8", CPU, dtype)
    if reason:
        pytest.skip(reason)


def activations(rows: int, columns: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of ~N(0, 1), a few of them with outliers (|x| >= 6) in columns the others leave small."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=generator)
    x[::5, 7] = 9.0
    x[2, 100] = -12.0
    x[3, [1, 2, 40]] = torch.tensor([6.5, -7.0, 30.0])
    return x.to(dtype)


def bnb_and_rowwise(out_features: int, in_features: int, dtype: torch.dtype, use_int_mm: bool):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) * 0.1
    reference = bnb.bnb_layer(weight, bias, "bnb-int8", dtype, double_quant=False).to(CPU).eval()
    rowwise = bnb.row_exact_layer(reference, None)
    rowwise.use_int_mm = use_int_mm
    return reference, rowwise


@pytest.mark.parametrize("use_int_mm", [True, False], ids=["int_mm", "fp32-slices"])
@pytest.mark.parametrize("columns", [96, EXACT_FP32_COLUMNS * 2 + 64])
def test_the_int8_gemm_is_exact_both_ways(use_int_mm, columns):
    """Integers: aten's _int_mm, or float32 GEMMs over slices short enough that no partial sum passes 2**24 (one
    float32 GEMM over 2,112 columns of 127s would round: 127 * 127 * 2112 > 2**25)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (5, columns), generator=generator, dtype=torch.int8)
    b = torch.randint(-127, 128, (24, columns), generator=generator, dtype=torch.int8)
    a[0], b[0] = 127, 127  # the largest sum there is
    expected = a.long() @ b.long().t()
    assert torch.equal(int8_matmul(a, b, use_int_mm).long(), expected)
    assert expected[0, 0] == 127 * 127 * columns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_int_mm", [True, False], ids=["int_mm", "fp32-slices"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(dtype, use_int_mm):
    skip_without_bitsandbytes(dtype)
    reference, rowwise = bnb_and_rowwise(48, 128, dtype, use_int_mm)
    x = activations(20, 128, dtype)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        batch = rowwise(x)
        alone = torch.cat([rowwise(x[i:i + 1]) for i in range(20)])
        shuffled = rowwise(x[order])
        bnb_batch = reference(x)
        bnb_alone = torch.cat([reference(x[i:i + 1]) for i in range(20)])
    assert torch.equal(batch, alone)
    assert torch.equal(shuffled, batch[order])
    # What the row-by-row computation is for: bitsandbytes' own layer moves the rows without outliers when a
    # neighbour has one (the columns it picks over the batch go to float for every row).
    assert not torch.equal(bnb_batch, bnb_alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_gets_what_bitsandbytes_gives_it(dtype):
    """Alone, a row's outliers are its batch's: bitsandbytes' own result, but for the outlier sum, which is in
    float32 and added before the one rounding to `dtype` (bitsandbytes adds it after, in `dtype`)."""
    skip_without_bitsandbytes(dtype)
    reference, rowwise = bnb_and_rowwise(48, 128, dtype, use_int_mm=False)
    x = activations(20, 128, dtype)
    with torch.inference_mode():
        ours = torch.cat([rowwise(x[i:i + 1]) for i in range(20)]).float()
        theirs = torch.cat([reference(x[i:i + 1]) for i in range(20)]).float()
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22  # a rounding of each dtype, relative
    assert ((ours - theirs).abs() <= step * theirs.abs().clamp(min=1)).all()
    no_outliers = (x.float().abs() < 6).all(dim=1)
    assert torch.equal(ours[no_outliers], theirs[no_outliers])  # the int8 part is bitsandbytes' to the bit


def test_bnb_int8_on_a_cpu_serves_the_rowwise_layer_with_bitsandbytes_weights():
    skip_without_bitsandbytes(torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64))
    plain = [layer.weight.detach().clone() for layer in model]
    quant.quantize(model, "bnb-int8", CPU, torch.float32)
    quant.pack_for_cpu(model, kernels.select(default_cache_dir()))
    assert all(isinstance(layer, RowwiseInt8LtLinear) for layer in model)
    for layer, weight in zip(model, plain):
        assert layer.weight_int8.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
        # bitsandbytes' quantization of the weight: its fp16 rounding's absmax per row, 127 levels
        assert torch.equal(layer.weight_scale, weight.half().abs().amax(dim=1).float())
        assert (layer.weight_int8.float() * layer.weight_scale[:, None] / 127 - weight).abs().max() <= \
            weight.abs().amax() / 127



@pytest.mark.parametrize("mode", ["bnb-nf4", "bnb-fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_4bit_in_bf16_multiplies_bitsandbytes_weights_in_the_bf16_kernel_alike_in_any_batch(mode, double_quant):
    skip_without_bitsandbytes(torch.bfloat16)
    cpu = kernels.select(default_cache_dir())
    if cpu.bf16_mm is None:
        pytest.skip(f"kernel path {cpu.path} has no bf16 kernel: bitsandbytes' own layer serves")
    generator = torch.Generator().manual_seed(3)
    # 64 rows: on CPUs with AVX512-BF16, bitsandbytes' own layer repacks its weights at the first call and needs
    # rows in multiples of 32.
    weight = torch.randn(64, 128, generator=generator) * 0.05
    bias = (torch.randn(64, generator=generator) * 0.1).to(torch.bfloat16)
    reference = bnb.bnb_layer(weight, bias, mode, torch.bfloat16, double_quant).to(CPU).eval()
    layer = bnb.row_exact_layer(reference, cpu.bf16_mm)
    assert isinstance(layer, Bf16KernelLinear4bit)
    x = activations(20, 128, torch.bfloat16)
    with torch.inference_mode():
        batch = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(20)])
        import bitsandbytes.functional as bnb_functional
        # De-quantized before bitsandbytes' first call, which may repack the weights in place.
        exact = x.float() @ bnb_functional.dequantize_4bit(reference.weight.data, reference.weight.quant_state).float().t()
        theirs = reference(x).float()
    assert batch.dtype == torch.bfloat16 and torch.equal(batch, alone)
    # Both products of the same de-quantized weights: each within bf16's roundings of the float32 product.
    exact = exact + bias.float()
    for result in (batch.float(), theirs):
        assert ((result - exact).abs() <= 2.0 ** -7 * exact.abs() + 0.02).all()


def test_an_empty_batch_and_a_threshold_of_zero():
    """No rows give no rows; a threshold of 0 turns the outlier decomposition off (bitsandbytes' meaning), so even
    activations of 30 go through int8: the product of the de-quantized operands, to float32 rounding."""
    generator = torch.Generator().manual_seed(4)
    weight_int8 = torch.randint(-127, 128, (16, 128), generator=generator, dtype=torch.int8)
    weight_scale = torch.rand(16, generator=generator) + 0.5
    layer = RowwiseInt8LtLinear(weight_int8, weight_scale, None, threshold=0.0, use_int_mm=False)
    assert layer(torch.randn(0, 128)).shape == (0, 16)
    x = activations(6, 128, torch.float32)
    row_scale = x.half().abs().amax(dim=1).float()
    x_int8 = torch.round(x.half() * (127.0 / row_scale[:, None])).to(torch.int8)
    expected = (x_int8.double() * row_scale[:, None] / 127) @ (weight_int8.double() * weight_scale[:, None] / 127).t()
    assert torch.allclose(layer(x).double(), expected, rtol=1e-4, atol=1e-4)
