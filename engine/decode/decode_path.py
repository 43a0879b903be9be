"""Which path decode steps take, decided once from the config, the loaded model and the device, and the one factory
that builds the runner to follow it (build_runner). Per step, ModelRunner.run picks among what was built.

Decode steps (every sequence adds one token: the steady state of serving) run on one of, fastest first:
- `native`: the C++ step (engine/decode/native_decode.py): CPU, float32, int8/int4 weights packed for a kernel path;
- `compiled`: the model's forward under torch.compile (engine/decode/compiled.py); on CPU it builds on a thread of its
  own while the eager step serves (the server says ready only once it is built: app.py);
- `eager`: the model's own forward, the twin the other steps are tested against.
On CUDA, decode steps replay CUDA graphs (engine/decode/cuda_graphs.py) of the compiled or eager step. On CPU, decode
steps' attention reads the KV cache in place with Tern's kernel (engine.kernels) where the kernel path has one.
Prefill and mixed steps always run the eager model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.decode import compiled, cuda_graphs, native_decode
from engine.config import EngineConfig
from engine.kernels import CpuKernels
from engine.kv_cache import BlockAllocator, KVCache
from engine.weights.layers import computes_each_row_alone
from engine.weights.loader import LoadedModel
from engine.models.generic import RecomputeRunner
from engine.decode.runner import ModelRunner, Runner

logger = logging.getLogger(__name__)

STEPS = ("native", "compiled", "eager")


@dataclass(frozen=True)
class DecodePath:
    """What a runner's decode steps run on, and why. ModelRunner builds exactly this, nothing else."""

    step: str  # one of STEPS
    reason: str  # why, in one line: what was asked for and what ruled out a faster step
    is_compiled_in_background: bool = False  # `compiled` on CPU: the eager step serves until the build is done
    graphs: bool = False  # decode steps replay CUDA graphs, one per (batch, context) bucket (uncaptured on CPU)
    attention_kernel: Callable | None = None  # reads decode steps' K/V in place (engine.kernels); None: matmuls
    kernels: CpuKernels | None = None  # the kernel path the native step runs on
    # Prompts prefill as decode rows (each position a row of the decode step, attending to the context before it),
    # so a prompt token's logprob is the one it gets when generated, to the bit (see _prefills_as_decode_rows).
    prefills_as_decode_rows: bool = False


def plan_decode_path(config: EngineConfig, loaded: LoadedModel, kv_cache: KVCache | None) -> DecodePath:
    """The decode path for this model on this device, and why; logs the choice."""
    if not loaded.is_native:
        path = DecodePath("eager", "the generic transformers path recomputes every step")
        logger.info("decode steps: eager (%s)", path.reason)
        return path
    device, quantization = loaded.device, loaded.quantization
    attention_kernel = _attention_kernel(loaded, kv_cache)
    step, reasons = "eager", []
    if not config.native_decode or device.type != "cpu":
        reasons.append("the native step is off" if not config.native_decode else "the native step is CPU-only")
    else:
        problem = native_decode.unsupported_reason(loaded.model, kv_cache, loaded.kernels, loaded.dtype)
        if problem is None and attention_kernel is None:  # the native step's attention is that kernel
            problem = "the CPU attention kernel does not serve this KV cache"
        if problem is None:
            step = "native"
            reasons.append(f"the C++ step serves {loaded.describe_kind()} on the {loaded.kernels.path} kernels")
        else:
            reasons.append(f"the native step: {problem}")
    if step != "native":
        problem = compiled.unsupported_reason(device, quantization) if config.compile else "compile is off"
        if problem is None:
            step = "compiled"
            reasons.append("compiled" + (" in the background" if device.type == "cpu" else " before serving"))
        else:
            if config.compile:
                logger.warning("not compiling the decode step: %s", problem)
            reasons.append(f"not compiled: {problem}")
    graphs = False
    if config.cuda_graphs and device.type == "cuda":
        problem = cuda_graphs.unsupported_reason(quantization)
        graphs = problem is None
        reasons.append(f"CUDA graphs: {problem or 'replayed'}")
    as_rows = _prefills_as_decode_rows(step, loaded, attention_kernel)
    if as_rows:
        reasons.append("prompts prefill as decode rows")
    path = DecodePath(step, "; ".join(reasons), step == "compiled" and device.type == "cpu", graphs,
                      attention_kernel, loaded.kernels if step == "native" else None, as_rows)
    logger.info("decode steps: %s%s (%s)", step, ", CUDA graphs" if graphs else "", path.reason)
    return path


def build_runner(config: EngineConfig, loaded: LoadedModel, kv_cache: KVCache | None, allocator: BlockAllocator,
                 max_model_len: int, on_compiled: Callable[[], None]) -> Runner:
    """The runner for this model here, fully configured: a ModelRunner on the planned path (it builds the native
    step, compiles and captures as planned), or the generic path's RecomputeRunner. `on_compiled` is called from
    the compile's thread when a background compile ends, so the engine thread frees its reserved blocks."""
    path = plan_decode_path(config, loaded, kv_cache)
    if loaded.device.type == "cuda":
        # cuDNN's SDPA (PyTorch's first choice on Hopper) builds a plan per new sequence length, ~0.2 s each:
        # every prompt of a new length would pay it. Flash and memory-efficient attention do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if not loaded.is_native:
        return RecomputeRunner(loaded.model, loaded.device, loaded.tokenizer.pad_token_id or 0)
    return ModelRunner(loaded.model, kv_cache, loaded.device, path, allocator, config.max_num_seqs, max_model_len,
                       on_compiled)


def _attention_kernel(loaded: LoadedModel, kv_cache: KVCache) -> Callable | None:
    """The CPU kernel that reads decode steps' keys and values in place, where it serves this cache and model: it
    computes softmax(q.k * scale) over a sequence's whole context, so a model with sliding-window layers or
    soft-capped scores (Gemma 2 and 3, Phi-3-mini; has_plain_attention False) attends in plain matmuls instead."""
    # The cache holds the model's dtype or, for a float32 model, bf16 (kv_plan.py): the kernel reads both.
    usable = (loaded.device.type == "cpu" and loaded.dtype in (torch.bfloat16, torch.float32)
              and kv_cache.head_dim % 16 == 0 and loaded.model.has_plain_attention)
    return loaded.kernels.decode_attention if usable else None


def _prefills_as_decode_rows(step: str, loaded: LoadedModel, attention_kernel: Callable | None) -> bool:
    """Whether prompts prefill as decode rows: then a prompt token's logprob is the one it gets when generated, to the
    bit, however the prompt was chunked and whatever ran beside it. Prefilled whole, prefill's attention (SDPA, its
    blocking set by the prompt's length) differs from decode's in float order, which grew through the layers into
    ~0.1-0.24 nats (int8 activations in fp32, bf16 roundings). It needs a step whose rows are computed alike in any
    batch: the native step, or the eager one where every matmul is a Tern kernel (bf16 on AVX512-BF16, the packed
    layouts in bf16) and the attention kernel reads a prompt's rows in tiles (decode_attention.h). Not the compiled
    step, whose build covers decode-sized batches; and only models whose row reads nothing of the rest of its
    prompt (Phi-3's longrope picks its factors from the prompt's last position)."""
    if not loaded.model.prefills_alike_by_rows or attention_kernel is None:
        return False
    return step == "native" or (step in ("eager", "compiled") and computes_each_row_alone(loaded.model))

