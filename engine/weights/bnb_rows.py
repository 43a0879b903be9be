"""The bnb-* modes on a CPU, computed so that a row's output has the same bits in any batch: prompts can then
prefill as decode rows (engine/decode/decode_path.py) and a prompt token's logprob is the one it gets when generated.
The weights stay bitsandbytes' own, quantized by its Int8Params / Params4bit.

bnb-int8 (RowwiseInt8LtLinear). bitsandbytes' LLM.int8() splits x @ W.T into an int8 part and an outlier part: the
columns where an activation reaches the threshold (6.0) are multiplied in floating point, the rest quantized to int8
per row. It picks those columns over the whole batch, so a row's result depends on its neighbours (another row's
outlier moves this row's value in that column from int8 to float), and it adds the outlier part with aten's GEMM,
whose order changes with the batch's shape: prompt and generated logprobs of the default model were 0.4-0.5 nats
apart. Here each row's outliers are its own (what bitsandbytes does for a batch of one row), and every step is exact
or elementwise: the int8 product in integers, the scales per element, and the outlier products added one by one in
column order. The arithmetic follows bitsandbytes' CPU ops (fp16 activations, absmax per row over the non-outliers,
its dequantization constants), except that outliers are summed in float32 before the one rounding to the dtype.

bnb-nf4 / bnb-fp4 in bf16 (Bf16KernelLinear4bit). bitsandbytes de-quantizes the 4-bit weight and multiplies with
aten's bf16 GEMM, whose rows get other bits at another batch size (0.27 nats apart on the default model). Here the
de-quantized weight (bitsandbytes' own values) is multiplied by Tern's bf16 kernel, which gives each row the same
bits in any batch. In float32, aten's GEMM differs only in last bits and the layer stays bitsandbytes'.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.kernels import layouts

# int8 x int8 products summed over at most this many columns stay below 2**24 (127 * 127 * 1040 < 16,777,216), so
# float32 holds every partial sum exactly whatever the order of the additions.
EXACT_FP32_COLUMNS = 1024
# bitsandbytes' int8_mm_dequant constant, its literal: it stands for 1 / 127**2 (6.2000124e-05), one digit
# apart; kept so that a row alone gets bitsandbytes' own int8 part.
INT32_DEQUANT = 6.200124e-05
WEIGHT_DEQUANT = 1.0 / 127  # bitsandbytes' int8_vectorwise_dequant constant


def int8_matmul(a: torch.Tensor, b: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [N, K].T as int32 [M, N], exactly. `use_int_mm`: aten's integer GEMM (fast where the
    CPU has AVX512-VNNI, as bitsandbytes uses it); otherwise float32 GEMMs over column slices whose sums are exact."""
    if use_int_mm:
        return torch._int_mm(a, b.t())
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    for start in range(0, a.shape[1], EXACT_FP32_COLUMNS):
        end = start + EXACT_FP32_COLUMNS
        out += (a[:, start:end].float() @ b[:, start:end].float().t()).to(torch.int32)
    return out


def llm_int8_rows(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                  threshold: float, use_int_mm: bool) -> torch.Tensor:
    """LLM.int8() of x [M, K] against bitsandbytes' int8 weight [N, K] and its per-row absmax scales [N], with each
    row's outliers its own; [M, N] in x's dtype."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight_int8.shape[0])
    x16 = x.to(torch.float16)  # bitsandbytes quantizes fp16 activations
    # A threshold of 0 turns the decomposition off, as in bitsandbytes.
    outliers = x16.abs() >= threshold if threshold > 0 else torch.zeros_like(x16, dtype=torch.bool)
    inliers = x16.masked_fill(outliers, 0)
    row_scale = inliers.abs().amax(dim=1).float()
    # An all-outlier (or all-zero) row has no inlier scale: its int8 part is zero, not 0 * inf.
    x_int8 = torch.round(inliers * (127.0 / row_scale.clamp(min=1e-30)).unsqueeze(1)).to(torch.int8)
    out = int8_matmul(x_int8, weight_int8, use_int_mm).float()
    out = out * (row_scale.unsqueeze(1) * weight_scale.unsqueeze(0)) * INT32_DEQUANT
    if bias is not None:
        out = out + bias.float()
    rows, columns = torch.nonzero(outliers, as_tuple=True)  # row-major: each row's columns in ascending order
    if rows.numel():
        per_row = outliers.sum(dim=1)
        rank = torch.arange(rows.numel(), device=x.device) - (per_row.cumsum(0) - per_row)[rows]
        # The outlier columns' weights, each de-quantized once however many rows share it, as bitsandbytes
        # de-quantizes them (in x's dtype): [columns used, N].
        used, slot = torch.unique(columns, return_inverse=True)
        weights = (weight_int8[:, used].float() * weight_scale.unsqueeze(1) * WEIGHT_DEQUANT).to(x.dtype).float().t()
        # Step k adds every row's k-th outlier product: each row its own columns, in column order, so a row's
        # additions are the same in any batch. Multiply and add are separate elementwise ops (never fused or reduced).
        for k in range(int(per_row.max())):
            at = rank == k
            row = rows[at]
            out[row] = out[row] + x[row, columns[at]].float().unsqueeze(1) * weights[slot[at]]
    return out.to(x.dtype)


class RowwiseInt8LtLinear(nn.Module):
    """A bitsandbytes Linear8bitLt's weights with LLM.int8() computed per row (llm_int8_rows): the bnb-int8 layer on
    CPUs. Holds the int8 matrix and scales as buffers; `use_int_mm` picks the integer GEMM (same bits either way)."""

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 threshold: float, use_int_mm: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.threshold, self.use_int_mm = threshold, use_int_mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = llm_int8_rows(x.reshape(-1, self.in_features), self.weight_int8, self.weight_scale, self.bias,
                            self.threshold, self.use_int_mm)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, threshold={self.threshold}, "
                f"int8 GEMM={'aten _int_mm' if self.use_int_mm else 'exact float32 slices'}")


class Bf16KernelLinear4bit(nn.Module):
    """A bitsandbytes Linear4bit (NF4 or FP4) in bf16 whose product is Tern's bf16 kernel: each call de-quantizes the
    weight as bitsandbytes does (its quant_state, double quantization included), lays it out for the kernel and
    multiplies. Holds bitsandbytes' parameter itself, so the weight bytes and their accounting stay its own."""

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None, bf16_mm: Callable) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.quant_state.shape
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.matmul = bf16_mm
        import bitsandbytes.functional  # loaded already: the layer's weight is one of its parameters

        self.dequantize = bitsandbytes.functional.dequantize_4bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dequantize(self.weight.data, self.weight.quant_state).to(torch.bfloat16)
        out = self.matmul(x.reshape(-1, self.in_features).to(torch.bfloat16), layouts.pack_bf16(weight))
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
