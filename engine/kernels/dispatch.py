"""Which of Tern's CPU kernels run in this process, and why: decided once from the CPU's features.

Paths, best first:
- `amx`: `avx512`'s kernels, with Intel's AMX tile multiplies where a kernel has them (q8, q4, q4k and q6k, batches of
  16 rows and more), where the CPU has AMX-INT8 and Linux grants the process its tile state;
- `avx512`: int8 and int4 by AVX512-VNNI, decode attention in 16-float registers, bf16 by AVX512-BF16 where the CPU
  has it, else by that instruction's arithmetic in fp32 FMAs;
- `avx2`: int8 by vpmaddubsw (the same bits as VNNI), decode attention in 8-float registers, bf16 in FMAs (the same
  bits as avx512's FMAs);
- `off`: aten's own ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) and matmul attention.
TERN_CPU_KERNELS=amx|avx512|avx2|off forces a path (the
tests run each path the CPU supports); a forced path the CPU lacks falls back to the best it has, with a warning.
ARM (NEON, dot-product) has no path yet: nothing here could measure or test one, so ARM CPUs take `off`.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.kernels import build

logger = logging.getLogger(__name__)

ENV_VAR = "TERN_CPU_KERNELS"
PATHS = ("amx", "avx512", "avx2", "off")  # best first
# CPU flags (as /proc/cpuinfo names them) each path needs, and the instruction sets of kernel files it loads.
REQUIRED_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    # avx512's kernels, with Intel's AMX tile multiplies where a kernel has them (*_amx.cpp)
    "amx": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
}
BF16_FLAG = "avx512_bf16"


# The `layout` argument of torch.ops.tern.gguf_repack (kernels.h: GgufLayout).
GGUF_REPACK_LAYOUTS = {"q8": 0, "int4": 1, "q4": 2, "q4k": 3, "q6k": 4, "q5k": 5}


class KernelsUnavailable(RuntimeError):
    """A path cannot run here; the message says why in one line."""


@dataclass(frozen=True)
class CpuKernels:
    """The operators one path provides; None where aten's ops or plain matmuls serve instead."""

    path: str  # one of PATHS
    reason: str  # why this path: what was asked for, or what the CPU lacks
    q8_mm: Callable | None = None  # (x [M, K], layouts.pack_q8 weight) -> [M, N]
    int4_mm: Callable | None = None  # (x [M, K], layouts.pack_int4 weight) -> [M, N]
    q4_mm: Callable | None = None  # (x [M, K], layouts.pack_q4 weight) -> [M, N]
    q4k_mm: Callable | None = None  # (x [M, K], layouts.pack_q4k weight) -> [M, N]
    q5k_mm: Callable | None = None  # (x [M, K], layouts.pack_q5k weight) -> [M, N]
    q6k_mm: Callable | None = None  # (x [M, K], layouts.pack_q6k weight) -> [M, N]
    bf16_mm: Callable | None = None  # (x [M, K] bf16, layouts.pack_bf16 weight) -> [M, N] bf16
    decode_attention: Callable | None = None  # (q, k_cache, v_cache, context_slots, context_lens, scale)
    silu_mul: Callable | None = None  # (gate_up [M, 2 * inter]) -> SiLU(gate) * up [M, inter]: the native step's MLP
    # (raw uint8 [rows, bytes per row] of a GGUF matrix, ggml type id, columns, layout: GGUF_REPACK_LAYOUTS[name],
    # out=None) -> that layout's bytes (written into `out` where given), at load time; None: engine/weights/gguf_blocks.py's
    # torch twins do it
    gguf_repack: Callable | None = None

    def describe(self) -> str:
        """E.g. `avx2 (int8: avx2, int4: avx2, bf16: avx2-fma, decode attention: avx2)`."""
        return describe_path(self.path)


def describe_path(path: str) -> str:
    """What serves each kind of work on `path` on this CPU, e.g. `avx2 (int8: avx2, int4: avx2, bf16: avx2-fma,
    decode attention: avx2)`; `aten` and `matmul` are torch's own ops."""
    if path == "off":
        parts = {"int8": "aten", "int4": "aten", "q8": "aten", "bf16": "aten", "decode attention": "matmul"}
    else:
        avx512 = path in ("avx512", "amx")
        bf16 = "avx512-bf16" if avx512 and BF16_FLAG in cpu_flags() else ("avx512-fma" if avx512 else "avx2-fma")
        vnni = "avx512-vnni" if avx512 else "avx2"
        parts = {"int8": vnni, "int4": vnni, "q8": vnni, "bf16": bf16, "decode attention": "avx512" if avx512 else path}
        if path == "amx":  # int8 is served by q8's kernel
            parts["int8"] = "amx-int8"
            del parts["q8"]
            parts["q8, q4, q4k, q6k"] = "amx-int8"
    return f"{path} ({', '.join(f'{kind}: {impl}' for kind, impl in parts.items())})"


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def unsupported_reason(path: str) -> str | None:
    """None when `path` can run on this CPU (judged from its flags; building may still fail), else why not."""
    if path == "off":
        return None
    if path not in REQUIRED_FLAGS:
        return f"unknown kernel path {path!r} (choose one of {', '.join(PATHS)})"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.machine()} CPUs have no Tern kernels yet (NEON is not written: no machine here to test it)"
    missing = [flag for flag in REQUIRED_FLAGS[path] if flag not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if build.compiler() is None:
        return "no C++ compiler (g++) to build the kernels"
    if path == "amx" and not _linux_grants_amx():
        return "Linux refuses this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


@functools.cache  # the grant is the process's for good: asked once
def _linux_grants_amx() -> bool:
    """Ask Linux for AMX's tile data state, which it hands a process only when asked (a tile instruction before
    that faults)."""
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86-64 syscall number, asm/prctl.h
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


def requested_path() -> str:
    """TERN_CPU_KERNELS, or `auto`."""
    return os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"


def planned_path(requested: str | None = None) -> tuple[str, str]:
    """(path, why) that `select` will take on this CPU, judged without building anything (for --help)."""
    requested = requested or requested_path()
    best = next(path for path in PATHS if unsupported_reason(path) is None)
    if requested == "auto":
        lacking = [f"{path}: {unsupported_reason(path)}" for path in PATHS[:PATHS.index(best)]]
        return best, ("the best this CPU supports" if not lacking else "; ".join(lacking))
    reason = unsupported_reason(requested)
    if reason is None:
        return requested, f"forced by {ENV_VAR}={requested}"
    return best, f"{ENV_VAR}={requested} cannot run ({reason})"


def select(cache_dir: Path, requested: str | None = None) -> CpuKernels:
    """The kernels this process uses: the planned path, built and loaded (once), or `off` with the reason when
    building fails. Logs the choice: WARNING when a fallback, with why."""
    path, why = planned_path(requested)
    try:
        kernels = kernels_for(path, cache_dir, why)
    except KernelsUnavailable as exc:
        kernels = kernels_for("off", cache_dir, f"{path} could not be built: {exc}")
    if kernels.path == "off" or (requested or requested_path()) not in ("auto", kernels.path):
        logger.warning("CPU kernels: %s; %s", kernels.describe(), kernels.reason)
    else:
        logger.info("CPU kernels: %s; %s", kernels.describe(), kernels.reason)
    return kernels


def kernels_for(path: str, cache_dir: Path, reason: str = "") -> CpuKernels:
    """The operators of `path`, building and loading the library once; raises KernelsUnavailable."""
    if path == "off":
        return CpuKernels("off", reason or f"forced by {ENV_VAR}=off")
    problem = unsupported_reason(path)
    if problem:
        raise KernelsUnavailable(problem)
    _load_library(cache_dir)
    ops = torch.ops.tern
    isa = "avx512" if path == "amx" else path  # amx: avx512's ops but q8's, q4's, q4k's and q6k's
    bf16 = ops.bf16_mm_avx512bf16 if isa == "avx512" and BF16_FLAG in cpu_flags() else getattr(ops, f"bf16_mm_{isa}")
    return CpuKernels(path, reason or "asked for", q8_mm=getattr(ops, f"q8_mm_{path}"),
                      int4_mm=getattr(ops, f"int4_mm_{isa}"), q4_mm=getattr(ops, f"q4_mm_{path}"),
                      q4k_mm=getattr(ops, f"q4k_mm_{path}"),
                      q5k_mm=getattr(ops, f"q5k_mm_{isa}"),
                      q6k_mm=getattr(ops, f"q6k_mm_{path}"),
                      bf16_mm=bf16,
                      decode_attention=getattr(ops, f"decode_attention_{isa}"),
                      silu_mul=getattr(ops, f"silu_mul_{isa}"), gguf_repack=ops.gguf_repack)


def prebuild(cache_dir: Path) -> None:
    """Start building the kernels the planned path needs on a thread of their own (the compiler runs in child
    processes), so a first start builds them while it converts the model; `select` then finds them loaded."""
    if planned_path()[0] != "off":
        threading.Thread(target=_load_library_quietly, args=(cache_dir,), name="tern-kernel-build", daemon=True).start()


def _load_library_quietly(cache_dir: Path) -> None:
    try:
        _load_library(cache_dir)
    except KernelsUnavailable:
        pass  # select() meets the same failure and says why


_LIBRARY_LOCK = threading.Lock()  # one build and one load at a time: a second load would register the ops twice


def _load_library(cache_dir: Path) -> None:
    """Build and load the machine's library (every instruction set it supports) once per process, from whichever
    cache folder asks first: torch registers an operator namespace once."""
    with _LIBRARY_LOCK:
        if not hasattr(torch.ops.tern, "q8_mm_avx2"):
            _build_and_load(cache_dir)


def _build_and_load(cache_dir: Path) -> None:
    flags = cpu_flags()
    isas = ["avx2"]
    if unsupported_reason("avx512") is None:
        isas.append("avx512")
        if BF16_FLAG in flags:
            isas.append("avx512_bf16")
        if unsupported_reason("amx") is None:
            isas.append("amx")
    try:
        build.load_library(tuple(isas), cache_dir)
    except build.BuildError as exc:
        raise KernelsUnavailable(str(exc)) from None
    _register_fakes()


def _register_fakes() -> None:
    """Output shapes for torch.compile, which calls the kernels as opaque ops inside the compiled decode step."""
    def matmul_shape(x, packed, *_):
        return x.new_empty(x.shape[0], packed.shape[0])

    def attention_shape(q, k_cache, v_cache, context_slots, context_lens, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    for names, shape in ((("q8_mm_avx2", "q8_mm_avx512", "int4_mm_avx2", "int4_mm_avx512", "q4_mm_avx2", "q4_mm_avx512",
                           "q4k_mm_avx2", "q4k_mm_avx512", "q5k_mm_avx2", "q5k_mm_avx512",
                           "q6k_mm_avx2", "q6k_mm_avx512", "bf16_mm_avx2", "bf16_mm_avx512", "bf16_mm_avx512bf16",
                           "q8_mm_amx", "q4_mm_amx", "q4k_mm_amx", "q6k_mm_amx"),
                          matmul_shape),
                         (("decode_attention_avx2", "decode_attention_avx512"), attention_shape)):
        for name in names:
            if hasattr(torch.ops.tern, name):
                torch.library.register_fake(f"tern::{name}")(shape)
