"""The linear and embedding layers quantization and packing put in a model's place, each with its forward.

Plain layers hold weights in row order and compute with aten (their forward is the fast kernels' twin where one
exists); packed layers hold a copy laid out for one of Tern's CPU kernels (engine/kernels/layouts.py) and the
operator that reads it, chosen once by engine.kernels.select.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import layouts

INT8PACK_MAX_ROWS = 32  # above this many rows (prefill), one GEMM on the dequantized weight beats _weight_int8pack_mm


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scales[:, None]).T + bias, without ever storing the float weight. Computes with
    aten: `_weight_int8pack_mm` for decode-sized batches on CPU, else a matmul on the dequantized weight."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        # For _weight_int8pack_mm, whose inductor lowering wants its scales as a tensor, not a cast; an attribute,
        # not a buffer, so that casting the model to its dtype leaves it bf16.
        self.scales_bf16 = scales.to(torch.bfloat16)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.device.type == "cpu" and rows <= INT8PACK_MAX_ROWS:
            # aten's kernel reads fp32 activations ~10x slower than bf16 ones (431 against 40 us for a
            # 1536x576 matrix on an AVX2 CPU), so fp32 rows go through it in bf16.
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales_bf16)
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.weight_int8.to(x.dtype)) * self.scales.to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int8Embedding(nn.Module):
    """Row lookup of an int8 matrix with one scale per row (the matrix a tied int8 lm_head shares), in row order."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight_int8.shape
        self.padding_idx = padding_idx
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_int8[input_ids].to(self.scales.dtype) * self.scales[input_ids].unsqueeze(-1)


class Int4Linear(nn.Module):
    """4-bit weights, w = d * q + m per 32 values of a row (GGUF's Q4_1), held in layouts.pack_int4's layout.
    Its forward de-quantizes the whole matrix: the slow, plain twin of the kernels, for tests and devices
    without one."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 8 // 5
        self.register_buffer("weight_packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layouts.dequantize_int4(self.weight_packed).to(x.dtype), self.bias)


class Int4Embedding(nn.Module):
    """Row lookup in a 4-bit matrix (layouts.pack_int4's layout): a GGUF's 4-bit token embedding, and the matrix a
    4-bit lm_head is tied to."""

    def __init__(self, weight_packed: torch.Tensor, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight_packed.shape[0], weight_packed.shape[1] * 8 // 5
        self.padding_idx = padding_idx
        self.register_buffer("weight_packed", weight_packed)
        # Empty, cast with the model as float buffers are: the dtype the rows come out in.
        self.register_buffer("out_dtype", torch.empty(0), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return layouts.int4_rows(self.weight_packed, input_ids).to(self.out_dtype.dtype)


class PackedInt4Linear(Int4Linear):
    """Int4Linear multiplied by Tern's 4-bit kernel (activations quantized per 32 values, as llama.cpp's Q8_1)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, matmul: Callable) -> None:
        super().__init__(packed, bias)
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, x.shape[-1]), self.weight_packed)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Q8Linear(nn.Module):
    """int8 weights with one fp16 scale per 32 values of a row, w = d * q (GGUF's Q8_0), held in layouts.pack_q8's
    layout. Its forward de-quantizes the whole matrix: the slow, plain twin of the q8 kernels, for tests."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 16 // 17
        self.register_buffer("weight_packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layouts.dequantize_q8(self.weight_packed).to(x.dtype), self.bias)


class PackedQ8Linear(Q8Linear):
    """Q8Linear multiplied by Tern's q8 kernel (activations quantized per 32 values)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, matmul: Callable) -> None:
        super().__init__(packed, bias)
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, x.shape[-1]), self.weight_packed)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Q8Embedding(nn.Module):
    """Row lookup in a q8 matrix (layouts.pack_q8's layout): a GGUF's Q8_0 token embedding, and the matrix a q8
    lm_head is tied to."""

    def __init__(self, weight_packed: torch.Tensor, padding_idx: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight_packed.shape[0], weight_packed.shape[1] * 16 // 17
        self.padding_idx = padding_idx
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("out_dtype", torch.empty(0, dtype=dtype), persistent=False)  # as Int4Embedding's

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return layouts.q8_rows(self.weight_packed, input_ids).to(self.out_dtype.dtype)


class AtenInt4Linear(nn.Module):
    """Int4Linear for CPUs without Tern's kernel: aten's `_weight_int4pack_mm_for_cpu`, which wants w = (q - 8) *
    scale + zero with scale and zero in the activations' dtype; it runs in bf16 (in fp32 it is ~13x slower)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, d, m = layouts.unpack_int4(packed)
        self.out_features, self.in_features = q.shape
        d, m = d.float(), m.float()
        scales_and_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("weight_int4pack", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight_int4pack, layouts.INT4_GROUP_COLS,
                                                         self.scales_and_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class PackedBf16Linear(nn.Module):
    """y = x @ weight.T + bias in bf16, the weight held in layouts.pack_bf16's layout for Tern's AVX512-BF16 kernel;
    F.linear on the unpacked weight is its eager twin."""

    def __init__(self, weight_packed: torch.Tensor, bias: torch.Tensor | None, matmul: Callable) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_packed.shape
        self.matmul = matmul
        self.register_buffer("weight_packed", weight_packed)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, x.shape[-1]), self.weight_packed)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class PackedBf16Embedding(nn.Module):
    """Row lookup in a bf16 matrix held in pack_bf16's layout: the embedding a PackedBf16Linear lm_head is tied to."""

    def __init__(self, weight_packed: torch.Tensor, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight_packed.shape
        self.padding_idx = padding_idx
        self.register_buffer("weight_packed", weight_packed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return layouts.bf16_rows(self.weight_packed, input_ids)
