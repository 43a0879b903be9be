"""Tern's native CPU kernels: one dispatcher that picks the instruction set once (dispatch.py), the build of the
C++ sources in csrc/ (build.py), and the packed weight layouts they read (layouts.py). README.md says what was
measured to choose them. The PyTorch references the kernels are held to live in the tests."""
from engine.kernels.dispatch import (
    ENV_VAR,
    GGUF_REPACK_LAYOUTS,
    PATHS,
    CpuKernels,
    KernelsUnavailable,
    describe_path,
    kernels_for,
    planned_path,
    prebuild,
    select,
    unsupported_reason,
)

__all__ = ["ENV_VAR", "GGUF_REPACK_LAYOUTS", "PATHS", "CpuKernels", "KernelsUnavailable", "describe_path", "kernels_for", "planned_path",
           "prebuild", "select", "unsupported_reason"]
