"""The KV pool's CPU memory (engine/pool_memory.py): zeros that cost nothing to allocate, made resident by a
background thread that never overwrites what the engine stored first."""
from __future__ import annotations

import ctypes
import mmap

import torch

from engine import pool_memory
from engine.kv_cache import KVCache


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(pages in memory, pages) of a tensor's page-aligned memory, as mincore(2) reports them."""
    length = tensor.numel() * tensor.element_size()
    pages = -(-length // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(tensor.data_ptr(), length, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector), pages


def test_a_zeroed_tensor_takes_no_memory_until_made_resident_and_then_all_of_it():
    tensors = [pool_memory.zeroed((1024, 8, 64), torch.bfloat16) for _ in range(4)]  # 1 MiB each
    assert all(resident_pages(t)[0] == 0 for t in tensors)  # allocated, nothing touched
    resident = pool_memory.make_resident(tensors)
    assert resident.wait(60)
    for tensor in tensors:
        in_memory, pages = resident_pages(tensor)
        assert in_memory == pages
        assert tensor.shape == (1024, 8, 64) and tensor.dtype == torch.bfloat16 and not tensor.any()


def test_what_is_stored_while_the_pages_fault_in_survives_them():
    """The engine stores keys as soon as it is ready, while the thread still populates: every value it wrote,
    anywhere in the pool, is there afterwards, and everything else still reads zero."""
    tensors = [pool_memory.zeroed((4096, 8, 64), torch.float32) for _ in range(8)]  # 8 MiB each
    resident = pool_memory.make_resident(tensors)
    rows = [0, 1, 2047, 2048, 4095]
    for i, tensor in enumerate(tensors):
        tensor[rows] = float(i + 1)
    assert resident.wait(60)
    for i, tensor in enumerate(tensors):
        assert (tensor[rows] == float(i + 1)).all()
        rest = torch.ones(tensor.shape[0], dtype=torch.bool)
        rest[rows] = False
        assert not tensor[rest].any()


def test_a_kv_cache_reports_its_pool_resident():
    cache = KVCache(2, 64, 16, 2, 64, torch.bfloat16, "cpu")
    assert cache.wait_resident(60)
    assert all(resident_pages(t)[0] == resident_pages(t)[1] for t in (*cache.keys, *cache.values))
    assert not any(t.any() for t in (*cache.keys, *cache.values))


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_pool_stopped_while_faulting_in_is_neither_faulted_in_nor_held_after():
    """An engine stopped (a model unloaded) while its pool still faults in: once stop() returns, the thread faults
    no more of it in and holds none of it, so the pool's memory goes with the last tensor (2 GiB here, which takes
    the thread a second or more; stopped at once, it gets through a tensor or two of the 32)."""
    before = rss_mib()
    tensors = [pool_memory.zeroed((64 << 20,), torch.uint8) for _ in range(32)]
    population = pool_memory.make_resident(tensors)
    population.stop()
    assert population.wait(0)  # ended: no thread left running
    faulted_in = sum(resident_pages(t)[0] for t in tensors) * mmap.PAGESIZE / 2**20
    assert faulted_in < 1024, f"{faulted_in:.0f} MiB of 2,048 faulted in after stop()"
    del tensors
    assert rss_mib() - before < 256  # the thread kept no tensor: the pool was unmapped with ours
