"""The remote tier uses a fetched page only when its bytes match its checksum: a page altered in
the node's pool ends the fill there (the pages before it land, it and the rest are computed), is
counted, and the node is told to drop it with its descendants before the write-back of the page
computed in its place, also when it is in a later batch of a fetch whose batches were all asked
at once. Both dtypes (float32 lands straight in the pool, float16 through staging buffers) and
both wires."""

from __future__ import annotations

import numpy as np
import pytest

import test_remote_fill as fill
from kvnode.data_plane.server import DataPlaneServer
from test_remote_tier import BLOCK_SHAPE, chain_keys, make_tier
from worker.remote.tier import Placement


@pytest.mark.parametrize("use_data_plane", [True, False], ids=["data plane", "gRPC"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_an_altered_page_is_rejected_computed_and_dropped_on_the_node(make_node, kv_dtype, use_data_plane):
    page_bytes = int(np.prod(BLOCK_SHAPE)) * np.dtype(kv_dtype).itemsize
    node = make_node(capacity_pages=16, page_bytes=page_bytes)
    plane = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=8).start() if use_data_plane else None
    node.service.data_port = plane.port if plane else 0
    tier = make_tier(kv_dtype)
    try:
        keys = chain_keys(5, kv_dtype.encode())
        placement = Placement([node.address])
        for i, key in enumerate(keys):
            tier.on_page_full(key, keys[i - 1] if i else b"", i, placement)
        assert tier.flush(timeout_s=10.0) and tier.stats.pages_written == 5
        node.store._pool[node.store._index[keys[2]].slot, 7] ^= 0x40  # a flipped bit in the node's RAM

        assert tier.lookup(keys, placement) == 5
        before = tier.pool[10:15].copy()
        assert tier.fill(keys, [10, 11, 12, 13, 14], placement) == 2
        np.testing.assert_array_equal(tier.pool[10:12], tier.pool[0:2])
        if kv_dtype == "float16":  # staged: the rejected page never reached the pool
            np.testing.assert_array_equal(tier.pool[12:15], before[2:])
        assert (tier.stats.pages_rejected, tier.stats.pages_fetched) == (1, 2)

        assert tier.flush(timeout_s=10.0)  # the drop goes through the write-back queue
        assert tier.stats.drops_reported == 1
        assert set(node.store.keys()) == set(keys[:2])  # the page and its descendants, nothing else
        assert node.store.stats.reported_dropped == 3
        node.store.check_invariants()

        for i in range(2, 5):  # computed in its place and written back: the node holds good bytes again
            tier.on_page_full(keys[i], keys[i - 1], i, placement)
        assert tier.flush(timeout_s=10.0)
        assert tier.fill(keys, [10, 11, 12, 13, 14], placement) == 5 and tier.stats.pages_rejected == 1
        np.testing.assert_array_equal(tier.pool[10:15], tier.pool[0:5])
    finally:
        tier.close()
        if plane:
            plane.stop()


@pytest.mark.parametrize("use_data_plane", [True, False], ids=["data plane", "gRPC"])
@pytest.mark.parametrize("targets", sorted(fill.TARGETS))
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_an_altered_page_in_a_later_batch_keeps_the_batches_before_and_its_own_pages_before_it(
        make_node, kv_dtype, targets, use_data_plane):
    keys = fill.chain_keys(fill.PAGES, b"batches" + kv_dtype.encode())
    node, pages = fill.stored_node(make_node, kv_dtype, keys, max_keys=3)
    plane = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=3).start() if use_data_plane else None
    node.service.data_port = plane.port if plane else 0
    tier = fill.make_tier(kv_dtype, batch_pages=3, min_pages=3)  # batches of 3, 3, 3, 2: all asked at once
    tier.pool[fill.PAGES :] = 0.0
    block_ids = fill.TARGETS[targets]
    try:
        altered = 7  # the second page of the third batch
        node.store._pool[node.store._index[keys[altered]].slot, 3] ^= 0x10
        placement = Placement([node.address])
        assert tier.lookup(keys, placement) == fill.PAGES
        assert tier.fill(keys, block_ids, placement) == altered
        for page in range(altered):  # two whole batches and the page before it in its own
            np.testing.assert_array_equal(fill.bits(tier.pool[block_ids[page]]), fill.bits(pages[page]))
        if kv_dtype == "float32":  # its batch was received in place (consecutive blocks or not), the
            untouched = block_ids[9:]  # rejected page with it: computed over
        else:
            untouched = block_ids[altered:]
        assert not tier.pool[untouched].any(), "nothing after the rejected page reached the pool"
        assert (tier.stats.pages_fetched, tier.stats.pages_rejected) == (altered, 1)
        assert (tier.stats.fetch_failures, tier.stats.bytes_fetched) == (0, altered * tier.page_bytes)
        assert (tier.nodes.get(node.address).client.data_plane_address() is not None) == use_data_plane
        assert tier.flush(timeout_s=10.0) and tier.stats.drops_reported == 1
        assert set(node.store.keys()) == set(keys[:altered])
        node.store.check_invariants()
    finally:
        tier.close()
        if plane:
            plane.stop()
