"""The block pool: reference counts, the prefix cache, leaves-first LRU eviction (and past pages a
sliding window released), invariants."""

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.kv.block_pool import BlockPool

SHAPE = (1, 2, 1, 4, 2)


def key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def cache_chain(pool: BlockPool, names: list[str]) -> list[int]:
    """Allocate and index a chain of pages a -> b -> ... as one sequence would; returns its blocks."""
    blocks = pool.allocate(len(names))
    for i, name in enumerate(names):
        blocks[i] = pool.cache_full_block(blocks[i], key(name), key(names[i - 1]) if i else None)
    pool.check_invariants()
    return blocks


def test_allocate_and_release_without_keys_returns_blocks_to_the_free_list():
    pool = BlockPool(4, SHAPE)
    assert pool.kv.shape == (4, *SHAPE)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.get_num_free_blocks() == 1
    pool.release(blocks)
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 4 and pool.get_num_cached_blocks() == 0


def test_the_pool_holds_the_kv_dtype():
    import numpy as np

    assert BlockPool(4, SHAPE).kv.dtype == np.float32
    half = BlockPool(4, SHAPE, np.float16)
    assert half.kv.dtype == np.float16 and not half.kv.any()
    assert BlockPool(4, SHAPE, np.uint8).kv.dtype == np.uint8   # int8 and int4 KV: pages' bytes
    with pytest.raises(ValueError, match="float32, float16 or bytes"):
        BlockPool(4, SHAPE, np.float64)


def test_allocating_more_than_available_is_refused():
    pool = BlockPool(2, SHAPE)
    pool.allocate(2)
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: only 0 available"):
        pool.allocate(1)


def test_finished_pages_stay_cached_and_are_found_as_a_prefix():
    pool = BlockPool(8, SHAPE)
    blocks = cache_chain(pool, ["a", "b", "c"])
    pool.release(blocks)
    pool.check_invariants()
    assert pool.get_num_cached_blocks() == 3
    assert pool.get_num_free_blocks() == 8  # idle cached blocks count as available
    assert pool.lookup([key("a"), key("b"), key("x"), key("c")]) == blocks[:2]
    assert pool.lookup([key("b")]) == [blocks[1]]  # lookup is by key; callers pass chains from the root
    pool.ref(blocks[:2])
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 6


def test_eviction_takes_leaves_before_parents_and_least_recently_used_first():
    pool = BlockPool(5, SHAPE)
    first = cache_chain(pool, ["a", "b", "c"])
    pool.release(first)
    second = cache_chain(pool, ["x", "y"])
    pool.release(second)
    # both chains idle; "a" chain is older. Leaves are c (older) and y.
    (taken,) = pool.allocate(1)
    assert taken == first[2] and pool.lookup([key("a"), key("b"), key("c")]) == first[:2]
    (taken,) = pool.allocate(1)
    assert taken == first[1], "after its leaf went, b is the oldest leaf"
    pool.ref(pool.lookup([key("a")]))  # a is used again: now the x chain is older
    pool.release([first[0]])
    (taken,) = pool.allocate(1)
    assert taken == second[1]
    pool.check_invariants()
    assert pool.lookup([key("x"), key("y")]) == [second[0]]


def test_a_referenced_page_is_never_evicted():
    pool = BlockPool(3, SHAPE)
    blocks = cache_chain(pool, ["a", "b"])
    pool.release(blocks[1:])  # "b" idle, "a" still referenced
    assert pool.allocate(1) != [blocks[0]]
    assert pool.allocate(1) == [blocks[1]]
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.check_invariants()


def test_a_page_cached_twice_is_shared_and_the_duplicate_block_freed():
    pool = BlockPool(4, SHAPE)
    first = cache_chain(pool, ["a"])
    (own,) = pool.allocate(1)
    assert pool.cache_full_block(own, key("a"), None) == first[0]
    assert pool.ref_counts[first[0]] == 2 and own in pool.free_block_ids
    pool.check_invariants()


# ---- property test against a plain reference model ------------------------------------------

class ReferencePool:
    """The same contract in the simplest way: lists, full scans, an explicit clock."""

    def __init__(self, num_blocks):
        self.refs = [0] * num_blocks
        self.keys = [None] * num_blocks
        self.parents = [None] * num_blocks
        self.last_use = [0] * num_blocks
        self.clock = 0

    def touch(self, b):
        self.clock += 1
        self.last_use[b] = self.clock

    def available(self):
        return sum(1 for b in range(len(self.refs)) if self.refs[b] == 0)

    def children(self, b):
        return [c for c in range(len(self.refs)) if self.keys[c] is not None and self.parents[c] == self.keys[b]]

    def allocate(self, b):
        """Check that the pool's choice `b` is allowed: any free block, else the least recently used
        idle page without idle children; evicting it uncaches every page below it."""
        free = [b for b in range(len(self.refs)) if self.refs[b] == 0 and self.keys[b] is None]
        if free:
            assert b in free, f"block {b} taken while free blocks {free} exist"
        else:
            evictable = [b for b in range(len(self.refs)) if self.refs[b] == 0 and self.keys[b] is not None
                         and all(self.refs[c] > 0 for c in self.children(b))]
            assert b == min(evictable, key=lambda b: self.last_use[b]), f"evicted {b}, not the LRU evictable page"
            below = [b]
            while below:
                x = below.pop()
                below += self.children(x)
                self.keys[x] = self.parents[x] = None
        self.refs[b] = 1

    def cached_keys(self):
        return {k for k in self.keys if k is not None}


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["start", "grow", "slide", "finish"]), st.integers(0, 5),
                              st.integers(0, 3)), max_size=60))
def test_pool_matches_a_reference_model(ops):
    """Sequences over a small key tree (so prefixes are shared) start, grow by a page, release their
    first page as a sliding window does, and finish."""
    num_blocks = 6
    pool, ref = BlockPool(num_blocks, SHAPE), ReferencePool(num_blocks)
    seqs: dict[int, list] = {}  # sequence id -> [(key, block)], the same blocks in both models

    def chain_key(path):
        return key("/".join(map(str, path)))

    for op, seq_id, branch in ops:
        if op == "start" and seq_id not in seqs:
            path = (branch % 2,)
            hits = pool.lookup([chain_key(path)])
            if hits:
                pool.ref(hits)
                ref.refs[hits[0]] += 1
                ref.touch(hits[0])
                seqs[seq_id] = [(path, hits[0])]
            else:
                if pool.get_num_free_blocks() < 1:
                    continue
                (b,) = pool.allocate(1)
                ref.allocate(b)
                b = pool.cache_full_block(b, chain_key(path), None)
                ref.keys[b], ref.parents[b] = chain_key(path), None
                ref.touch(b)
                seqs[seq_id] = [(path, b)]
        elif op == "grow" and seq_id in seqs:
            path = seqs[seq_id][-1][0] + (branch,)
            if len(path) > 4 or pool.get_num_free_blocks() < 1:
                continue
            (b,) = pool.allocate(1)
            ref.allocate(b)
            got = pool.cache_full_block(b, chain_key(path), chain_key(path[:-1]))
            if got != b:  # already cached: shared
                ref.refs[b] = 0
                ref.refs[got] += 1
            elif chain_key(path[:-1]) in ref.cached_keys():
                ref.keys[b], ref.parents[b] = chain_key(path), chain_key(path[:-1])
            ref.touch(got)
            seqs[seq_id].append((path, got))
        elif op == "slide" and len(seqs.get(seq_id, ())) > 1:
            _, b = seqs[seq_id].pop(0)
            pool.release([b])
            ref.refs[b] -= 1
            if ref.refs[b] == 0 and ref.keys[b] is not None:
                ref.touch(b)
        elif op == "finish" and seq_id in seqs:
            blocks = [b for _, b in seqs.pop(seq_id)]
            pool.release(blocks)
            for b in blocks:
                ref.refs[b] -= 1
                if ref.refs[b] == 0 and ref.keys[b] is not None:
                    ref.touch(b)
        pool.check_invariants()
        assert set(pool.key_to_block) == ref.cached_keys()
        assert pool.ref_counts == ref.refs
        assert pool.get_num_free_blocks() == ref.available()


RESIDENT_AT_START = """
import os
from pathlib import Path
from worker.kv.block_pool import BlockPool

def resident_bytes():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident_bytes()
pool = BlockPool(512, (4, 2, 4, 16, 64))
print(resident_bytes() - before, pool.kv.nbytes, int(pool.kv.any()))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc to read resident memory")
def test_the_pool_is_resident_from_the_start():
    """A fetch must not page-fault its way into untouched blocks: the pool is written at start. In a
    process of its own: memory an earlier test freed in this one could be resident already."""
    result = subprocess.run([sys.executable, "-c", RESIDENT_AT_START], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    grown, nbytes, nonzero = (int(v) for v in result.stdout.split())
    assert grown >= 0.9 * nbytes
    assert not nonzero
