"""Build Tern's CPU kernels into one shared library, once per machine, and load it as torch.ops.tern.

Each kernel file is compiled with its own instruction-set flags (AVX2 files with -mavx2 -mfma -mf16c, so they are
AVX2 code even on an AVX512 machine), in parallel; only ops.cpp (with decode_step.h) includes torch's headers. The library is kept in
`<cache dir>/kernels`, named by a hash of the sources, flags, compiler and torch version; a cache folder that
cannot be written falls back to a temporary one. A build that hangs is stopped after BUILD_TIMEOUT_S.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BUILD_TIMEOUT_S = 300
# -ffp-contract=off everywhere: a fused multiply-add where the source has none would round differently from the
# PyTorch references the tests hold the kernels to.
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffp-contract=off")
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx512_bf16": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
    "amx": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile",
            "-mamx-int8"),
}
# Source file -> the instruction set it is compiled for. Headers are hashed too (they change what compiles).
KERNEL_SOURCES = {
    "quantize_avx2.cpp": "avx2",
    "int4_avx2.cpp": "avx2",
    "q5k_avx2.cpp": "avx2",
    "q6k_avx2.cpp": "avx2",
    "q8_avx2.cpp": "avx2",
    "decode_attention_avx2.cpp": "avx2",
    "silu_avx2.cpp": "avx2",
    "gguf_repack_avx2.cpp": "avx2",
    "bf16_fma_avx2.cpp": "avx2",
    "int4_avx512.cpp": "avx512",
    "q5k_avx512.cpp": "avx512",
    "q6k_avx512.cpp": "avx512",
    "q8_avx512.cpp": "avx512",
    "decode_attention_avx512.cpp": "avx512",
    "silu_avx512.cpp": "avx512",
    "bf16_fma_avx512.cpp": "avx512",
    "bf16_avx512.cpp": "avx512_bf16",
    "int4_amx.cpp": "amx",
    "q6k_amx.cpp": "amx",
    "q8_amx.cpp": "amx",
}

OPS_ISA = "avx2"  # ops.cpp (the torch bindings and the native decode step): every kernel path needs AVX2


class BuildError(RuntimeError):
    """The kernels could not be built or loaded here; the message is one line saying why."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def load_library(isas: tuple[str, ...], cache_dir: Path) -> Path:
    """Build (once) and load the library holding ops.cpp and the kernels of `isas` (a subset of ISA_FLAGS);
    return its path. Raises BuildError."""
    cxx = compiler()
    if not cxx:
        raise BuildError("no C++ compiler (g++) to build them")
    sources = [name for name, isa in KERNEL_SOURCES.items() if isa in isas]
    defines = [f"-DTERN_WITH_{isa.upper()}" for isa in isas]
    key = _key(cxx, sources, defines)
    cache, temporary = cache_dir / "kernels", Path(tempfile.gettempdir()) / f"tern-kernels-{os.getuid()}"
    problems = []
    for folder in (cache, temporary):
        library = folder / f"tern_kernels-{key}.so"
        if not library.exists():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                _build(cxx, sources, defines, folder, library)
            except OSError as exc:  # a read-only or full cache: build in the next folder
                problems.append(f"{folder}: {exc.strerror or exc}")
                then = "; building the CPU kernels in a temporary folder" if folder == cache else ""
                logger.warning("cannot write the CPU kernels to %s (%s)%s", folder, exc.strerror or exc, then)
                continue
        try:
            torch.ops.load_library(str(library))
        except OSError as exc:
            raise BuildError(f"loading {library.name} failed: {exc}") from None
        return library
    raise BuildError(f"no writable folder to build them in ({'; '.join(problems)})")


def _key(cxx: str, sources: list[str], defines: list[str]) -> str:
    parts = [torch.__version__, _compiler_version(cxx), " ".join(COMMON_FLAGS), " ".join(defines)]
    for path in sorted(CSRC.glob("*.h")) + [CSRC / "ops.cpp"] + [CSRC / name for name in sources]:
        isa = OPS_ISA if path.name == "ops.cpp" else KERNEL_SOURCES.get(path.name, "")
        parts += [path.name, " ".join(ISA_FLAGS.get(isa, ())), path.read_text()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return cxx


def _build(cxx: str, sources: list[str], defines: list[str], folder: Path, library: Path) -> None:
    """Compile every file in parallel (ops.cpp, with torch's headers, takes ~15 s; each kernel ~1 s), link,
    then move the library into place atomically, so a concurrent start never loads half a file."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    torch_flags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H", "-fopenmp",
                   *(f"-I{path}" for path in cpp_extension.include_paths())]
    links = [f"-L{path}" for path in cpp_extension.library_paths()]
    links += [f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths()]
    links += ["-lc10", "-ltorch_cpu", "-ltorch", "-fopenmp"]
    started = time.monotonic()
    logger.info("building Tern's CPU kernels (once per machine, ~20 s) into %s", folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
        jobs = [[cxx, *COMMON_FLAGS, *ISA_FLAGS[OPS_ISA], *defines, *torch_flags, "-c", str(CSRC / "ops.cpp"), "-o",
                 f"{tmp}/ops.o"]]
        jobs += [[cxx, *COMMON_FLAGS, *ISA_FLAGS[KERNEL_SOURCES[name]], "-c", str(CSRC / name), "-o", f"{tmp}/{name}.o"]
                 for name in sources]
        with concurrent.futures.ThreadPoolExecutor(max(os.cpu_count() or 1, 1)) as pool:
            for _ in pool.map(_run, jobs):
                pass
        target = Path(tmp) / library.name
        objects = [f"{tmp}/ops.o", *(f"{tmp}/{name}.o" for name in sources)]
        _run([cxx, "-shared", *objects, "-o", str(target), *links])
        os.replace(target, library)
    for stale in folder.glob("tern_kernels-*.so"):  # earlier sources' builds (a process using one keeps its copy)
        if stale != library:
            stale.unlink(missing_ok=True)
    logger.info("built the CPU kernels in %.1f s", time.monotonic() - started)


def _run(command: list[str]) -> None:
    what = Path(command[command.index("-c") + 1]).name if "-c" in command else "linking"
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{what} took over {BUILD_TIMEOUT_S} s to compile") from None
    except subprocess.CalledProcessError as exc:
        lines = ([line for line in exc.stderr.splitlines() if "error" in line] or exc.stderr.strip().splitlines()
                 or [f"exit status {exc.returncode}, nothing on stderr"])
        raise BuildError(f"the compiler failed on {what}: {lines[0][:300]}") from None
