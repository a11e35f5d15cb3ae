"""KV cache memory: one tensor for all layers, cut into fixed-size blocks handed out by the block manager."""
from __future__ import annotations

from collections import deque

import torch

from backends.llm.fp8 import FP8
from backends.llm.sequence import Sequence


def kv_bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


SCRATCH_BLOCK = 0  # never given to a sequence: padded rows of a fixed-shape (CUDA graph) step write and read here


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One allocation of `num_blocks` usable blocks plus the scratch block; each layer gets (keys, values) views of
    shape [num_blocks + 1, block_size, kv_heads, head_dim]. An FP8 cache is stored as uint8 (copying and indexing
    kernels take bytes on every device) and read through `.view(FP8)`."""
    storage = torch.uint8 if dtype == FP8 else dtype
    cache = torch.zeros(num_layers, 2, num_blocks + 1, block_size, kv_heads, head_dim, dtype=storage, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]


class BlockManager:
    """Free-block pool and block tables. A sequence holds blocks for all its cached tokens; finishing, cancelling or
    preempting it returns them at once."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise kv_cache_memory_mb")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(SCRATCH_BLOCK + 1, num_blocks + 1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must add to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self.free_blocks.popleft())

    def release(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
