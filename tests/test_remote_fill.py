"""The remote tier's fetch path: the fast float16 -> float32 cast and the batched, pipelined fill.

Both must leave the pool exactly as the simple path (one GetPages, NumPy's cast) would, and a
fetch that fails part way must count only the pages that really arrived.
"""

import hashlib

import grpc
import numpy as np
import pytest

from kvnode.client import NodeClient, NodeError
from worker.kv import half
from worker.kv.half import float16_to_float32
from worker.remote.tier import Placement, RemoteTier

BLOCK_SHAPE = (2, 2, 2, 4, 8)  # layers, k/v, kv_heads, page_tokens, head_dim
PAGES = 11
BLOCKS = 2 * PAGES + 4


def bits(array):
    return array.view(np.uint32 if array.dtype == np.float32 else np.uint16)


# ---- float16 -> float32 ------------------------------------------------------


def test_every_finite_half_converts_exactly_as_numpy_does():
    assert half._trick_is_exact_here()  # else the fast path is never taken and the rest proves little
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    finite = every[np.isfinite(every)]  # subnormals, both zeros, the largest halves
    finite = np.resize(finite, 2 * half.CHUNK + 12345)  # several chunks, the last one short
    out = np.empty(finite.size, dtype=np.float32)
    float16_to_float32(finite, out)
    np.testing.assert_array_equal(bits(out), bits(finite.astype(np.float32)))


@pytest.mark.parametrize("size", [0, 1, half.CHUNK - 1, half.CHUNK, 3 * half.CHUNK + 5])
def test_infinities_and_nans_keep_their_bits_in_any_chunk(size):
    rng = np.random.default_rng(size)
    src = rng.integers(0, 65536, size=size, dtype=np.uint16).view(np.float16)  # every kind of half
    if size > half.CHUNK:
        src[half.CHUNK + 7] = np.inf
        src[2 * half.CHUNK + 1] = np.float16(np.nan)
    out = np.full(size, 7.0, dtype=np.float32)
    float16_to_float32(src, out)
    np.testing.assert_array_equal(bits(out), bits(src.astype(np.float32)))


def test_wrong_dtypes_sizes_or_layouts_are_refused():
    src = np.zeros(8, dtype=np.float16)
    with pytest.raises(ValueError, match="float16 -> float32"):
        float16_to_float32(src, np.empty(8, dtype=np.float64))
    with pytest.raises(ValueError, match="one size"):
        float16_to_float32(src, np.empty(7, dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        float16_to_float32(np.zeros(16, dtype=np.float16)[::2], np.empty(8, dtype=np.float32))


# ---- batches -------------------------------------------------------------------


@pytest.mark.parametrize("batch_pages,min_pages,max_keys", [(1, 1, 256), (3, 1, 256), (28, 3, 256), (28, 3, 5), (4, 4, 2)])
def test_batches_cover_every_page_once_within_the_limits(batch_pages, min_pages, max_keys):
    tier = make_tier("float16", batch_pages, min_pages)
    try:
        for count in [1, 2, 3, 7, 8, 63, 200]:
            bounds = tier.fetcher._batches(count, max_keys)
            assert bounds[0][0] == 0 and bounds[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert all(0 < end - start <= min(batch_pages, max_keys) for start, end in bounds)
    finally:
        tier.close()


# ---- fill against a node -----------------------------------------------------------


def chain_keys(n, salt):
    keys, parent = [], b"root"
    for i in range(n):
        parent = hashlib.blake2b(parent + salt + bytes([i]), digest_size=16).digest()
        keys.append(parent)
    return keys


def make_tier(kv_dtype, batch_pages=3, min_pages=1, pool_dtype=np.float32):
    """A tier over a pool whose blocks 0..PAGES-1 hold the pages to write; the rest is zero."""
    pool = np.zeros((BLOCKS, *BLOCK_SHAPE), dtype=pool_dtype)
    pages = np.random.default_rng(1).standard_normal((PAGES, *BLOCK_SHAPE)).astype(np.float32) * 100
    pages[0, 0, 0, 0, 0, :4] = [6e-8, -3e-5, 0.0, -0.0]  # float16 subnormals and signed zeros
    pool[:PAGES] = pages.astype(np.float16).astype(np.float32) if kv_dtype == "float16" else pages
    page_bytes = int(np.prod(BLOCK_SHAPE)) * np.dtype(kv_dtype).itemsize
    return RemoteTier(pool, kv_dtype, retry_after_s=30.0,
                      fetch_batch_bytes=batch_pages * page_bytes, min_batch_bytes=min_pages * page_bytes)


def stored_node(make_node, kv_dtype, keys, max_keys=256, pool_dtype=np.float32):
    """A node holding `keys` as the pages of a fresh tier's blocks 0..; returns (node, those pages)."""
    page_bytes = int(np.prod(BLOCK_SHAPE)) * np.dtype(kv_dtype).itemsize
    node = make_node(capacity_pages=4 * PAGES, page_bytes=page_bytes, max_keys=max_keys)
    writer = make_tier(kv_dtype, pool_dtype=pool_dtype)
    try:
        placement = Placement([node.address])
        for i, key in enumerate(keys):
            writer.on_page_full(key, keys[i - 1] if i else b"", i, placement)
        assert writer.flush(timeout_s=10.0) and writer.stats.pages_written == len(keys)
        return node, writer.pool[: len(keys)].copy()
    finally:
        writer.close()


def simple_fill(address, keys, block_ids, pool, kv_dtype, max_keys):
    """The path before batching: GetPages for all pages (within the node's limit), NumPy's cast, page by page."""
    with NodeClient(address) as client:
        rows = np.concatenate([client.get_pages(keys[i : i + max_keys]) for i in range(0, len(keys), max_keys)])
    pages = rows.view(kv_dtype).reshape(len(keys), *BLOCK_SHAPE)
    for page, block in zip(pages, block_ids):
        pool[block] = page.astype(np.float32)


TARGETS = {
    "consecutive": list(range(PAGES + 2, 2 * PAGES + 2)),
    "scattered": [25, 12, 13, 14, 20, 19, 21, 22, 15, 16, 24],
}


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
@pytest.mark.parametrize("batch_pages,min_pages,max_keys", [(1, 1, 256), (3, 1, 256), (4, 2, 256), (64, 64, 256), (64, 2, 3)])
@pytest.mark.parametrize("targets", sorted(TARGETS))
def test_pipelined_fill_writes_what_the_simple_path_writes(make_node, kv_dtype, batch_pages, min_pages, max_keys, targets):
    keys = chain_keys(PAGES, kv_dtype.encode())
    node, pages = stored_node(make_node, kv_dtype, keys, max_keys=max_keys)
    block_ids = TARGETS[targets]
    expected = np.zeros((BLOCKS, *BLOCK_SHAPE), dtype=np.float32)
    simple_fill(node.address, keys, block_ids, expected, kv_dtype, max_keys)
    tier = make_tier(kv_dtype, batch_pages, min_pages)
    tier.pool[PAGES:] = 0.0
    try:
        placement = Placement([node.address])
        assert tier.lookup(keys, placement) == PAGES
        assert tier.fill(keys, block_ids, placement) == PAGES
        np.testing.assert_array_equal(bits(tier.pool[PAGES:]), bits(expected[PAGES:]))
        for page, block in enumerate(block_ids):
            np.testing.assert_array_equal(bits(tier.pool[block]), bits(pages[page]))
        assert tier.stats.pages_fetched == PAGES
        assert tier.stats.bytes_fetched == PAGES * tier.page_bytes
    finally:
        tier.close()


def test_a_lookup_leases_within_the_nodes_lease_bound_per_call(make_node):
    """A node started with --max-leases-per-call below --max-keys says so in its Info: a lookup
    of more keys is asked in parts within it (it was refused, and the node skipped as failing)."""
    keys = chain_keys(PAGES, b"leases")
    node, _ = stored_node(make_node, "float32", keys)
    node.store.max_leases_per_call = 4
    tier = make_tier("float32")
    try:
        assert tier.lookup(keys, Placement([node.address])) == PAGES
        assert tier.stats.node_failures == 0 and node.store.num_leased() == PAGES
    finally:
        tier.close()


@pytest.mark.parametrize("batch_pages,min_pages", [(3, 1), (64, 64)])
@pytest.mark.parametrize("targets", sorted(TARGETS))
def test_a_float16_pool_sends_and_receives_pages_as_the_node_holds_them(make_node, batch_pages, min_pages, targets):
    """The engine's float16 pool: write-back sends its blocks' bytes, a fill lands the node's bytes."""
    keys = chain_keys(PAGES, b"half pool")
    node, written = stored_node(make_node, "float16", keys, pool_dtype=np.float16)
    with NodeClient(node.address) as client:
        held = client.get_pages(keys)
    np.testing.assert_array_equal(held, written.reshape(PAGES, -1).view(np.uint8))
    tier = make_tier("float16", batch_pages, min_pages, pool_dtype=np.float16)
    tier.pool[PAGES:] = 0.0
    try:
        placement = Placement([node.address])
        block_ids = TARGETS[targets]
        staged, staging_rows = [], tier.fetcher._staging_rows
        tier.fetcher._staging_rows = lambda *args: staged.append(args) or staging_rows(*args)
        assert tier.lookup(keys, placement) == PAGES
        assert tier.fill(keys, block_ids, placement) == PAGES
        for page, block in enumerate(block_ids):
            np.testing.assert_array_equal(tier.pool[block].reshape(-1).view(np.uint8), held[page])
        assert staged == []   # received straight into the blocks, consecutive or not: no staging buffer, no cast
    finally:
        tier.close()


@pytest.mark.parametrize("pool_dtype,kv_dtype", [(np.float32, "float32"), (np.float16, "float16")])
def test_a_pool_in_the_wire_dtype_asks_for_as_many_pages_a_request_as_the_node_takes(pool_dtype, kv_dtype):
    """Pages received straight into their blocks have no cast to overlap: one request per node key
    limit, whatever fetch_batch_bytes says."""
    tier = make_tier(kv_dtype, batch_pages=2, min_pages=1, pool_dtype=pool_dtype)
    try:
        assert tier.fetcher._batches(11, 256) == [(0, 11)]
        assert tier.fetcher._batches(11, 4) == [(0, 4), (4, 8), (8, 11)]
    finally:
        tier.close()


def test_a_float16_pool_takes_no_float32_pages():
    with pytest.raises(ValueError, match="float16 pool cannot hold float32 pages"):
        RemoteTier(np.zeros((2, *BLOCK_SHAPE), dtype=np.float16), "float32")


def fail_on_batch(tier, address, batch_number):
    """Make the tier's client for `address` fail its fetch in its `batch_number`-th batch, after
    scribbling on that batch's buffer; returns the numbers of the batches that landed."""
    client = tier.nodes.get(address).client
    real = client.get_pages_in_batches
    landed = []

    def get_pages_in_batches(batches, out_for, on_landed, timeout=None):
        def failing_out_for(number):
            out = out_for(number)
            if number + 1 == batch_number:
                for page in out[: len(out) // 2]:  # half a batch arrived before the node went away
                    page[...] = 0xAB
                raise NodeError(address, grpc.StatusCode.UNAVAILABLE, "connection reset (test)")
            return out

        def counted(number):
            landed.append(number)
            on_landed(number)

        real(batches, failing_out_for, counted, timeout=timeout)

    client.get_pages_in_batches = get_pages_in_batches
    return landed


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_a_fetch_failing_part_way_counts_only_the_batches_that_arrived(make_node, kv_dtype):
    keys = chain_keys(PAGES, b"partial" + kv_dtype.encode())
    node, pages = stored_node(make_node, kv_dtype, keys, max_keys=3)  # a float32 pool's requests: 3, 3, 3, 2 pages
    tier = make_tier(kv_dtype, batch_pages=3, min_pages=3)  # a float16 fetch's batches: 3, 3, 3, 2
    tier.pool[PAGES:] = 0.0
    try:
        placement = Placement([node.address])
        assert tier.lookup(keys, placement) == PAGES
        landed = fail_on_batch(tier, node.address, batch_number=3)
        block_ids = TARGETS["consecutive"]
        assert tier.fill(keys, block_ids, placement) == 6
        assert landed == [0, 1]  # nothing taken after the failure
        for page in range(6):
            np.testing.assert_array_equal(bits(tier.pool[block_ids[page]]), bits(pages[page]))
        assert tier.stats.pages_fetched == 6 and tier.stats.fetch_failures == 1
        assert tier.lookup(keys, placement) == 0  # the failed node is skipped for a while
    finally:
        tier.close()


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_a_replica_serves_the_rest_after_the_source_fails_part_way(make_node, kv_dtype):
    keys = chain_keys(PAGES, b"replica" + kv_dtype.encode())
    source, pages = stored_node(make_node, kv_dtype, keys, max_keys=4)
    replica, _ = stored_node(make_node, kv_dtype, keys)
    tier = make_tier(kv_dtype, batch_pages=4, min_pages=1)
    tier.pool[PAGES:] = 0.0
    try:
        # The tier meets the replica first: a fill skips a node whose first contact is still under
        # way, which on a loaded machine it sometimes was when the source failed.
        assert tier.lookup(keys, Placement([replica.address])) == PAGES
        placement = Placement([source.address, replica.address])
        assert tier.lookup(keys, placement) == PAGES and placement.source == source.address
        fail_on_batch(tier, source.address, batch_number=2)
        replica_stats_before = replica.store.stats.hit_pages
        block_ids = TARGETS["scattered"]
        assert tier.fill(keys, block_ids, placement) == PAGES
        for page, block in enumerate(block_ids):
            np.testing.assert_array_equal(bits(tier.pool[block]), bits(pages[page]))
        # The replica was asked only for the pages after the first batch.
        assert replica.store.stats.hit_pages - replica_stats_before == PAGES - 4
        assert tier.stats.pages_fetched == PAGES and tier.stats.fetch_failures == 1
    finally:
        tier.close()


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_a_page_written_back_is_the_page_as_it_was_when_it_became_full(make_node, kv_dtype):
    keys = chain_keys(3, b"writeback" + kv_dtype.encode())
    page_bytes = int(np.prod(BLOCK_SHAPE)) * np.dtype(kv_dtype).itemsize
    node = make_node(capacity_pages=8, page_bytes=page_bytes)
    tier = make_tier(kv_dtype)
    try:
        placement = Placement([node.address])
        expected = tier.pool[:3].copy()
        for i, key in enumerate(keys):
            tier.on_page_full(key, keys[i - 1] if i else b"", i, placement)
            tier.pool[i] = -1.0  # the block is reused at once
        assert tier.flush(timeout_s=10.0) and tier.stats.pages_written == 3
        with NodeClient(node.address) as client:
            rows = client.get_pages(keys)
        np.testing.assert_array_equal(rows.view(kv_dtype).reshape(3, *BLOCK_SHAPE), expected.astype(kv_dtype))
    finally:
        tier.close()
