"""KV cache memory: one tensor for all layers, cut into fixed-size blocks handed out by the block manager."""
from __future__ import annotations

import array
import bisect
import hashlib
from collections import OrderedDict

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
    """Free-block pool, block tables and the prefix cache.

    A sequence holds blocks for all its cached tokens; finishing, cancelling or preempting it gives them back at once.
    With prefix caching, every full block is also registered under a key made of its tokens, the key of the block
    before it and, where the block holds image positions, the image's key: a later sequence whose prompt starts with
    the same blocks shares them (reference-counted) instead of computing them again. A registered block whose last
    user left stays in the pool with its contents; it is reused by a hit or, least recently freed first, taken for new
    tokens (losing its registration) once no never-used block is left.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise kv_cache_memory_mb")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        # allocation order: blocks holding nothing registered first, then registered ones, least recently freed first
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(SCRATCH_BLOCK + 1, num_blocks + 1))
        self.users = [0] * (num_blocks + 1)
        self.key_of: dict[int, bytes] = {}  # block -> its registered key
        self.registered: dict[bytes, int] = {}  # key -> block
        self.hit_tokens = 0  # prompt tokens whose keys and values came from the prefix cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must add to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block, _ = self.free.popitem(last=False)
            if (key := self.key_of.pop(block, None)) is not None:
                del self.registered[key]  # evicted: its contents are about to be overwritten
            self.users[block] = 1
            seq.block_table.append(block)

    def admit(self, seq: Sequence) -> bool:
        """Give a sequence without blocks its whole context: the cached blocks of its longest cached prefix (never
        the block of its last token, which the step must compute), then new ones. False, changing nothing, when the
        pool cannot hold it."""
        hits = []
        if self.prefix_caching:
            for key in self._keys(seq, (seq.num_tokens - 1) // self.block_size):
                if (block := self.registered.get(key)) is None:
                    break
                hits.append(block)
        revived = sum(1 for block in hits if self.users[block] == 0)  # shared from the pool: no longer free
        if -(-seq.num_tokens // self.block_size) - len(hits) + revived > self.num_free:
            return False
        for block in hits:
            self.free.pop(block, None)
            self.users[block] += 1
        seq.block_table = list(hits)
        seq.block_keys = [self.key_of[block] for block in hits]
        seq.num_cached = len(hits) * self.block_size
        self.hit_tokens += seq.num_cached
        self.grow(seq, seq.num_tokens)
        return True

    def register(self, seq: Sequence) -> None:
        """Register the sequence's blocks that became full of cached tokens (called after each step)."""
        if not self.prefix_caching:
            return
        full = seq.num_cached // self.block_size
        for index, key in enumerate(self._keys(seq, full)[len(seq.block_keys):], start=len(seq.block_keys)):
            block = seq.block_table[index]
            if key not in self.registered and block not in self.key_of:  # else another block holds the same already
                self.registered[key], self.key_of[block] = block, key
            seq.block_keys.append(key)

    def release(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # a sequence's last blocks are the first to be taken again
            self.users[block] -= 1
            if self.users[block] == 0:
                self.free[block] = None
                if block not in self.key_of:
                    self.free.move_to_end(block, last=False)  # nothing to keep: used before registered blocks
        seq.block_table, seq.block_keys = [], []
        seq.num_cached = 0

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the sequence's blocks past those `num_tokens` tokens need (speculative positions it rejected:
        never registered, so they go first to the next taker)."""
        while len(seq.block_table) > -(-num_tokens // self.block_size):
            block = seq.block_table.pop()
            self.users[block] -= 1
            if self.users[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _keys(self, seq: Sequence, count: int) -> list[bytes]:
        """Keys of the sequence's first `count` blocks: a 128-bit BLAKE2 digest of the previous block's key, the
        block's tokens and, where the block holds image positions, the image's key; the first block's also digests
        the sequence's `cache_salt` (its adapters). A collision would hand one request another's cache, so the digest
        is cryptographic."""
        keys, tokens, size = list(seq.block_keys[:count]), seq.token_ids, self.block_size
        for index in range(len(keys), count):
            start = index * size
            digest = hashlib.blake2b(keys[-1] if keys else seq.cache_salt, digest_size=16)
            digest.update(array.array("q", tokens[start:start + size]).tobytes())
            if seq.embed_positions and bisect.bisect_left(seq.embed_positions, start) < \
                    bisect.bisect_left(seq.embed_positions, start + size):
                digest.update(seq.embeds_key)
            keys.append(digest.digest())
        return keys
