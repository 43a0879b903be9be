"""How big a loaded model is: its parameters as the float model had them, and the bytes its weights hold."""
from __future__ import annotations

import torch
from torch import nn

from engine.weights import bnb


def num_parameters(model: nn.Module) -> int:
    """Parameters as the float model had them (a 4-bit or int8 weight counts as its logical shape)."""
    total, seen = 0, set()
    for module in model.modules():
        weight = _packed_weight(module)
        if weight is not None and id(weight) not in seen:
            seen.add(id(weight))
            if hasattr(module, "out_features"):
                total += module.out_features * module.in_features
            elif hasattr(module, "embedding_dim"):
                total += module.num_embeddings * module.embedding_dim
            else:
                total += weight.numel()
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                quant_state = getattr(param, "quant_state", None)
                total += quant_state.shape.numel() if quant_state is not None else param.numel()
    return total


def _packed_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight matrix a Tern layer keeps as a buffer rather than a parameter."""
    for name in ("weight_int8", "weight_packed", "weight_int4pack"):
        if isinstance(getattr(module, name, None), torch.Tensor):
            return getattr(module, name)
    return None


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by weights: parameters and buffers, plus the scales bitsandbytes keeps beside them."""
    tensors: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        tensors[id(tensor)] = tensor
        for extra in bnb.state_tensors(tensor):
            tensors[id(extra)] = extra
    # Tied weights (and an int8 lm_head sharing the embedding's matrix) are one tensor: count it once.
    unique = {(t.device, t.data_ptr(), t.dtype, t.numel()): t.numel() * t.element_size() for t in tensors.values()}
    return sum(unique.values())


def block_layouts(model: nn.Module) -> list[str]:
    """The block layouts (engine/kernels/layouts.py) the model's weights are held in, most bytes first: what a GGUF's
    types became, e.g. ["q5k", "q6k"] for a Q5_K_M file."""
    held: dict[str, int] = {}
    seen = set()  # a tied lm_head and its embedding are one matrix
    for module in model.modules():
        layout, weight = getattr(module, "LAYOUT", None), getattr(module, "weight_packed", None)
        if layout is not None and isinstance(weight, torch.Tensor) and id(weight) not in seen:
            seen.add(id(weight))
            held[layout] = held.get(layout, 0) + weight.numel() * weight.element_size()
    return sorted(held, key=held.get, reverse=True)
