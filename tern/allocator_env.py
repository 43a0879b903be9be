"""The environment torch's CPU allocator reads once, at its first allocation, so a process serving a model must
have it before torch's import: app.py puts it in its own environment first thing, deploy/ray_serve.py in each
replica's runtime_env. No imports beyond the standard library, for that reason.

THP_MEM_ALLOC_ENABLE=1: tensors of 2 MB and up (the weights, the KV pool) in transparent huge pages where the
kernel offers them on request (/sys/kernel/mm/transparent_hugepage/enabled `madvise` or `always`), so each decode
step streams the weights through 2 MB pages instead of 4 KB ones. A 1B-shaped Q4_0 file on 2 Zen 5 cores: one
stream 73-76 tok/s against 67-73, 16 streams 431-435 against 400-420. An operator's own value wins (=0: off).
The weights are written in 4 KB pages and moved into huge ones after start (engine/huge_pages.py): their huge
pages fault in slowly on some VMs.
"""
from __future__ import annotations

import os

_TERN_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def allocator_env() -> dict[str, str]:
    """The variables with the operator's values where set, else Tern's."""
    return {name: os.environ.get(name, value) for name, value in _TERN_DEFAULTS.items()}
