"""Paged KV storage and its block allocator (free list + reference counts)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator

import torch

from engine import pool_memory


class BlockAllocator:
    """Hands out fixed-size KV blocks by id. Plain Python: the scheduler uses it without touching tensors.

    Prefix caching: a full block can be registered under the hash of its tokens (and of every token before
    it). A freed block keeps its hash and stays findable until it is handed out again; the free list is in
    order of release, so the least recently used cached blocks are reused first. Reference counts let several
    sequences share one cached block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> hash of its content, for registered blocks
        self._block_of: dict[bytes, int] = {}  # the inverse
        self.num_cached_hits = 0  # blocks reused from the cache since start

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)  # its old content is about to be overwritten
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            assert self._ref_counts[block] > 0, f"block {block} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def register(self, block: int, content_hash: bytes) -> None:
        """Record that block now holds the (full) content with this hash."""
        if content_hash not in self._block_of and block not in self._hash_of:
            self._block_of[content_hash] = block
            self._hash_of[block] = content_hash

    def take_cached(self, content_hash: bytes) -> int | None:
        """The block holding this content, with one more reference, or None if no block holds it."""
        block = self._block_of.get(content_hash)
        if block is None:
            return None
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1
        self.num_cached_hits += 1
        return block

    def cached_hashes(self) -> list[bytes]:
        """The hashes of every block the prefix cache can still find, for a router placing requests where their
        prefix is. Any thread may ask: dict.copy() runs without releasing the GIL, so the engine thread cannot change
        the index in the middle of it."""
        return list(self._block_of.copy())

    def _forget(self, block: int) -> None:
        content_hash = self._hash_of.pop(block, None)
        if content_hash is not None:
            del self._block_of[content_hash]


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Hash of a full block's tokens chained to the hash of the blocks before it (a cryptographic hash: a
    client must not be able to craft a collision and read another client's cached context)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def prefix_block_hashes(token_ids: list[int], block_size: int) -> Iterator[bytes]:
    """The hashes a prompt's reusable KV blocks are cached under, first to last, each computed when asked for: one
    per block wholly before the last token (that token is always computed: its logits give the next token), each
    chained to the one before. The scheduler looks a fresh sequence's blocks up by them; deploy/ routes by them."""
    parent = b""
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        yield parent


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCache:
    """One K and one V tensor per layer, each shaped [num_blocks * block_size, num_kv_heads, head_dim]: the
    slots of block b are rows b * block_size ... (b + 1) * block_size - 1.

    Every layer's tensors have their own storage and no block dimension: the compiled decode step writes them
    in place, and graph inputs that alias one storage, or writes through a view, made torch.compile copy the
    whole cache at every step. One extra row past the last block, the scratch slot, belongs to no sequence:
    padding rows of a CUDA-graph decode step write their K/V there.
    """

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> None:
        self.scratch_slot = num_blocks * block_size
        shape = (num_blocks * block_size + 1, num_kv_heads, head_dim)
        # Resident whole soon after start, not left to grow page by page as first used (engine/pool_memory.py
        # says why); on the CPU by a background thread, so the engine is ready while its pages fault in.
        on_cpu = torch.device(device).type == "cpu"

        def layer() -> torch.Tensor:
            return pool_memory.zeroed(shape, dtype) if on_cpu else torch.zeros(shape, dtype=dtype, device=device)

        self.keys = [layer() for _ in range(num_layers)]
        self.values = [layer() for _ in range(num_layers)]
        self._population = pool_memory.make_resident([*self.keys, *self.values]) if on_cpu else None  # None: already
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype, self.head_dim = dtype, head_dim

    def wait_resident(self, timeout_s: float | None = None) -> bool:
        """Block until every page of the pool is in memory; True once it is."""
        return self._population is None or self._population.wait(timeout_s)

    def stop_faulting_in(self) -> None:
        """End the thread that faults the pool in, if it still runs (the engine is stopping: see Population)."""
        if self._population is not None:
            self._population.stop()

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values))

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize
