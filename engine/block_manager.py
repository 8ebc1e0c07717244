"""Paged KV-cache block bookkeeping: reference counts, a free list and prefix caching by chained block hashes.

A full block's hash covers its own tokens and the hash of the block before it, so two sequences share a block only
when their whole prefixes agree. Freed blocks keep their hash until they are reused, which lets a later request
with the same prefix pick them up again (least recently freed blocks are reused first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from .sequence import Sequence


def block_hash(prev: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if prev is not None:
        h.update(prev)
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block (got {num_blocks})")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Parallel lists rather than one object per block: a CPU cache can have 10^5+ blocks and start-up pays
        # for every object made here.
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Insertion order = order of freeing, so popping from the front reuses the coldest block first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_queries = 0  # full blocks looked up
        self.prefix_hits = 0  # full blocks found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:  # evict its cached content
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
            self.block_hash[block_id] = None
        self.ref_count[block_id] = 1
        return block_id

    def _extend_hashes(self, seq: Sequence, num_full: int) -> list[bytes]:
        """Hashes of the first `num_full` blocks, computed incrementally and kept on the sequence."""
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_full):
            prev = hashes[-1] if hashes else None
            hashes.append(block_hash(prev, seq.token_slice(i * bs, (i + 1) * bs)))
        return hashes[:num_full]

    def allocate_prefix(self, seq: Sequence) -> None:
        """On first scheduling: reuse cached blocks for the longest matching prefix of full blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        # Keep at least one token to compute, so the step produces logits for the next token.
        num_full = (seq.num_tokens - 1) // self.block_size
        for h in self._extend_hashes(seq, num_full):
            self.prefix_queries += 1
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            self.prefix_hits += 1
            if self.ref_count[block_id] == 0:
                del self.free[block_id]
            self.ref_count[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False (and no change) when out of blocks."""
        if not self.can_allocate(seq, num_new_tokens):
            return False
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step: publish the hashes of blocks that are now full, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_committed_blocks:  # the common decode step: no block filled up
            return
        hashes = self._extend_hashes(seq, num_full)
        for i in range(seq.num_committed_blocks, num_full):
            block_id = seq.block_table[i]
            if self.block_hash[block_id] is None:
                self.block_hash[block_id] = hashes[i]
                self.hash_to_block.setdefault(hashes[i], block_id)
        seq.num_committed_blocks = num_full

    def free_seq(self, seq: Sequence) -> None:
        # Free in reverse so the tail of a sequence (least likely to be shared) is reused first.
        for block_id in reversed(seq.block_table):
            self.ref_count[block_id] -= 1
            assert self.ref_count[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_count[block_id] == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
