"""Tern's own CPU kernels (engine/csrc/*.cpp): built once per machine with g++, loaded as torch.ops.tern.

Decode matmuls are bound by reading weights, and aten reads them at a third (`_weight_int8pack_mm`) to a half
(bf16 matmul) of this machine's bandwidth. The kernels here read them in the order they use them, packed once
at load (int8: each group of 16 rows stored 4 columns at a time, `pack`; bf16: each group of 4 rows stored
chunk by chunk, `pack_rows`), and multiply with AVX512-VNNI (int8 x int8, as llama.cpp does) or AVX512-BF16.
`engine/quant.py` uses them for every batch size: the int8 kernel when `available()`, the bf16 kernel when
`bf16_available()`. A third kernel, `paged_decode_attention`, reads decode steps' keys and values in place
from the paged KV cache (engine/models/attention.py).

The shared library is compiled with -march=native, so its cache key includes this CPU's flags as well as the
source and torch version: a cache folder copied to another machine rebuilds instead of crashing.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("int8_vnni.cpp", "bf16_gemm.cpp", "decode_attention.cpp"))
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
BF16_CPU_FLAG = "avx512_bf16"  # bf16_gemm.cpp registers its op only where the compiler targets it
ROWS_PER_GROUP, CHUNK_BYTES = 4, 64  # the bf16 layout: [N/4][K/chunk][4][chunk], one zmm register per chunk
INT8_GROUP_ROWS, INT8_QUAD = 16, 4  # the int8 layout: [N/16][K/4][16][4], one zmm register per 4 columns


def available() -> bool:
    return unsupported_reason() is None


@functools.cache
def unsupported_reason() -> str | None:
    """None once torch.ops.tern.int8_vnni_mm is loaded, else one line saying why it cannot be."""
    if os.environ.get("TERN_CPU_KERNELS", "1") == "0":
        return "disabled by TERN_CPU_KERNELS=0"
    flags = _cpu_flags()
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        return f"this CPU lacks {', '.join(missing) or 'x86-64'}"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return "no C++ compiler (g++) to build it"
    try:
        torch.ops.load_library(str(_build(compiler, flags)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        return f"building it failed: {(detail.strip().splitlines() or [''])[-1][:200]}"
    _register_fake()
    return None


@functools.cache
def bf16_available() -> bool:
    """Whether torch.ops.tern.bf16_packed_mm is loaded (the int8 kernel's library, built on a CPU with AVX512-BF16:
    -march=native registers the op exactly there)."""
    return available() and hasattr(torch.ops.tern, "bf16_packed_mm")


def can_pack(weight: torch.Tensor) -> bool:
    """Shapes both kernels take: rows in groups of 16 (int8; 4 for bf16), a row length of whole 64-byte chunks,
    on the CPU."""
    rows, cols = weight.shape
    return weight.device.type == "cpu" and rows % INT8_GROUP_ROWS == 0 and cols % _chunk(weight) == 0


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the bf16 kernel's layout, same dtype and shape: each group of 4 rows stored 64-byte chunk by
    chunk."""
    return _interleave(weight, ROWS_PER_GROUP, _chunk(weight))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_rows`: [N, K] in row order."""
    return _deinterleave(packed, ROWS_PER_GROUP, _chunk(packed))


def gather_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_rows` matrix as [*ids.shape, K] (a tied embedding's lookup), without unpacking it."""
    return _gather(packed, ids, ROWS_PER_GROUP, _chunk(packed))


def pack(weight_int8: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the VNNI kernel's layout, uint8 [N, K]: w + 128, each group of 16 rows stored 4 columns at
    a time (one 64-byte load: 4 values of each of 16 rows)."""
    return _interleave((weight_int8.to(torch.int16) + 128).to(torch.uint8), INT8_GROUP_ROWS, INT8_QUAD)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: int8 [N, K] in row order."""
    return _unshift(_deinterleave(packed, INT8_GROUP_ROWS, INT8_QUAD))


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack`ed int8 matrix as int8 [*ids.shape, K] (a tied embedding's lookup)."""
    return _unshift(_gather(packed, ids, INT8_GROUP_ROWS, INT8_QUAD))


def _interleave(weight: torch.Tensor, group_rows: int, chunk: int) -> torch.Tensor:
    """[N, K] stored as [N/group_rows][K/chunk][group_rows][chunk] (same shape and dtype)."""
    rows, cols = weight.shape
    grouped = weight.reshape(rows // group_rows, group_rows, cols // chunk, chunk)
    return grouped.permute(0, 2, 1, 3).contiguous().reshape(rows, cols)


def _deinterleave(packed: torch.Tensor, group_rows: int, chunk: int) -> torch.Tensor:
    rows, cols = packed.shape
    grouped = packed.reshape(rows // group_rows, cols // chunk, group_rows, chunk).permute(0, 2, 1, 3)
    return grouped.reshape(rows, cols)


def _gather(packed: torch.Tensor, ids: torch.Tensor, group_rows: int, chunk: int) -> torch.Tensor:
    rows, cols = packed.shape
    grouped = packed.view(rows // group_rows, cols // chunk, group_rows, chunk)
    picked = grouped[ids // group_rows, :, ids % group_rows, :]  # [*ids.shape, K/chunk, chunk]
    return picked.reshape(*ids.shape, cols)


def bf16_packed_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times a `pack_rows` bf16 weight [N, K], transposed: [M, N] bf16, fp32 accumulation. Each
    row's result is independent of the other rows (the same bits alone or in any batch)."""
    return torch.ops.tern.bf16_packed_mm(x, packed)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_slots: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence attending to its first context_lens[b] cache slots, read in place: q [B, H, D],
    caches [slots, Hkv, D] (bf16 or fp32), context_slots [B, L] -> [B, H*D], rounded where the matmul path
    (engine/models/attention.py) rounds."""
    return torch.ops.tern.paged_decode_attention(q, k_cache, v_cache, context_slots, context_lens, scale)


def decode_attention_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_decode_attention serves decode steps of this model here."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and head_dim % 16 == 0
            and available())


def int8_vnni_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp32) times the packed int8 weight, times scales [N]: [M, N] in x's dtype."""
    return torch.ops.tern.int8_vnni_mm(x, packed, scales)


def activation_block(cols: int) -> int:
    """Values per activation scale: the largest of 256, 192, 128 that divides the row, else 64 (as the C++)."""
    return next((size for size in (256, 192, 128) if cols % size == 0), CHUNK_BYTES)


def int8_reference(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in plain PyTorch (slow: the specification the tests hold both paths to)."""
    quantized, x_scales = quantize_activations(x)
    rows, blocks, block = quantized.shape
    acc = torch.zeros(rows, weight_int8.shape[0])
    for b in range(blocks):
        dot = quantized[:, b].long() @ weight_int8[:, b * block:(b + 1) * block].long().t()
        acc = acc + dot.float() * x_scales[:, b:b + 1]
    return (acc * scales.float()).to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K/block, block], float32 scales [M, K/block]), rounded as the kernel rounds."""
    rows, cols = x.shape
    block = activation_block(cols)
    values = x.float().reshape(rows, cols // block, block)
    absmax = values.abs().amax(dim=-1)
    # Tensor by tensor: `127.0 / t` is computed as reciprocal(t) * 127, which rounds twice.
    limit = torch.full_like(absmax, 127.0)
    inverse = torch.where(absmax > 0, limit / absmax, torch.zeros_like(absmax))
    quantized = torch.round(values * inverse.unsqueeze(-1)).to(torch.int8)  # half to even, as the kernel
    return quantized, (absmax / limit).contiguous()


def _chunk(weight: torch.Tensor) -> int:
    return CHUNK_BYTES // weight.element_size()


def _unshift(shifted: torch.Tensor) -> torch.Tensor:
    return (shifted ^ 0x80).view(torch.int8)  # stored as w + 128 (mod 256): flipping the top bit gives w


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(compiler: str, cpu_flags: set[str]) -> Path:
    """Compile the kernel into the cache once (keyed by source, torch and CPU), atomically."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [compiler, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    command += [f"-I{path}" for path in cpp_extension.include_paths()]
    links = [f"-L{path}" for path in cpp_extension.library_paths()]
    links += [f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths()]
    links += ["-lc10", "-ltorch_cpu", "-ltorch"]
    parts = [*(source.read_text() for source in SOURCES), torch.__version__, " ".join(command + links),
             " ".join(sorted(cpu_flags))]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    from engine.loader import default_cache_dir  # here: the loader imports quant, which imports this module

    cache = default_cache_dir() / "kernels"
    library = cache / f"tern_kernels-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    logger.info("building Tern's CPU kernels (once per machine, ~20 s)")
    with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
        target = Path(tmp) / library.name
        subprocess.run([*command, *map(str, SOURCES), "-o", str(target), *links],
                       check=True, capture_output=True, text=True)
        os.replace(target, library)
    return library


def _register_fake() -> None:
    """Shapes for torch.compile: the compiled decode step calls the kernel as an opaque op."""
    @torch.library.register_fake("tern::int8_vnni_mm")
    def _(x, packed, scales):
        return x.new_empty(x.shape[0], packed.shape[0])

    if hasattr(torch.ops.tern, "bf16_packed_mm"):
        @torch.library.register_fake("tern::bf16_packed_mm")
        def _(x, packed):
            return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("tern::paged_decode_attention")
    def _(q, k_cache, v_cache, context_slots, context_lens, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
