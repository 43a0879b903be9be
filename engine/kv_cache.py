"""Paged KV storage and its block allocator (free list + reference counts)."""
from __future__ import annotations

from collections import deque

import torch


class BlockAllocator:
    """Hands out fixed-size KV blocks by id. Plain Python: the scheduler uses it without touching tensors.

    Reference counts let several sequences share a block later (prefix caching, n > 1); today every block has
    one owner.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

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
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            assert self._ref_counts[block] > 0, f"block {block} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCache:
    """One K and one V tensor per layer, shaped [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.keys[i], self.values[i]) for i in range(self.keys.shape[0])]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize
