"""Weights written in 4 KB pages, moved into 2 MB ones once the engine is ready.

app.py asks torch's allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE=1, tern/allocator_env.py): each
decode step then streams the weights through 2 MB pages instead of 4 KB ones (a 1B model's one stream 6-8% faster
on a 2-core Intel VM). But where huge pages fault in slowly (that VM: 1 GiB in 1.4 s, 0.2 s in 4 KB pages), writing
the weights into them put ~1.1 s on a 3B model's start. So while a model loads, the process has huge pages turned
off (prctl PR_SET_THP_DISABLE: the allocator's advice stays on the memory, faults take 4 KB pages), and once the
engine is ready a thread asks the kernel to collapse the weights into huge pages in place (MADV_COLLAPSE, Linux
6.1) while the engine reads them. Where huge pages are not asked for, the kernel cannot collapse, or the operator
turned them off for the process, loading is as before.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

from engine.held_work import HeldWork

logger = logging.getLogger(__name__)

_PR_SET_THP_DISABLE, _PR_GET_THP_DISABLE = 41, 42  # linux/prctl.h
_MADV_COLLAPSE = 25  # linux/mman.h (Linux 6.1)
_HUGE_PAGE = 2 << 20

_lock = threading.Lock()
_loading = 0  # models loading now with huge pages turned off by us


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def libc_madvise():
    """libc's madvise(addr, length, advice); a ctypes call lets go of the GIL while it runs."""
    madvise = _libc().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def requested() -> bool:
    """Whether this process asks for huge pages (tern/allocator_env.py; the operator may set it to 0)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and hasattr(mmap, "MADV_HUGEPAGE")


@functools.cache
def _can_collapse() -> bool:
    """Whether the kernel collapses memory into huge pages on request: tried once on 4 MB of scratch memory."""
    buffer = mmap.mmap(-1, 2 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    scratch = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -scratch.data_ptr() % _HUGE_PAGE  # the first 2 MB boundary inside
    scratch[start] = 1
    works = libc_madvise()(scratch.data_ptr() + start, _HUGE_PAGE, _MADV_COLLAPSE) == 0
    if not works:
        logger.info("weights load in huge pages: the kernel cannot collapse memory into them later (errno %d)",
                    ctypes.get_errno())
    return works


@contextlib.contextmanager
def small_pages_while_loading() -> Iterator[bool]:
    """Huge pages off for the process while the body loads a model (until the last of several concurrent loads
    ends); yields whether they were, i.e. whether the weights are to be collapsed after (collapse_in_background)."""
    global _loading
    with _lock:
        deferring = _loading > 0 or (requested() and _can_collapse() and _thp_enabled_for_process() and _set_disabled(1))
        if deferring:
            _loading += 1
    try:
        yield deferring
    finally:
        if deferring:
            with _lock:
                _loading -= 1
                if _loading == 0:
                    _set_disabled(0)


def _thp_enabled_for_process() -> bool:
    return _libc().prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) == 0  # 1: the operator (or a parent) turned them off


def _set_disabled(disabled: int) -> bool:
    return _libc().prctl(_PR_SET_THP_DISABLE, disabled, 0, 0, 0) == 0


class BackgroundCollapse(HeldWork):
    """The weights' move into huge pages on a thread of its own (collapse_in_background), stopped with its engine
    (engine/held_work.py): MADV_COLLAPSE on storages an unloaded model had freed, which the allocator had taken back
    or handed to the next model, made them resident again (a round of bench/unload_memory.py kept 1.2 GB after its
    unload)."""

    def __init__(self, tensors: list[torch.Tensor], after: Callable[[], object] | None) -> None:
        self._after = after
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if t.device.type == "cpu"}
        super().__init__(list(storages.values()), name="tern-huge-pages")

    def work(self, storages: list) -> None:
        if self._after is not None:
            self._after()
        started, collapsed, total = time.monotonic(), 0, sum(storage.nbytes() for storage in storages)
        while storages and not self.stopping:
            storage = storages.pop()
            address, nbytes = storage.data_ptr(), storage.nbytes()
            start = address + -address % _HUGE_PAGE
            end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
            if end > start and libc_madvise()(start, end - start, _MADV_COLLAPSE) == 0:
                collapsed += end - start
            del storage  # this thread holds none it is done with
        logger.info("weights in huge pages: %d MB of %d MB collapsed in %.1f s%s", collapsed >> 20, total >> 20,
                    time.monotonic() - started, " (stopped)" if self.stopping else "")


def collapse_in_background(tensors: list[torch.Tensor],
                           after: Callable[[], object] | None = None) -> BackgroundCollapse:
    """Collapse the memory of `tensors` (each distinct storage's whole 2 MB pages) into huge pages on a thread of
    its own, once after() has returned (the KV pool's faulting in: the two do not then share the cores)."""
    return BackgroundCollapse(tensors, after)


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers of a huge page and more: its weights."""
    return [t for t in [*model.parameters(), *model.buffers()] if t.untyped_storage().nbytes() >= _HUGE_PAGE]
