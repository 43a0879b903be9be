"""Swap nn.Linear for int8 / int4 / bitsandbytes layers after loading, then pack them for the CPU kernels; detect
what this machine supports (bitsandbytes' layers: engine/weights/bnb.py; bytes and parameters: sizes.py).

Modes (EngineConfig.quantization):
- `int8`: on a CPU, int8 weights with one fp16 scale per 32 values of a row (GGUF's Q8_0, layouts.pack_q8:
  per-row scales cost the default model 4% of perplexity, these 0.x%); elsewhere, and for shapes that layout
  cannot hold, one scale per output channel. The embedding is quantized too, and a tied lm_head shares that
  matrix: on SmolLM2 the tied 49152x576 matrix is 21% of the parameters, and leaving it in bf16 would keep the
  weights at ~61% of bf16.
- `int4`: 4-bit weights with a scale and a minimum per 32 values of a row (GGUF's Q4_1: w = d * q + m, fp16 d
  and m), for every linear layer but the lm_head; the embedding and lm_head are int8 as in `int8`. A checkpoint
  converted from a Q4_1 GGUF (the default model) gets its own 4-bit values back, exactly.
- `bnb-int8` (LLM.int8(), outlier threshold 6.0), `bnb-nf4`, `bnb-fp4` (blocksize 64, compute dtype = the
  engine dtype, optional double quantization): bitsandbytes layers, as transformers' BitsAndBytesConfig builds
  them. Like transformers, they leave lm_head and the embedding unquantized. On a CPU, pack_for_cpu gives them
  twins whose rows get the same bits in any batch (engine/weights/bnb_rows.py).
- `auto` (the server's default), decided by `resolve_mode`: on CPU, `int4` where the weights are 4-bit already
  (every linear layer's values round-trip through it exactly, as a converted Q4_1 GGUF's do) and the CPU takes
  the AVX2 path, `int8` otherwise (AVX512 CPUs: its VNNI kernel is the measured fast path there); `none` on CUDA.
Fused projections (qkv_proj, gate_up_proj) quantize per output row (LLM.int8(), per-row int8) or in blocks along
rows (q8, 4-bit), so fusing before quantizing changes nothing.

`pack_for_cpu` is the step after: it swaps each layer whose shape fits for its packed twin (engine/weights/layers.py)
holding the operator of the kernel path chosen for this process (engine.kernels.select): q8, int4 and q4 layers
(q4: a GGUF's Q4_0 tensors, engine/weights/gguf_blocks.py), and bf16 ones (the unquantized mode in bf16, the bnb
modes' lm_head) on every kernel path. On a CPU it also gives bitsandbytes' layers twins whose rows get the same
bits in any batch (engine/weights/bnb_rows.py: LLM.int8() row by row, 4-bit weights through the bf16 kernel).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.config import QUANTIZATIONS
from engine.errors import ModelLoadError
from engine.kernels import CpuKernels, layouts
from engine.weights import bnb
from engine.weights.bnb import BNB_MODES
from engine.weights.layers import (
    AtenInt4Linear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    PackedBf16Embedding,
    PackedBf16Linear,
    PackedInt4Linear,
    PackedQ4KLinear,
    PackedQ4Linear,
    PackedQ5KLinear,
    PackedQ6KLinear,
    PackedQ8Linear,
    Q4KLinear,
    Q4Linear,
    Q5KEmbedding,
    Q5KLinear,
    Q6KEmbedding,
    Q6KLinear,
    Q8Embedding,
    Q8Linear,
)

logger = logging.getLogger(__name__)

MODES = tuple(mode for mode in QUANTIZATIONS if mode != "auto")  # what `auto` resolves to is one of these
KERNEL_MODES = ("auto", "int8", "int4")  # modes whose layers on a CPU are Tern's int8/int4 (quantized from fp32 values)
INT4_GROUP = layouts.INT4_GROUP_COLS


def resolve_mode(mode: str, device: torch.device, model: nn.Module, kernels: CpuKernels) -> str:
    """The mode `auto` stands for with this model on this device and kernel path; any other mode as it is."""
    if mode != "auto":
        return mode
    if device.type != "cpu":
        return "none"
    if kernels.path == "avx2" and is_4bit_already(model):
        return "int4"  # no loss: the same values, in 30% fewer bytes than int8 and faster
    return "int8"


def is_4bit_already(model: nn.Module) -> bool:
    """Whether every linear layer but the lm_head holds values that int4 stores exactly (a de-quantized Q4_1)."""
    head = _output_head(model)
    for _, _, child in _linear_children(model):
        if child is head:
            continue
        weight = _linear_weight(child)[0].detach()
        if not layouts.can_pack_int4(weight.cpu()):
            return False
        q, d, m = quantize_int4(weight)
        if not torch.equal(layouts.dequantize_int4(layouts.pack_int4(q, d, m)), weight.float()):
            return False
    return True


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row (output channel) absmax int8: returns (int8 [N, K], scales [N] in `dtype`)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    weight_int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return weight_int8.contiguous(), scales.to(dtype)


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 per 32 values of a row: (q int8 [N, K] in -127..127, d fp16 [N, K/32]), w ~ d * q. The step is rounded
    to fp16 first and q computed from it, so a de-quantized Q8_0 block whose largest |q| is 127 gets its own back."""
    rows, cols = weight.shape
    blocks = weight.detach().float().reshape(rows, cols // layouts.Q8_GROUP_COLS, layouts.Q8_GROUP_COLS)
    step = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)
    safe_step = torch.where(step > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
    q = torch.round(blocks / safe_step.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(rows, cols), step


def pack_q8(weight: torch.Tensor) -> torch.Tensor:
    """A float matrix quantized (quantize_q8) into layouts.pack_q8's layout."""
    return layouts.pack_q8(*quantize_q8(weight))


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The `int8` mode's layer: per-32 scales (Q8Linear) on a CPU where the shape fits, else per-row (Int8Linear)."""
    if layouts.can_pack_q8(weight):
        return Q8Linear(pack_q8(weight), bias)
    return Int8Linear(*quantize_int8(weight, dtype), bias)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 per 32 values of a row: (q uint8 [N, K] in 0..15, d fp16 [N, K/32], m fp16 [N, K/32]), w ~ d * q + m.
    The minimum and the step are rounded to fp16 first and q computed from them, so a block that already holds
    16 evenly spaced levels (a de-quantized Q4_1 block) gets its own q, d and m back."""
    rows, cols = weight.shape
    blocks = weight.detach().float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    minimum = blocks.amin(dim=-1).to(torch.float16)
    step = ((blocks.amax(dim=-1) - minimum.float()) / 15).to(torch.float16)
    safe_step = torch.where(step > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
    q = torch.round((blocks - minimum.float().unsqueeze(-1)) / safe_step.unsqueeze(-1)).clamp(0, 15)
    q = torch.where(step.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return q.to(torch.uint8).reshape(rows, cols), step, minimum


def pack_int4(weight: torch.Tensor) -> torch.Tensor:
    """A float matrix quantized (quantize_int4) into layouts.pack_int4's layout."""
    return layouts.pack_int4(*quantize_int4(weight))


# A float matrix into a kernel layout's bytes, by the layout's name (GGUF_REPACK_LAYOUTS' names): what the kernel
# library's repacking of float rows matches byte for byte.
PACK_FROM_FLOAT = {"q8": pack_q8, "int4": pack_int4}


def unsupported_reason(mode: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str | None:
    """None when `mode` runs on this machine, else one line naming what is missing."""
    if mode not in MODES:
        return f"unknown quantization {mode!r}; choose one of {', '.join(MODES)}"
    if mode == "int4" and device.type != "cpu":
        return "--quantization int4 runs on CPUs (Tern's kernel or aten's int4pack); on CUDA use bnb-nf4"
    if mode not in BNB_MODES:
        return None
    return bnb.unsupported_reason(mode, device, dtype)


def check_supported(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ModelLoadError (one line naming what is missing) when `mode` cannot run here."""
    reason = unsupported_reason(mode, device, dtype)
    if reason:
        raise ModelLoadError(reason)


def quantize(model: nn.Module, mode: str, device: torch.device, dtype: torch.dtype, double_quant: bool = False) -> None:
    """Replace the model's linear layers in place with plain quantized ones (after loading and fusing); raise
    ModelLoadError if `mode` cannot run here. `dtype` is the activation/compute dtype; `double_quant` applies to
    the bnb 4-bit modes. `none` changes nothing."""
    if mode == "none":
        return
    check_supported(mode, device, dtype)
    head, embedding = _output_head(model), _input_embedding(model)
    for parent, name, child in _linear_children(model):
        if child is head:
            # bnb modes keep it in the model dtype, as transformers' BitsAndBytesConfig does (parity); int8 and
            # int4 quantize it to int8 below, together with the embedding it may be tied to.
            continue
        weight, bias = _linear_weight(child)
        bias = None if bias is None else bias.detach().to(dtype)
        if mode == "int4" and layouts.can_pack_int4(weight):
            new = Int4Linear(layouts.pack_int4(*quantize_int4(weight)), bias)
        elif mode in ("int8", "int4"):  # int4: a shape the 4-bit layout cannot hold (rows not in 8s, columns not in 32s)
            new = _int8_linear(weight, bias, dtype)
        else:
            new = bnb.bnb_layer(weight, bias, mode, dtype, double_quant)
        setattr(parent, name, new.to(device).eval())
    if mode in ("int8", "int4"):
        _quantize_head_and_embedding(model, head, embedding, dtype, device)


def pack_for_cpu(model: nn.Module, kernels: CpuKernels) -> None:
    """Swap every plain q8 / int4 / q4 / q4k / q5k / q6k layer (and, where the path has a bf16 kernel, every bf16
    nn.Linear) whose shape fits for its packed twin holding `kernels`' operator; without a kernel, 4-bit layers go
    to aten's int4pack and q8, q5k and q6k ones to per-row int8 for aten's int8pack. bitsandbytes' layers become
    bnb.row_exact_layer's where it has one (after the model's cast to its dtype: LLM.int8()'s scales stay fp32).
    Tied layers keep sharing one matrix. Logs how many matrices each kernel serves."""
    counts: dict[str, int] = {}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    bf16_packed: dict[int, torch.Tensor] = {}  # data_ptr of a bf16 weight -> its packed copy
    per_row: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(q8 matrix) -> its per-row int8 (no q8 kernel)
    for parent, name, child in [(p, n, c) for p in model.modules() for n, c in p.named_children()]:
        new = None
        if type(child) is Q8Linear and kernels.q8_mm:
            new = PackedQ8Linear(child.weight_packed, child.bias, kernels.q8_mm)
        elif type(child) is Q8Linear:  # no q8 kernel: per-row int8 for aten's op (coarser scales, but fast)
            key = id(child.weight_packed)
            if key not in per_row:
                per_row[key] = quantize_int8(layouts.dequantize_q8(child.weight_packed), dtype)
            new = Int8Linear(*per_row[key], child.bias)
        elif type(child) is Int4Linear and child.weight_packed.device.type == "cpu":
            new = (PackedInt4Linear(child.weight_packed, child.bias, kernels.int4_mm) if kernels.int4_mm
                   else AtenInt4Linear(child.weight_packed, child.bias))
        elif type(child) is Q4Linear and child.weight_packed.device.type == "cpu":
            new = (PackedQ4Linear(child.weight_packed, child.bias, kernels.q4_mm) if kernels.q4_mm
                   else AtenInt4Linear(layouts.q4_as_int4(child.weight_packed), child.bias))
        elif type(child) is Q4KLinear and child.weight_packed.device.type == "cpu":
            if kernels.q4k_mm:
                new = PackedQ4KLinear(child.weight_packed, child.bias, kernels.q4k_mm)
            else:  # the int4 kernel or aten's int4pack, its scales rounded to fp16 (a GGUF load puts Q4_K in int4 here)
                as_int4 = layouts.q4k_as_int4(child.weight_packed)
                new = (PackedInt4Linear(as_int4, child.bias, kernels.int4_mm) if kernels.int4_mm
                       else AtenInt4Linear(as_int4, child.bias))
        elif type(child) in (Q5KLinear, Q6KLinear):
            packed, kernel = ((PackedQ5KLinear, kernels.q5k_mm) if type(child) is Q5KLinear
                              else (PackedQ6KLinear, kernels.q6k_mm))
            if kernel:
                new = packed(child.weight_packed, child.bias, kernel)
            else:  # no kernel for the layout: per-row int8 for aten's op, as q8 without its kernel
                key = id(child.weight_packed)
                if key not in per_row:
                    per_row[key] = quantize_int8(child.dequantize(child.weight_packed), dtype)
                new = Int8Linear(*per_row[key], child.bias)
        elif (row_exact := bnb.row_exact_layer(child, kernels.bf16_mm)) is not None:
            new = row_exact
        elif (type(child) is nn.Linear and kernels.bf16_mm and child.weight.dtype == torch.bfloat16
              and layouts.can_pack_bf16(child.weight)):
            key = child.weight.data_ptr()
            if key not in bf16_packed:
                bf16_packed[key] = layouts.pack_bf16(child.weight.detach().contiguous())
            new = PackedBf16Linear(bf16_packed[key], None if child.bias is None else child.bias.detach(),
                                   kernels.bf16_mm)
        if new is not None:
            setattr(parent, name, new)
            counts[type(new).__name__] = counts.get(type(new).__name__, 0) + 1
    embedding = _input_embedding(model)
    block_embedding = isinstance(embedding, (Q8Embedding, Q5KEmbedding, Q6KEmbedding))
    if block_embedding and id(embedding.weight_packed) in per_row:  # tied: one matrix still
        _replace(model, embedding, Int8Embedding(*per_row[id(embedding.weight_packed)], embedding.padding_idx))
    if isinstance(embedding, nn.Embedding) and embedding.weight.data_ptr() in bf16_packed:
        _replace(model, embedding, PackedBf16Embedding(bf16_packed[embedding.weight.data_ptr()], embedding.padding_idx))
    if counts:
        logger.info("packed for the %s kernels: %s", kernels.path,
                    ", ".join(f"{n} {name}" for name, n in sorted(counts.items())))


def _quantize_head_and_embedding(model, head, embedding, dtype, device) -> None:
    """int8 for the embedding rows and the lm_head, per 32 values where the layout fits (as `_int8_linear`); one
    shared matrix when they are tied."""
    if embedding is not None and isinstance(embedding, nn.Embedding):
        tied = head is not None and _linear_weight(head)[0].data_ptr() == embedding.weight.data_ptr()
        bias = None if not tied or head.bias is None else head.bias.detach().to(dtype)
        if layouts.can_pack_q8(embedding.weight):
            packed = pack_q8(embedding.weight)
            new_embedding, new_head = Q8Embedding(packed, embedding.padding_idx, dtype), Q8Linear(packed, bias)
        else:
            weight_int8, scales = quantize_int8(embedding.weight, dtype)
            new_embedding = Int8Embedding(weight_int8, scales, embedding.padding_idx)
            new_head = Int8Linear(weight_int8, scales, bias)
        _replace(model, embedding, new_embedding.to(device))
        if tied:
            _replace(model, head, new_head.to(device))
            return
    if head is not None:
        weight, bias = _linear_weight(head)
        new_head = _int8_linear(weight, None if bias is None else bias.detach().to(dtype), dtype)
        _replace(model, head, new_head.to(device))


def _linear_children(model: nn.Module):
    """(parent, attribute name, layer) for every nn.Linear or transformers Conv1D (GPT-2 style) in the model."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear or _is_conv1d(child):
                found.append((parent, name, child))
    return found


def _linear_weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias) of an nn.Linear, or of a Conv1D, whose weight is stored [in, out]."""
    weight = layer.weight.t() if _is_conv1d(layer) else layer.weight
    return weight, layer.bias


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def _output_head(model: nn.Module) -> nn.Module | None:
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    return head


def _input_embedding(model: nn.Module) -> nn.Module | None:
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings()
    inner = getattr(model, "model", None)
    return getattr(inner, "embed_tokens", None)


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    slots = [(parent, name) for parent in model.modules() for name, child in parent.named_children() if child is old]
    for parent, name in slots:
        setattr(parent, name, new)
