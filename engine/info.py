"""EngineInfo, what an engine serves and how, as one frozen snapshot; EngineStats, what it is doing now.

They are the engine's description for everything outside engine/: the /v1/models card (api/models.py), /metrics
and the UI's header and Server tab (ui/server.py) render them, so they describe the same engine the same way and
read nothing else of its insides."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    num_parameters: int
    has_chat_template: bool
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # the compute dtype, e.g. "bfloat16"
    quantization: str  # the mode served: what `--quantization auto` chose, when it was auto
    weights: str  # how the weights are held, one line (LoadedModel.describe_weights)
    weight_bytes: int  # quantized storage and scales included
    bf16_weight_bytes: int  # the same weights in bf16
    kv_cache_bytes: int  # 0 on the generic path, which keeps no cache
    kv_cache_dtype: str  # the dtype keys and values are stored in (--kv-cache-dtype); "none" without a cache
    kv_cache_resident: bool  # every page of the pool in memory (a CPU pool faults in for a second or so after start)
    weights_settled: bool  # the weights' move into huge pages after start (engine/huge_pages.py) ended, or none was due
    cpu_kernels: str  # the CPU kernel path and what serves each kind of work; "none (not a CPU)" elsewhere
    decode_step: str  # native, compiled, compiling (eager serves until the compiled step is ready) or eager
    decode_graphs: bool  # decode steps replay captured CUDA graphs
    max_model_len: int  # longest prompt + completion, in tokens
    max_num_seqs: int  # sequences decoded together
    max_waiting: int  # requests queued beyond those before new ones get a 429

    @property
    def compiled_decode(self) -> bool:
        return self.decode_step == "compiled"

    @property
    def weight_ratio_to_bf16(self) -> float:
        return round(self.weight_bytes / max(self.bf16_weight_bytes, 1), 3)


@dataclass
class EngineStats:
    """Engine.stats(): counters and queue sizes now; any thread may ask."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int  # by requests (their prompts, outputs and cached prefixes)
    num_kv_blocks_free: int
    num_preemptions: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    num_prefix_cache_hits: int = 0  # KV blocks reused from the prefix cache since start
    num_steps: int = 0  # model steps run since start, for every caller (the API, the UI, scoring)
    num_generated_tokens: int = 0  # tokens sampled since start, for every caller
    num_kv_blocks_reserved: int = 0  # held by the engine itself: the compiled decode step's warm-up, while it runs
    decode_steps: dict[str, int] = field(default_factory=dict)  # decode steps run, by what ran them (Runner)

    @property
    def kv_cache_usage(self) -> float:
        total = self.num_kv_blocks_used + self.num_kv_blocks_free
        return self.num_kv_blocks_used / total if total else 0.0
