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
from engine.weights.bnb_rows import Bf16KernelLinear4bit, RowwiseInt8LtLinear

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


class _BlockLinear(nn.Module):
    """A weight in one of the block layouts (layouts.pack_int4, pack_q8: 8 rows and 32 columns a block, scales
    inside), with its plain forward: de-quantize the whole matrix and multiply, the slow twin of the kernels, for
    tests and devices without them. `PACKED_BYTES` is (bytes, values): a row of K values takes K * bytes / values."""

    PACKED_BYTES: tuple[int, int]
    LAYOUT: str  # the layout's name in engine/kernels/layouts.py and in the logs
    dequantize: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        size, values = self.PACKED_BYTES
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * values // size
        self.register_buffer("weight_packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(self.weight_packed).to(x.dtype), self.bias)


class _KernelForward:
    """The forward of a packed layer: Tern's kernel for the layout, given at construction (engine.kernels)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, matmul: Callable) -> None:
        super().__init__(packed, bias)
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, x.shape[-1]), self.weight_packed)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(_BlockLinear):
    """4-bit weights, w = d * q + m per 32 values of a row (GGUF's Q4_1), held in layouts.pack_int4's layout."""

    PACKED_BYTES = (5, 8)
    LAYOUT = "int4"
    dequantize = staticmethod(layouts.dequantize_int4)


class PackedInt4Linear(_KernelForward, Int4Linear):
    """Int4Linear multiplied by Tern's 4-bit kernel (activations quantized per 32 values, as llama.cpp's Q8_1)."""


class Q4Linear(_BlockLinear):
    """4-bit weights with one fp16 scale per 32 values of a row and no minimum, w = d * (q - 8) (GGUF's Q4_0), held
    in layouts.pack_q4's layout: a Q4_0 file's own bytes per value, 10% fewer than Int4Linear's."""

    PACKED_BYTES = (9, 16)
    LAYOUT = "q4"
    dequantize = staticmethod(layouts.dequantize_q4)


class PackedQ4Linear(_KernelForward, Q4Linear):
    """Q4Linear multiplied by Tern's q4 kernel (activations quantized per 32 values: llama.cpp's Q4_0 x Q8_0)."""


class Q4KLinear(_BlockLinear):
    """4-bit weights in GGUF's Q4_K form, (d * scale) * q - dmin * min with a 6-bit scale and minimum per 32 values
    and fp16 d and dmin per 256, held in layouts.pack_q4k's layout: a Q4_K file's own bytes and values."""

    PACKED_BYTES = (9, 16)
    LAYOUT = "q4k"
    dequantize = staticmethod(layouts.dequantize_q4k)


class PackedQ4KLinear(_KernelForward, Q4KLinear):
    """Q4KLinear multiplied by Tern's q4k kernel (llama.cpp's Q4_K x Q8_K: activations quantized per 256 values, each
    super-block's scales and minimums applied in integers)."""


class Q5KLinear(_BlockLinear):
    """5-bit weights in GGUF's Q5_K form, (d * scale) * q - dmin * min as Q4_K's with q in 0..31, held in
    layouts.pack_q5k's layout: a Q5_K file's own bytes and values."""

    PACKED_BYTES = (11, 16)
    LAYOUT = "q5k"
    dequantize = staticmethod(layouts.dequantize_q5k)


class PackedQ5KLinear(_KernelForward, Q5KLinear):
    """Q5KLinear multiplied by Tern's q5k kernel (llama.cpp's Q5_K x Q8_K: activations quantized per 256 values,
    each super-block's scales and minimums applied in integers)."""


class Q6KLinear(_BlockLinear):
    """6-bit weights in GGUF's Q6_K form, (d * scale) * (q - 32) with an int8 scale per 16 values and an fp16 d per
    256, held in layouts.pack_q6k's layout: a Q6_K file's own bytes and values."""

    PACKED_BYTES = (105, 128)
    LAYOUT = "q6k"
    dequantize = staticmethod(layouts.dequantize_q6k)


class PackedQ6KLinear(_KernelForward, Q6KLinear):
    """Q6KLinear multiplied by Tern's q6k kernel (llama.cpp's Q6_K x Q8_K: activations quantized per 256 values,
    each super-block's scales applied in integers)."""


class Q8Linear(_BlockLinear):
    """int8 weights with one fp16 scale per 32 values of a row, w = d * q (GGUF's Q8_0), held in layouts.pack_q8's
    layout."""

    PACKED_BYTES = (17, 16)
    LAYOUT = "q8"
    dequantize = staticmethod(layouts.dequantize_q8)


class PackedQ8Linear(_KernelForward, Q8Linear):
    """Q8Linear multiplied by Tern's q8 kernel (activations quantized per 32 values, as llama.cpp's Q8_0)."""


class SplitLinear(nn.Module):
    """A fused projection (qkv, gate/up) whose parts a file holds in different layouts, e.g. a Q4_K_M file's q and k
    in Q4_K beside v in Q6_K: each run of parts in its own layer and bytes (one layout for all would widen the 4-bit,
    5-bit and 6-bit ones to q8), the outputs side by side. The native decode step runs the parts into one output."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


class _BlockEmbedding(nn.Module):
    """Row lookup in a block-layout matrix: a GGUF's 4-bit or Q8_0 token embedding, and the matrix a block-layout
    lm_head is tied to. `rows` reads rows `ids` of the layout as float32."""

    PACKED_BYTES: tuple[int, int]
    LAYOUT: str
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(self, weight_packed: torch.Tensor, padding_idx: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        size, values = self.PACKED_BYTES
        self.num_embeddings, self.embedding_dim = weight_packed.shape[0], weight_packed.shape[1] * values // size
        self.padding_idx = padding_idx
        self.register_buffer("weight_packed", weight_packed)
        # Empty, cast with the model as float buffers are: the dtype the rows come out in.
        self.register_buffer("out_dtype", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.tern.block_embedding_rows(self.weight_packed, input_ids, self.LAYOUT).to(self.out_dtype.dtype)


class Int4Embedding(_BlockEmbedding):
    PACKED_BYTES = Int4Linear.PACKED_BYTES
    LAYOUT = Int4Linear.LAYOUT
    rows = staticmethod(layouts.int4_rows)


class Q4Embedding(_BlockEmbedding):
    PACKED_BYTES = Q4Linear.PACKED_BYTES
    LAYOUT = Q4Linear.LAYOUT
    rows = staticmethod(layouts.q4_rows)


class Q4KEmbedding(_BlockEmbedding):
    PACKED_BYTES = Q4KLinear.PACKED_BYTES
    LAYOUT = Q4KLinear.LAYOUT
    rows = staticmethod(layouts.q4k_rows)


class Q5KEmbedding(_BlockEmbedding):
    PACKED_BYTES = Q5KLinear.PACKED_BYTES
    LAYOUT = Q5KLinear.LAYOUT
    rows = staticmethod(layouts.q5k_rows)


class Q6KEmbedding(_BlockEmbedding):
    PACKED_BYTES = Q6KLinear.PACKED_BYTES
    LAYOUT = Q6KLinear.LAYOUT
    rows = staticmethod(layouts.q6k_rows)


class Q8Embedding(_BlockEmbedding):
    PACKED_BYTES = Q8Linear.PACKED_BYTES
    LAYOUT = Q8Linear.LAYOUT
    rows = staticmethod(layouts.q8_rows)


_BLOCK_EMBEDDINGS = {cls.LAYOUT: cls for cls in (Int4Embedding, Q4Embedding, Q4KEmbedding, Q5KEmbedding, Q6KEmbedding,
                                                   Q8Embedding)}


# An opaque op to torch.compile: traced into the compiled decode step, the lookup's byte gathers made index
# expressions that inductor's C++ code generation simplified with sympy for minutes (108 s of a 272 s compile of
# the tiny bf16 int8 model, at a batch of 34 on a 2-core Zen 3). Called as an op, the step runs the eager lookup.
@torch.library.custom_op("tern::block_embedding_rows", mutates_args=())
def block_embedding_rows(packed: torch.Tensor, ids: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows `ids` of a block-layout matrix (`layout`: a _BlockEmbedding's LAYOUT) as float32 [*ids.shape, K]."""
    return _BLOCK_EMBEDDINGS[layout].rows(packed, ids)


@block_embedding_rows.register_fake
def _(packed: torch.Tensor, ids: torch.Tensor, layout: str) -> torch.Tensor:
    size, values = _BLOCK_EMBEDDINGS[layout].PACKED_BYTES
    return packed.new_empty(*ids.shape, packed.shape[1] * values // size, dtype=torch.float32)


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


def computes_each_row_alone(model: nn.Module) -> bool:
    """Whether every matmul of `model` gives a row of activations the same bits in any batch: true of Tern's kernel
    layers (each output one fixed chain over its row, activations quantized per row) and of the bnb modes' twins
    built on them (engine/weights/bnb_rows.py), not of aten's GEMMs, whose blocking and reduction order change with the
    number of rows. One exception: an output head left in float32 (the bnb modes keep it unquantized, as
    transformers does) changes a logit in its last bits only, with no layer after it to grow the difference."""
    kernel_layers = (_KernelForward, PackedBf16Linear, RowwiseInt8LtLinear, Bf16KernelLinear4bit)
    aten_layers = (nn.Linear, Int8Linear, AtenInt4Linear, _BlockLinear)  # bnb's layers are nn.Linear subclasses
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, aten_layers) and not isinstance(module, kernel_layers):
            if module is head and type(module) is nn.Linear and module.weight.dtype == torch.float32:
                continue
            return False
    return True
