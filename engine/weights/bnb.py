"""bitsandbytes' layers for the bnb-* quantization modes (LLM.int8(), NF4, FP4), built as transformers'
BitsAndBytesConfig builds them, and whether they run here. Imported on demand: bitsandbytes is optional."""
from __future__ import annotations

import functools
import logging
import sys
from typing import Callable

import torch
from torch import nn

from engine.kernels import layouts

logger = logging.getLogger(__name__)

BNB_MODES = {"bnb-int8": "int8", "bnb-nf4": "nf4", "bnb-fp4": "fp4"}
BNB_INT8_THRESHOLD = 6.0  # transformers' BitsAndBytesConfig default (llm_int8_threshold)


def unsupported_reason(mode: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when bitsandbytes runs `mode` on this device and dtype, else one line saying why not."""
    try:
        bnb = import_bitsandbytes()
    except Exception as exc:  # ImportError, or a broken native library raising anything at import
        return f"--quantization {mode} needs bitsandbytes (pip install bitsandbytes==0.50.2): {type(exc).__name__}: {exc}"
    try:  # the cheapest complete answer: build and run one small layer on the device
        layer = bnb_layer(nn.Linear(64, 64, bias=False).weight, None, mode, dtype, double_quant=False).to(device).eval()
        layer(torch.ones(1, 64, dtype=dtype, device=device))
    except Exception as exc:  # bitsandbytes raises RuntimeError/NotImplementedError/... per backend
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return (f"--quantization {mode}: bitsandbytes {bnb.__version__} cannot run on {device} with "
                f"{str(dtype).removeprefix('torch.')} here ({type(exc).__name__}: {first_line})")
    return None


def bnb_layer(weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dtype: torch.dtype,
              double_quant: bool) -> nn.Module:
    """A bitsandbytes layer on the CPU holding `weight` [out, in] and `bias`; moving it `.to(device)` quantizes it."""
    bnb = import_bitsandbytes()
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


def row_exact_layer(layer: nn.Module, bf16_mm: Callable | None) -> nn.Module | None:
    """For a quantized bitsandbytes layer on the CPU, its twin whose rows get the same bits in any batch
    (engine/weights/bnb_rows.py), holding bitsandbytes' own weights; None for any other layer, or where no twin
    serves it: 4-bit layers need bf16 compute, Tern's bf16 kernel (`bf16_mm`) and a shape its layout holds, and
    not bitsandbytes' own AVX512-BF16 packing. LLM.int8()'s int8 GEMM is aten's _int_mm where aten's CPU
    capability is AVX512, as bitsandbytes chooses it, else exact float32 slices (the same bits)."""
    if "bitsandbytes" not in sys.modules:  # then no layer of the model is one of its
        return None
    from engine.weights.bnb_rows import Bf16KernelLinear4bit, RowwiseInt8LtLinear

    bnb = sys.modules["bitsandbytes"]
    if not isinstance(layer, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) or layer.weight.device.type != "cpu":
        return None
    weight, bias = layer.weight, None if layer.bias is None else layer.bias.detach()
    if isinstance(layer, bnb.nn.Linear8bitLt):
        return RowwiseInt8LtLinear(weight.data, weight.SCB.float(), bias, layer.state.threshold, _int8_gemm_is_int_mm())
    # A Linear4bit from here on.
    if (bf16_mm is not None and layer.compute_dtype == torch.bfloat16
            and not getattr(weight.quant_state, "packing_format_for_cpu", False)):
        rows, columns = weight.quant_state.shape
        if rows % layouts.BF16_GROUP_ROWS == 0 and columns % (layouts.CHUNK_BYTES // 2) == 0:
            return Bf16KernelLinear4bit(weight, bias, bf16_mm)
    return None


@functools.cache
def _int8_gemm_is_int_mm() -> bool:
    """LLM.int8()'s int8 GEMM on this CPU, decided (and logged) once per process."""
    capability = torch.backends.cpu.get_cpu_capability()
    use_int_mm = capability == "AVX512"
    logger.info("bnb-int8: LLM.int8() row by row, its int8 GEMM %s (aten's CPU capability: %s)",
                "aten's _int_mm" if use_int_mm else "in exact float32 slices", capability)
    return use_int_mm


def state_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Tensors bitsandbytes hangs off a quantized parameter: LLM.int8() row scales, 4-bit block absmax."""
    extras = [t for t in (getattr(tensor, "SCB", None),) if isinstance(t, torch.Tensor)]
    state = getattr(tensor, "quant_state", None)
    while state is not None:
        extras += [t for t in (state.absmax, state.code) if isinstance(t, torch.Tensor)]
        state = getattr(state, "state2", None)
    return extras


def import_bitsandbytes():
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
