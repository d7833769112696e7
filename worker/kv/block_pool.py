"""The worker's KV block pool: one array in the KV dtype, a free list, reference counts and a local
prefix cache of full pages by key. Knows blocks and keys, not sequences or the scheduler.

A block is free (on the free list, holds nothing), referenced (ref count > 0, used by running
sequences), or cached-idle (ref count 0, still indexed by its page key so a later prompt can reuse
it). Callers count cached-idle blocks as available: allocating takes a free block first and
otherwise evicts one cached-idle page, leaves first, least recently used first, so every cached
page's parent stays cached.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from worker.kv.block_arena import BlockArena


class BlockPool:
    """`num_blocks` blocks of `block_shape` values, one array: `kv[block_id]` is one page.

    `dtype` is the KV dtype: a float16 pool holds the rounded values the forward computes
    (docs/architecture.md), in half the memory, and a fetched page lands in it as it came; an int8
    or int4 pool (uint8) holds pages' bytes (worker/kv/quant.py).
    """

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype=np.float32, arena: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the pool needs at least one block, got {num_blocks}")
        if np.dtype(dtype) not in (np.float32, np.float16, np.uint8):
            raise ValueError(f"the pool holds float32, float16 or bytes (int8, int4 KV), not {np.dtype(dtype)}")
        self.num_blocks = num_blocks
        # Written once now, not lazily zero-mapped (np.zeros): the first write into an untouched
        # block page-faults, and a warm fetch paid those faults inside the request's time to first
        # token (docs/benchmarks-log.md).
        # With `arena`, the blocks open a range that windows onto same-host kvnodes' pools follow
        # (worker/kv/block_arena.py), so fetched pages can be read where they lie.
        self.arena = BlockArena.make(num_blocks, block_shape, dtype) if arena else None
        self.kv = self.arena.local if self.arena is not None else np.empty((num_blocks, *block_shape), dtype=dtype)
        self.kv.fill(0.0)
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.block_parents: list[bytes | None] = [None] * num_blocks
        self.block_ticks = [0] * num_blocks
        self.cached_children: list[set[int]] = [set() for _ in range(num_blocks)]
        self.num_idle_children = [0] * num_blocks  # cached children with ref count 0 (see _is_evictable)
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.key_to_block: dict[bytes, int] = {}
        # (tick, block_id) of evictable pages, invalidated lazily as in the kvnode store: an entry is
        # valid while its page is still evictable and untouched since. O(log n) amortized.
        self._evictable_heap: list[tuple[int, int]] = []
        self._num_cached_idle = 0
        self._tick = 0
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus cached-idle ones (each can be evicted)."""
        return len(self.free_block_ids) + self._num_cached_idle

    def get_num_cached_blocks(self) -> int:
        return len(self.key_to_block)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `keys` (takes no reference)."""
        blocks = []
        for key in keys:
            block_id = self.key_to_block.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_idle(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks are cached-idle (referencing them makes them unavailable)."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    # ---- operations ----------------------------------------------------------

    def ref(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            assert self.block_keys[block_id] is not None or self.ref_counts[block_id] > 0, (
                f"block {block_id} is free: allocate it, do not ref it")
            if self.ref_counts[block_id] == 0:
                self._num_cached_idle -= 1
                self._count_idle_child(block_id, -1)
            self.ref_counts[block_id] += 1
            self._touch(block_id)

    def allocate(self, num: int) -> list[int]:
        """`num` blocks holding nothing, each with one reference; evicts cached-idle pages if needed."""
        if num > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {num} blocks: only {self.get_num_free_blocks()} available")
        blocks = []
        for _ in range(num):
            block_id = self.free_block_ids.pop() if self.free_block_ids else self._evict_one()
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; idle cached blocks stay cached, others go free.

        Blocks are touched in order, so a sequence's later pages count as more recently used.
        """
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} released more often than referenced"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] > 0:
                continue
            if self.block_keys[block_id] is None:
                self.free_block_ids.append(block_id)
            else:
                self._num_cached_idle += 1
                self._count_idle_child(block_id, +1)
                self._touch(block_id)

    def cache_full_block(self, block_id: int, key: bytes, parent_key: bytes | None) -> int:
        """Index a referenced, now full block under `key`; returns the block that holds the key.

        `parent_key` is the key of the page before (None for a sequence's first page). When the
        key is already cached elsewhere, that block gains a reference, `block_id` is released,
        and the caller must use the returned block instead (equal keys mean equal content). When
        the parent is no longer cached (see _uncache_subtree) the block stays unindexed.
        """
        assert self.ref_counts[block_id] > 0, f"block {block_id} is not referenced"
        assert self.block_keys[block_id] is None, f"block {block_id} is cached already"
        existing = self.key_to_block.get(key)
        if existing is not None:
            self.ref([existing])
            self.release([block_id])
            return existing
        if parent_key is not None:
            parent = self.key_to_block.get(parent_key)
            if parent is None:
                return block_id
            self.cached_children[parent].add(block_id)
        self.key_to_block[key] = block_id
        self.block_keys[block_id] = key
        self.block_parents[block_id] = parent_key
        self._touch(block_id)
        return block_id

    # ---- internals -----------------------------------------------------------

    def _touch(self, block_id: int) -> None:
        self._tick += 1
        self.block_ticks[block_id] = self._tick
        if self._is_evictable(block_id):
            self._push_evictable(block_id)

    def _is_evictable(self, block_id: int) -> bool:
        """Idle, cached, and without idle cached children: leaves first. Without sliding windows a
        sequence references its whole page chain, so a referenced page's parent is referenced too and
        this is plain leaves-first eviction; with one, see _uncache_subtree."""
        return (self.ref_counts[block_id] == 0 and self.block_keys[block_id] is not None
                and self.num_idle_children[block_id] == 0)

    def _count_idle_child(self, block_id: int, change: int) -> None:
        """A cached block turned idle (+1), or referenced or evicted (-1): its parent's count."""
        parent_key = self.block_parents[block_id]
        if self.block_keys[block_id] is None or parent_key is None:
            return
        parent = self.key_to_block[parent_key]
        self.num_idle_children[parent] += change
        if change < 0 and self._is_evictable(parent):
            self._push_evictable(parent)

    def _push_evictable(self, block_id: int) -> None:
        heapq.heappush(self._evictable_heap, (self.block_ticks[block_id], block_id))
        if len(self._evictable_heap) > 2 * self.num_blocks + 64:
            self._evictable_heap = [(self.block_ticks[b], b) for b in range(self.num_blocks) if self._is_evictable(b)]
            heapq.heapify(self._evictable_heap)

    def _evict_one(self) -> int:
        while self._evictable_heap:
            tick, block_id = heapq.heappop(self._evictable_heap)
            if tick == self.block_ticks[block_id] and self._is_evictable(block_id):
                break
        else:
            raise AssertionError("no evictable block although cached-idle blocks are counted")
        self._count_idle_child(block_id, -1)
        parent_key = self.block_parents[block_id]
        if parent_key is not None:
            self.cached_children[self.key_to_block[parent_key]].discard(block_id)
        self._uncache_subtree(block_id)
        return block_id

    def _uncache_subtree(self, root: int) -> None:
        """Unindex `root` (idle, being taken) and every cached page below it.

        A sequence under a sliding window releases its early pages while it still holds their
        children (worker/kv/window.py), so an idle page may have only referenced children. Such a
        page can be evicted too, and its whole cached subtree goes with it, since lookups walk from
        the root and could reach none of it: referenced descendants stay with their holders,
        unindexed (freed when released), idle ones are freed. So every cached-idle block stays
        reclaimable."""
        stack = [root]
        while stack:
            block_id = stack.pop()
            stack.extend(self.cached_children[block_id])
            self.cached_children[block_id] = set()
            self.num_idle_children[block_id] = 0
            del self.key_to_block[self.block_keys[block_id]]
            self.block_keys[block_id] = None
            self.block_parents[block_id] = None
            self.num_evictions += 1
            if self.ref_counts[block_id] == 0:
                self._num_cached_idle -= 1
                if block_id != root:
                    self.free_block_ids.append(block_id)

    # ---- invariants (tests call this after every step) -----------------------

    def check_invariants(self) -> None:
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is free twice"
        for block_id in range(self.num_blocks):
            refs, key = self.ref_counts[block_id], self.block_keys[block_id]
            assert refs >= 0, f"block {block_id} has ref count {refs}"
            if block_id in free:
                assert refs == 0 and key is None, f"block {block_id} is both free and used (refs {refs})"
            else:
                assert refs > 0 or key is not None, f"block {block_id} is neither free, referenced nor cached"
        assert {k: b for b, k in enumerate(self.block_keys) if k is not None} == self.key_to_block, "index out of sync"
        children: list[set[int]] = [set() for _ in range(self.num_blocks)]
        for block_id, key in enumerate(self.block_keys):
            parent_key = self.block_parents[block_id]
            if key is not None and parent_key is not None:
                assert parent_key in self.key_to_block, f"page {key.hex()} is cached but its parent is not"
                children[self.key_to_block[parent_key]].add(block_id)
        assert children == self.cached_children, "children out of sync"
        idle_children = [sum(1 for c in kids if self.ref_counts[c] == 0) for kids in children]
        assert idle_children == self.num_idle_children, "idle-children counts out of sync"
        idle = [b for b in range(self.num_blocks) if self.ref_counts[b] == 0 and self.block_keys[b] is not None]
        assert len(idle) == self._num_cached_idle, f"cached-idle count {self._num_cached_idle} != {len(idle)}"
        entries = set(self._evictable_heap)
        for block_id in range(self.num_blocks):
            if self._is_evictable(block_id):
                assert (self.block_ticks[block_id], block_id) in entries, f"page {block_id} cannot be evicted"
