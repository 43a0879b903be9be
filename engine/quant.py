"""Swap nn.Linear for int8 / bitsandbytes variants after loading; detect what this machine supports; count bytes.

Modes (EngineConfig.quantization):
- `int8`: int8 weights, one fp scale per output channel. On CPUs with AVX512-VNNI, every batch goes through
  Tern's kernel (engine/cpu_kernels.py), which reads a packed copy of the weight and quantizes the activations
  to int8 per block (as llama.cpp does); elsewhere decode-sized batches go through `aten._weight_int8pack_mm`
  with bf16 activations, and larger ones dequantize and run one matmul.
  The embedding is quantized too (per row), and a tied lm_head shares that int8 matrix: on SmolLM2 the tied
  49152x576 matrix is 21% of the parameters, and leaving it in bf16 would keep the weights at ~61% of bf16.
- `bnb-int8` (LLM.int8(), outlier threshold 6.0), `bnb-nf4`, `bnb-fp4` (blocksize 64, compute dtype = the
  engine dtype, optional double quantization): bitsandbytes layers, as transformers' BitsAndBytesConfig builds
  them. Like transformers, they leave lm_head and the embedding unquantized, so perplexity matches the reference.
- `none` with bf16 weights on a CPU with AVX512-BF16: the weights stay bf16, repacked for Tern's bf16 kernel
  (`PackedBf16Linear`), which reads them at close to the memory bandwidth, for every batch size.
Fused projections (qkv_proj, gate_up_proj) quantize per output row (int8, LLM.int8()) or in 64-element blocks
along rows whose length is a multiple of 64 (4-bit), so fusing before quantizing changes nothing.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

BNB_MODES = {"bnb-int8": "int8", "bnb-nf4": "nf4", "bnb-fp4": "fp4"}
MODES = ("none", "int8", *BNB_MODES)
BNB_INT8_THRESHOLD = 6.0  # transformers' BitsAndBytesConfig default (llm_int8_threshold)
INT8PACK_MAX_ROWS = 32  # above this many rows (prefill), a GEMM beats aten._weight_int8pack_mm


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scales[:, None]).T + bias, without ever storing the float weight. `packed`:
    weight_int8 holds cpu_kernels.pack's layout (uint8) for the VNNI kernel instead of int8 rows."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 packed: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.packed = packed
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return packed_int8_linear(x, self.weight_int8, self.scales, self.bias)
        return int8_linear(x, self.weight_int8, self.scales, self.bias)


class Int8Embedding(nn.Module):
    """Row lookup of an int8 matrix with one scale per row (the same layout a tied Int8Linear lm_head uses)."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, padding_idx: int | None = None,
                 packed: bool = False) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight_int8.shape
        self.padding_idx = padding_idx
        self.packed = packed
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_kernels.packed_rows(self.weight_int8, input_ids) if self.packed else self.weight_int8[input_ids]
        return rows.to(self.scales.dtype) * self.scales[input_ids].unsqueeze(-1)


class PackedBf16Linear(nn.Module):
    """y = x @ weight.T + bias in bf16, the weight held in cpu_kernels.pack_rows' layout for Tern's bf16 kernel
    (engine/csrc/bf16_gemm.cpp); F.linear on the unpacked weight is its eager twin."""

    def __init__(self, weight_packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_packed.shape
        self.register_buffer("weight_packed", weight_packed)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.bf16_packed_mm(x.reshape(-1, x.shape[-1]), self.weight_packed)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class PackedBf16Embedding(nn.Module):
    """Row lookup in a bf16 matrix held in pack_rows' layout: the embedding a PackedBf16Linear lm_head is tied to."""

    def __init__(self, weight_packed: torch.Tensor, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight_packed.shape
        self.padding_idx = padding_idx
        self.register_buffer("weight_packed", weight_packed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.gather_rows(self.weight_packed, input_ids)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row (output channel) absmax int8: returns (int8 [N, K], scales [N] in `dtype`)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    weight_int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return weight_int8.contiguous(), scales.to(dtype)


def int8_linear(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """The int8 matmul: aten's packed CPU kernel for decode-sized bf16 batches, else the portable path."""
    rows = x.numel() // x.shape[-1]
    if _has_int8pack_mm() and x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows <= INT8PACK_MAX_ROWS:
        return int8pack_linear(x, weight_int8, scales, bias)
    return dequantized_linear(x, weight_int8, scales, bias)


def packed_int8_linear(x, packed, scales, bias=None) -> torch.Tensor:
    """The VNNI kernel, for every batch size: each row gets the same bits alone or in any batch, so a
    sequence's tokens do not depend on what else shares its step."""
    out = cpu_kernels.int8_vnni_mm(x.reshape(-1, x.shape[-1]), packed, scales)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], packed.shape[0])


def int8pack_linear(x, weight_int8, scales, bias=None) -> torch.Tensor:
    """aten._weight_int8pack_mm (CPU): x [M, K] bf16/fp32, weight [N, K] int8, scales [N] of x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.aten._weight_int8pack_mm(flat, weight_int8, scales.to(x.dtype))
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight_int8.shape[0])


def dequantized_linear(x, weight_int8, scales, bias=None) -> torch.Tensor:
    """The eager twin of int8pack_linear, used on CUDA and wherever the aten op is missing or slower."""
    out = F.linear(x, weight_int8.to(x.dtype)) * scales.to(x.dtype)
    return out if bias is None else out + bias


def unsupported_reason(mode: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str | None:
    """None when `mode` runs on this machine, else one line naming what is missing."""
    if mode not in MODES:
        return f"unknown quantization {mode!r}; choose one of {', '.join(MODES)}"
    if mode not in BNB_MODES:
        return None
    try:
        bnb = _import_bitsandbytes()
    except Exception as exc:  # ImportError, or a broken native library raising anything at import
        return f"--quantization {mode} needs bitsandbytes (pip install bitsandbytes==0.50.2): {type(exc).__name__}: {exc}"
    try:  # the cheapest complete answer: build and run one small layer on the device
        layer = _bnb_layer(nn.Linear(64, 64, bias=False), mode, dtype, double_quant=False).to(device).eval()
        layer(torch.ones(1, 64, dtype=dtype, device=device))
    except Exception as exc:  # bitsandbytes raises RuntimeError/NotImplementedError/... per backend
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return (f"--quantization {mode}: bitsandbytes {bnb.__version__} cannot run on {device} with "
                f"{str(dtype).removeprefix('torch.')} here ({type(exc).__name__}: {first_line})")
    return None


def check_supported(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ModelLoadError (one line naming what is missing) when `mode` cannot run here."""
    reason = unsupported_reason(mode, device, dtype)
    if reason:
        raise ModelLoadError(reason)


def quantize(model: nn.Module, mode: str, device: torch.device, dtype: torch.dtype, double_quant: bool = False) -> None:
    """Replace the model's linear layers in place (after loading and fusing); raise ModelLoadError if `mode`
    cannot run here. `dtype` is the activation/compute dtype; `double_quant` applies to the 4-bit modes."""
    if mode == "none":
        if device.type == "cpu" and dtype == torch.bfloat16:
            pack_bf16_for_cpu_kernel(model)
        return
    check_supported(mode, device, dtype)
    head, embedding = _output_head(model), _input_embedding(model)
    for parent, name, child in _linear_children(model):
        if child is head:
            # bnb modes keep it in the model dtype, as transformers' BitsAndBytesConfig does (parity); int8
            # quantizes it below, together with the embedding it may be tied to.
            continue
        if mode == "int8":
            weight, bias = _linear_weight(child)
            new = Int8Linear(*quantize_int8(weight, dtype), None if bias is None else bias.detach().to(dtype))
        else:
            new = _bnb_layer(child, mode, dtype, double_quant)
        setattr(parent, name, new.to(device).eval())
    if mode == "int8":
        _quantize_head_and_embedding(model, head, embedding, dtype, device)
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
            pack_for_cpu_kernel(model)


def pack_for_cpu_kernel(model: nn.Module) -> None:
    """Give every Int8Linear (and an embedding sharing its matrix) the VNNI kernel's layout, where the kernel
    builds on this machine and the shape fits; the rest keep int8 rows. Logs why when the kernel is missing."""
    reason = cpu_kernels.unsupported_reason()
    if reason:
        logger.info("int8 matmul: aten._weight_int8pack_mm (Tern's VNNI kernel: %s)", reason)
        return
    # id(int8 rows) -> (those rows, their packed copy): tied modules keep sharing one matrix.
    packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(module, Int8Linear) and not module.packed and cpu_kernels.can_pack(module.weight_int8):
            rows = module.weight_int8
            packed.setdefault(id(rows), (rows, cpu_kernels.pack(rows)))
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8Embedding)) and id(module.weight_int8) in packed:
            module.weight_int8, module.packed = packed[id(module.weight_int8)][1], True
    logger.info("int8 matmul: Tern's VNNI kernel for %d of the int8 matrices", len(packed))


def pack_bf16_for_cpu_kernel(model: nn.Module) -> None:
    """Swap every bf16 linear layer whose shape fits for a PackedBf16Linear (and an embedding tied to one for a
    PackedBf16Embedding sharing its matrix), where the bf16 kernel runs on this CPU; the rest stay as they are."""
    if not cpu_kernels.bf16_available():
        reason = cpu_kernels.unsupported_reason() or f"this CPU lacks {cpu_kernels.BF16_CPU_FLAG}"
        logger.info("bf16 matmul: aten's (Tern's bf16 kernel: %s)", reason)
        return
    packed: dict[int, torch.Tensor] = {}  # data_ptr of a weight -> its packed copy: tied layers share one
    for parent, name, child in _linear_children(model):
        weight, bias = _linear_weight(child)
        if weight.dtype == torch.bfloat16 and cpu_kernels.can_pack(weight):
            key = weight.data_ptr()
            if key not in packed:
                packed[key] = cpu_kernels.pack_rows(weight.detach().contiguous())
            setattr(parent, name, PackedBf16Linear(packed[key], None if bias is None else bias.detach()))
    embedding = _input_embedding(model)
    if isinstance(embedding, nn.Embedding) and embedding.weight.data_ptr() in packed:
        _replace(model, embedding, PackedBf16Embedding(packed[embedding.weight.data_ptr()], embedding.padding_idx))
    logger.info("bf16 matmul: Tern's bf16 kernel for %d of the matrices", len(packed))


def num_parameters(model: nn.Module) -> int:
    """Parameters as the float model had them (a 4-bit or int8 weight counts as its logical shape)."""
    total, seen = 0, set()
    for module in model.modules():
        for weight in _packed_weights(module):
            if id(weight) not in seen:
                seen.add(id(weight))
                total += weight.numel()
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                quant_state = getattr(param, "quant_state", None)
                total += quant_state.shape.numel() if quant_state is not None else param.numel()
    return total


def _packed_weights(module: nn.Module) -> list[torch.Tensor]:
    """The weight matrices a Tern layer keeps as buffers rather than parameters."""
    if isinstance(module, (Int8Linear, Int8Embedding)):
        return [module.weight_int8]
    if isinstance(module, (PackedBf16Linear, PackedBf16Embedding)):
        return [module.weight_packed]
    return []


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by weights: parameters and buffers, plus the scales bitsandbytes keeps beside them."""
    tensors: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        tensors[id(tensor)] = tensor
        for extra in _bnb_state_tensors(tensor):
            tensors[id(extra)] = extra
    # Tied weights (and an int8 lm_head sharing the embedding's matrix) are one tensor: count it once.
    unique = {(t.device, t.data_ptr(), t.dtype, t.numel()): t.numel() * t.element_size() for t in tensors.values()}
    return sum(unique.values())


def _quantize_head_and_embedding(model, head, embedding, dtype, device) -> None:
    """int8 for the embedding rows and the lm_head; one shared int8 matrix when they are tied."""
    if embedding is not None and isinstance(embedding, nn.Embedding):
        weight_int8, scales = quantize_int8(embedding.weight, dtype)
        _replace(model, embedding, Int8Embedding(weight_int8, scales, embedding.padding_idx).to(device))
        if head is not None and _linear_weight(head)[0].data_ptr() == embedding.weight.data_ptr():
            bias = head.bias
            new_head = Int8Linear(weight_int8, scales, None if bias is None else bias.detach().to(dtype))
            _replace(model, head, new_head.to(device))
            return
    if head is not None:
        weight, bias = _linear_weight(head)
        new_head = Int8Linear(*quantize_int8(weight, dtype), None if bias is None else bias.detach().to(dtype))
        _replace(model, head, new_head.to(device))


def _bnb_layer(linear: nn.Module, mode: str, dtype: torch.dtype, double_quant: bool) -> nn.Module:
    """A bitsandbytes layer on the CPU holding `linear`'s weight; moving it `.to(device)` quantizes it."""
    bnb = _import_bitsandbytes()

    weight, bias = _linear_weight(linear)
    out_features, in_features = weight.shape
    weight = weight.detach().to("cpu", dtype)
    if mode == "bnb-int8":
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None, has_fp16_weights=False,
                                    threshold=BNB_INT8_THRESHOLD, device="meta")
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        quant_type = BNB_MODES[mode]
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=dtype,
                                  compress_statistics=double_quant, quant_type=quant_type, device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=double_quant,
                                         quant_type=quant_type, module=layer)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to("cpu", dtype), requires_grad=False)
    # Eval mode matters: in training mode LLM.int8() on CPU skips outlier decomposition, and 4-bit skips
    # repacking the weight for the AVX512-BF16 kernel.
    return layer.eval()


def _bnb_state_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Tensors bitsandbytes hangs off a quantized parameter: LLM.int8() row scales, 4-bit block absmax."""
    extras = [t for t in (getattr(tensor, "SCB", None),) if isinstance(t, torch.Tensor)]
    state = getattr(tensor, "quant_state", None)
    while state is not None:
        extras += [t for t in (state.absmax, state.code) if isinstance(t, torch.Tensor)]
        state = getattr(state, "state2", None)
    return extras


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


@functools.cache
def _has_int8pack_mm() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _import_bitsandbytes():
    """Import bitsandbytes quietly: on AVX512-BF16 CPUs it tries an optional kernel from the Hugging Face hub
    (needs the `kernels` package) and logs a warning when absent; its built-in CPU path works without it."""
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops.level
    cpu_ops.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    finally:
        cpu_ops.setLevel(level)
    # LLM.int8() casts non-fp16 inputs to fp16 by design and logs a warning about it on every forward call.
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    return bitsandbytes
