"""Requests' block tables over the block pool: a table grows by the blocks its next tokens need,
its full pages are indexed in the prefix cache, its blocks go back when it ends or is preempted.
The pool knows blocks; this knows requests. The scheduler and its joins share one.
"""

from __future__ import annotations

from typing import Sequence

from worker.kv.block_pool import BlockPool
from worker.engine.request import Request
from worker.kv.window import RELEASED, first_read_block


def num_pages(num_tokens: int, page_tokens: int) -> int:
    """Pages that hold `num_tokens` tokens, the last one maybe partial."""
    return -(-num_tokens // page_tokens)


class BlockTables:
    def __init__(self, pool: BlockPool, page_tokens: int):
        self.pool = pool
        self.page_tokens = page_tokens

    def num_pages(self, num_tokens: int) -> int:
        return num_pages(num_tokens, self.page_tokens)

    def blocks_needed(self, request: Request, num_new: int) -> int:
        return max(0, self.num_pages(request.num_computed_tokens + num_new) - len(request.block_table))

    def can_grow(self, request: Request, num_new: int) -> bool:
        return self.blocks_needed(request, num_new) <= self.pool.get_num_free_blocks()

    def grow(self, request: Request, num_new: int) -> None:
        request.block_table += self.pool.allocate(self.blocks_needed(request, num_new))

    def cache_full_pages(self, request: Request) -> list[tuple[bytes, bytes | None, int]]:
        """Index the pages of its computed tokens that became full: (key, parent key, block) of each."""
        num_full = request.num_computed_tokens // self.page_tokens
        if num_full <= request.num_cached_pages:
            return []
        keys = request.page_keys(num_full)
        cached = []
        for page in range(request.num_cached_pages, num_full):
            parent = keys[page - 1] if page else None
            request.block_table[page] = self.pool.cache_full_block(request.block_table[page], keys[page], parent)
            cached.append((keys[page], parent, request.block_table[page]))
        request.num_cached_pages = num_full
        return cached

    def index_pages(self, request: Request, start: int, end: int) -> None:
        """Index pages start..end of a request's blocks in the local prefix cache."""
        keys = request.page_keys(end)
        request.block_table[start:end] = self.index_blocks(request.block_table[start:end], keys[start:],
                                                           keys[start - 1] if start else None)

    def index_blocks(self, blocks: Sequence[int], keys: Sequence[bytes], parent: bytes | None) -> list[int]:
        """Index full blocks under their keys, in order, those not indexed yet (pages a step filled
        after pages read in place are: InPlaceJoins.land); the blocks that hold the keys."""
        held = []
        for block, key in zip(blocks, keys):
            if self.pool.block_keys[block] is None:
                block = self.pool.cache_full_block(block, key, parent)
            held.append(block)
            parent = key
        return held

    def release(self, request: Request) -> None:
        """Give its blocks back (its indexed pages stay cached); it computes from the start again."""
        self.pool.release(request.held_blocks())
        request.block_table = []
        request.num_released_blocks = 0
        request.num_cached_pages = 0
        request.num_computed_tokens = 0


def release_passed_blocks(request: Request, pool: BlockPool, window: int, page_tokens: int) -> int:
    """After a step computed some of `request`'s tokens: release the blocks no later query reads;
    returns how many."""
    end = min(first_read_block(request.num_computed_tokens, window, page_tokens), len(request.block_table))
    start = request.num_released_blocks
    if end <= start:
        return 0
    passed = request.block_table[start:end]
    pool.release(passed)
    request.block_table[start:end] = [RELEASED] * (end - start)
    request.num_released_blocks = end
    return end - start
