"""bitsandbytes' layers for the bnb-* quantization modes (LLM.int8(), NF4, FP4), built as transformers'
BitsAndBytesConfig builds them, and whether they run here. Imported on demand: bitsandbytes is optional."""
from __future__ import annotations

import logging

import torch
from torch import nn

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
