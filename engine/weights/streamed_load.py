"""Build the native model tensor by tensor from a weight source, each weight going straight to the layer that serves
it: a GGUF file (engine/gguf_file.GgufFile) or a Hugging Face safetensors folder (engine/weights/safetensors_folder.py).

Under `auto`, `int4` and `int8` on a CPU the source's tensors decide: a tensor held in one of Tern's layouts already
(a GGUF's Q4_0 blocks as q4, Q4_K as q4k, Q5_K as q5k, Q6_K as q6k, Q4_1 as int4, Q8_0 as q8: engine/gguf_blocks.GGUF_TYPES) goes into it without
passing through float; the rest is read as float32 a few thousand rows at a time and quantized to q8 (int8 per 32 values,
quant.quantize_q8). `auto` keeps each tensor's own width; `int8` makes everything q8 (4-bit blocks de-quantized
first); `int4` also quantizes float tensors to 4-bit, as it does for any checkpoint. A fused projection (qkv,
gate/up) keeps a layout only when every part has it (4-bit parts of different layouts all go into int4: q4 exactly,
q4k with its scales rounded to fp16); under `auto` parts of other layouts (a Q4_K_M file's q and k in Q4_K, v in
Q6_K) keep each its own, side by side (layers.SplitLinear). Any other mode gets float weights here, one tensor at a time,
and quant.quantize runs after, as for any checkpoint. Either way no whole-model float copy exists: peak memory is
the served weights plus about one tensor in float32.

A source answers: path, reading() (a context the whole load runs in), names(), `in`, shape(name), type_name(name),
layout(name) ("int4", "q4", "q4k", "q5k", "q6k", "q8" or None), packed(name, heads, repack, out, layout) (the tensor in that
layout's bytes, or in int4's for a q4 or q4k tensor), q8(name, heads, repack) (the matrix in q8's, re-quantized where the type's
levels are not int8's), int4(name, heads, repack) (in int4's, re-quantized from its values), float(name, heads) and float_rows(name, heads); `repack` is the kernel
library's GGUF repacking (CpuKernels.gguf_repack, None without it) and `heads`
names how many heads a q or k matrix holds, for sources whose rows are stored in another order (llama.cpp's
converter permutes them).
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter

import torch
from torch import nn

from engine.weights import quant
from engine.errors import ModelLoadError
from engine.kernels import layouts
from engine.weights.layers import (
    Int4Embedding, Int4Linear, Int8Embedding, Int8Linear, Q4Embedding, Q4KEmbedding, Q4KLinear, Q4Linear,
    Q5KEmbedding, Q5KLinear, Q6KEmbedding, Q6KLinear, Q8Embedding, Q8Linear, SplitLinear,
)
from engine.models import NATIVE_MODELS

logger = logging.getLogger(__name__)


def build_model(source, hf_config, mode: str, dtype: torch.dtype, device: torch.device, repack=None,
                q4k: bool = False, q5k: bool = False, q6k: bool = False) -> nn.Module:
    """The native model for hf_config.model_type with every weight read from `source`. In quant.KERNEL_MODES on a
    CPU its linear layers are already Int4Linear/Int8Linear (quant.pack_for_cpu packs them next); otherwise they are
    nn.Linear in `dtype`. Every layer the model has is built from the tensors of its name, or of the checkpoint
    layers it fuses (the model's fused_from: qkv_proj from q_proj, k_proj and v_proj). `q4k`: the kernel path has a
    q4k kernel (CpuKernels.q4k_mm), so Q4_K blocks are served as they are; else in int4. `q5k`, `q6k`: the same for
    Q5_K and Q6_K blocks (CpuKernels.q5k_mm, q6k_mm); else they go into q8."""
    with torch.device("meta"):
        model = NATIVE_MODELS[hf_config.model_type](hf_config)
    places = set(model.state_dict())
    unknown = [name for name in source.names() if name not in places and "rotary_emb" not in name]
    if unknown:  # before any weight is read
        raise ModelLoadError(f"{source.path}: tensors a {hf_config.model_type} model has no place for: {unknown[:5]}")
    model.fuse_projections()
    quantized = mode in quant.KERNEL_MODES and device.type == "cpu"
    builder = _LayerBuilder(source, hf_config, mode if quantized else "none", dtype, repack, q4k, q5k, q6k)
    with source.reading():
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and name != "lm_head":
                parent, _, child = name.rpartition(".")
                parts = [f"{parent}.{part}" for part in model.fused_from.get(child, (child,))]
                setattr(model.get_submodule(parent), child, builder.linear(parts))
        head_and_embedding = ("model.embed_tokens.weight", "lm_head.weight")
        for name, param in list(model.named_parameters()):
            if param.is_meta and name not in head_and_embedding:  # the norms
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, builder.parameter(name))
        builder.embedding_and_head(model)
    logger.info("%s: %s", source.path.name, builder.summary())
    return model.to(device)


def served_mode(model: nn.Module) -> str:
    """The quant.MODES entry a model built here runs as: int4 when any layer is 4-bit (the rest is int8), else int8."""
    return "int4" if any(isinstance(m, (Int4Linear, Q4Linear, Q4KLinear)) for m in model.modules()) else "int8"


class _LayerBuilder:
    def __init__(self, source, hf_config, mode: str, dtype: torch.dtype, repack=None, q4k: bool = False,
                 q5k: bool = False, q6k: bool = False) -> None:
        self.source, self.mode, self.dtype, self.repack, self.q4k = source, mode, dtype, repack, q4k
        self.q5k, self.q6k = q5k, q6k
        self.tied = getattr(hf_config, "tie_word_embeddings", False) or "lm_head.weight" not in source
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.served: Counter = Counter()  # (GGUF type, what serves it) -> tensors

    def summary(self) -> str:
        return ", ".join(f"{n} {t} as {how}" for (t, how), n in sorted(self.served.items()))

    def _take(self, name: str) -> str:
        if name not in self.source:
            raise ModelLoadError(f"{self.source.path}: the file has no tensor for {name}")
        return self.source.type_name(name)

    def _heads(self, name: str) -> int | None:
        """How many heads a matrix's rows hold, for the matrices whose rows llama.cpp's converter reorders."""
        if name.endswith("q_proj.weight"):
            return self.num_heads
        if name.endswith("k_proj.weight"):
            return self.num_kv_heads
        return None

    def _fits(self, name: str) -> bool:
        """Whether the matrix fits the int4 and q8 layouts (rows in groups of 8, columns in blocks of 32)."""
        rows, cols = self.source.shape(name)
        return rows % layouts.INT4_GROUP_ROWS == 0 and cols % layouts.INT4_GROUP_COLS == 0

    def _layout(self, name: str) -> str | None:
        """The layout the source's blocks of this tensor go into as they are: q4k only where a kernel serves it
        (every path but `off`), else Q4_K goes into int4; q5k and q6k only where a kernel serves them, else none (Q5_K
        and Q6_K are re-quantized into q8)."""
        layout = self.source.layout(name)
        if (layout == "q5k" and not self.q5k) or (layout == "q6k" and not self.q6k):
            return None
        return "int4" if layout == "q4k" and not self.q4k else layout

    def _held_as(self, name: str, layout: str) -> bool:
        return self._layout(name) == layout and self._fits(name)

    def _packed(self, name: str, out: torch.Tensor | None = None, layout: str | None = None) -> torch.Tensor:
        """The tensor in the layout the source holds it in (int4, q4 or q8), or in `layout` (int4 for q4 blocks),
        straight from its blocks."""
        layout = layout or self._layout(name)
        self.served[(self.source.type_name(name), layout)] += 1
        return self.source.packed(name, self._heads(name), self.repack, out, layout)

    def _as_int4(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._packed(name, out, "int4")

    def _int4_from_float(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """layouts.pack_int4's bytes re-quantized from the tensor's values (quant.quantize_int4)."""
        return self.source.int4(name, self._heads(name), self.repack, out)

    def _float(self, name: str) -> torch.Tensor:
        return self.source.float(name, self._heads(name))

    def _q8(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """layouts.pack_q8's bytes: the source's own Q8_0 blocks, else re-quantized per 32 values."""
        if self._held_as(name, "q8"):
            return self._packed(name, out)
        self.served[(self.source.type_name(name), "q8")] += 1
        return self.source.q8(name, self._heads(name), self.repack, out)

    def _stacked(self, names: list[str], packed_cols: int, one) -> torch.Tensor:
        """The parts' packed rows one under the other (a fused projection), each part written in place: no
        concatenated copy of a layer's weights exists beside its parts. one(name, out) writes a part."""
        rows = [self.source.shape(n)[0] for n in names]
        stacked = torch.empty(sum(rows), packed_cols, dtype=torch.uint8)
        start = 0
        for name, count in zip(names, rows):
            one(name, stacked[start:start + count])
            start += count
        return stacked

    def _int8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row int8 (quant.quantize_int8) for a shape q8 cannot hold, de-quantizing a few thousand rows at a time."""
        self.served[(self.source.type_name(name), "int8")] += 1
        parts = [quant.quantize_int8(rows, self.dtype) for rows in self.source.float_rows(name, self._heads(name))]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def parameter(self, name: str) -> nn.Parameter:
        self._take(name)
        return nn.Parameter(self._float(name).to(self.dtype), requires_grad=False)

    def _bias(self, names: list[str]) -> torch.Tensor | None:
        biases = [name.removesuffix(".weight") + ".bias" for name in names]
        present = [b for b in biases if b in self.source]
        if not present:
            return None
        if len(present) != len(biases):
            raise ModelLoadError(f"{self.source.path}: some of {biases} have a bias and some do not")
        for b in present:
            self._take(b)
        return torch.cat([self._float(b) for b in present]).to(self.dtype)

    def linear(self, parts: list[str], int4_from_float: bool = True) -> nn.Module:
        """One layer for the rows of `parts` stacked (a fused projection), in the mode's layout. `int4_from_float`
        False: under `int4` a float tensor becomes int8, as the lm_head does in that mode (engine/weights/quant.py)."""
        names = [p + ".weight" for p in parts]
        types = [self._take(n) for n in names]
        bias = self._bias(names)
        cols = self.source.shape(names[0])[1]
        if self.mode in ("auto", "int4") and all(self._held_as(n, "q4") for n in names):
            return Q4Linear(self._stacked(names, cols * 9 // 16, self._packed), bias)
        if self.mode in ("auto", "int4") and all(self._held_as(n, "q4k") for n in names):
            return Q4KLinear(self._stacked(names, cols * 9 // 16, self._packed), bias)
        if self.mode == "auto" and all(self._held_as(n, "q5k") for n in names):  # int4 narrows it, int8 widens it
            return Q5KLinear(self._stacked(names, cols * 11 // 16, self._packed), bias)
        if self.mode == "auto" and all(self._held_as(n, "q6k") for n in names):  # int4 narrows it, int8 widens it
            return Q6KLinear(self._stacked(names, cols * 105 // 128, self._packed), bias)
        four_bit = ("int4", "q4", "q4k")
        if self.mode in ("auto", "int4") and all(any(self._held_as(n, f) for f in four_bit) for n in names):
            return Int4Linear(self._stacked(names, cols * 5 // 8, self._as_int4), bias)
        held = {self._layout(n) for n in names}
        if self.mode == "auto" and len(held) > 1 and None not in held and all(self._fits(n) for n in names):
            return self._split(names, bias)
        if self.mode == "int4" and int4_from_float and all(self._fits(n) for n in names):
            for type_name in types:
                self.served[(type_name, "int4 (re-quantized)")] += 1
            return Int4Linear(self._stacked(names, cols * 5 // 8, self._int4_from_float), bias)
        if self.mode != "none" and all(self._fits(n) for n in names):
            return Q8Linear(self._stacked(names, self.source.shape(names[0])[1] * 17 // 16, self._q8), bias)
        if self.mode != "none":
            parts = [self._int8(name) for name in names]
            return Int8Linear(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), bias)
        weight = torch.cat([self._float(n) for n in names]).to(self.dtype)
        for type_name in types:
            self.served[(type_name, str(self.dtype).removeprefix("torch."))] += 1
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
        return linear

    _LAYOUT_LAYERS = {"q4": Q4Linear, "q4k": Q4KLinear, "q5k": Q5KLinear, "q6k": Q6KLinear, "int4": Int4Linear,
                      "q8": Q8Linear}

    def _split(self, names: list[str], bias: torch.Tensor | None) -> SplitLinear:
        """Parts held in different layouts (under `auto`): each run of parts of one layout stacked in its own layer,
        so that each keeps its file's bytes."""
        cols = self.source.shape(names[0])[1]
        layers = []
        for layout, run in itertools.groupby(names, key=self._layout):
            layer = self._LAYOUT_LAYERS[layout]
            size, values = layer.PACKED_BYTES
            layers.append(layer(self._stacked(list(run), cols * size // values,
                                              self._q8 if layer is Q8Linear else self._packed), None))
        return SplitLinear(layers, bias)

    def embedding_and_head(self, model: nn.Module) -> None:
        """The token embedding, and the lm_head: tied to it (one matrix) when the file has no `output` tensor."""
        embedding_name, tied = "model.embed_tokens.weight", self.tied
        self._take(embedding_name)
        if self.mode == "none":
            weight = nn.Parameter(self._float(embedding_name).to(self.dtype), requires_grad=False)
            model.model.embed_tokens.weight = weight
            if tied:
                model.lm_head.weight = weight
            else:
                model.lm_head = self.linear(["lm_head"])
            self.served[(self.source.type_name(embedding_name), "embedding")] += 1
            return
        if self._held_as(embedding_name, "int4") and self.mode in ("auto", "int4"):
            packed = self._packed(embedding_name)
            model.model.embed_tokens = Int4Embedding(packed)
            if tied:
                model.lm_head = Int4Linear(packed, None)
        elif self._held_as(embedding_name, "q4") and self.mode in ("auto", "int4"):
            packed = self._packed(embedding_name)
            model.model.embed_tokens = Q4Embedding(packed)
            if tied:
                model.lm_head = Q4Linear(packed, None)
        elif self._held_as(embedding_name, "q4k") and self.mode in ("auto", "int4"):
            packed = self._packed(embedding_name)
            model.model.embed_tokens = Q4KEmbedding(packed)
            if tied:
                model.lm_head = Q4KLinear(packed, None)
        elif self._held_as(embedding_name, "q5k") and self.mode == "auto":
            packed = self._packed(embedding_name)
            model.model.embed_tokens = Q5KEmbedding(packed)
            if tied:
                model.lm_head = Q5KLinear(packed, None)
        elif self._held_as(embedding_name, "q6k") and self.mode == "auto":
            packed = self._packed(embedding_name)
            model.model.embed_tokens = Q6KEmbedding(packed)
            if tied:
                model.lm_head = Q6KLinear(packed, None)
        elif self._fits(embedding_name):
            packed = self._q8(embedding_name)
            model.model.embed_tokens = Q8Embedding(packed)
            if tied:
                model.lm_head = Q8Linear(packed, None)
        else:
            weight_int8, scales = self._int8(embedding_name)
            model.model.embed_tokens = Int8Embedding(weight_int8, scales)
            if tied:
                model.lm_head = Int8Linear(weight_int8, scales, None)
        if not tied:
            model.lm_head = self.linear(["lm_head"], int4_from_float=False)
