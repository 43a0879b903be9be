"""The KV pool's memory on the CPU: zeroed by the kernel, made resident by a background thread.

The pool (1 GiB by default) must be resident soon after start: blocks are handed out least recently freed first,
so traffic touches all of it over time, and a server whose memory grew by the pool under load looked like a leak
(tests/e2e/test_soak.py). Writing it whole before the engine reported ready cost a 1B model's start 1.4 s of its
~7 on a 2-core Intel VM whose huge pages fault in slowly (0.2 s on a Zen 5 one). Anonymous memory comes from the
kernel zeroed, and MADV_POPULATE_WRITE (Linux 5.14) faults every page of it in without writing to any, so a thread
can do that while the engine already stores keys and values: a page the engine wrote first keeps its contents.
Where the kernel lacks it, the pool is written with zeros at once, as before, while nothing else can touch it.
"""
from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

from engine.held_work import HeldWork
from engine.huge_pages import libc_madvise, requested as huge_pages_requested

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module has no name for it before 3.13


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in memory of its own that nothing has touched yet (so takes no time to allocate).
    In 2 MB pages where torch's allocator is asked for them (THP_MEM_ALLOC_ENABLE=1, tern/allocator_env.py):
    this memory does not come from that allocator, so it follows its setting here."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_requested():
        buffer.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the buffer (its storage keeps the exported view): the mapping lives as long as the tensor.
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def make_resident(tensors: list[torch.Tensor]) -> Population:
    """Fault every page of `tensors` (made by zeroed) in, on a thread of its own where the kernel can do it without
    writing to them, else now by writing zeros."""
    if not tensors or not _populate(tensors[0], first_page_only=True):
        for tensor in tensors:
            tensor.zero_()
        return Population([])
    return Population(tensors)


class Population(HeldWork):
    """The pool's pages faulting in on a thread of its own (make_resident), stopped with its engine
    (engine/held_work.py); wait() returns once every page is in memory, or stop() ended it first."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__(tensors, name="tern-kv-pages")

    def work(self, tensors: list[torch.Tensor]) -> None:
        while tensors and not self.stopping:
            _populate(tensors.pop())


def _populate(tensor: torch.Tensor, first_page_only: bool = False) -> bool:
    """MADV_POPULATE_WRITE over the tensor's memory. False where the kernel refuses it (before 5.14: EINVAL)."""
    length = mmap.PAGESIZE if first_page_only else tensor.numel() * tensor.element_size()
    if libc_madvise()(tensor.data_ptr(), length, _MADV_POPULATE_WRITE) == 0:
        return True
    logger.info("the kernel cannot populate the KV pool's pages (errno %d): writing it whole now", ctypes.get_errno())
    return False
