"""The worker's remote tier against real kvnode processes: write-back, fetch, replicas, dead and mismatched nodes."""

import hashlib
import logging

import numpy as np
import pytest

from cluster_helpers import free_port
from kvcache.launch import Daemon
from kvnode.client import NodeClient
from worker.remote.tier import Placement, RemoteTier

BLOCK_SHAPE = (2, 2, 2, 4, 8)  # layers, k/v, kv_heads, page_tokens, head_dim
PAGE_FLOAT16 = int(np.prod(BLOCK_SHAPE)) * 2


def chain_keys(n, salt=b""):
    keys, parent = [], b"root"
    for i in range(n):
        parent = hashlib.blake2b(parent + salt + bytes([i]), digest_size=16).digest()
        keys.append(parent)
    return keys


@pytest.fixture(scope="module")
def nodes():
    started = []
    try:
        for _ in range(2):
            started.append(Daemon("node", ["--port", "0", "--page-bytes", str(PAGE_FLOAT16), "--capacity", "1MiB"]))
        yield [d.address for d in started]
    finally:
        for daemon in started:
            daemon.stop()


def make_tier(kv_dtype="float16", blocks=16):
    pool = np.random.default_rng(0).standard_normal((blocks, *BLOCK_SHAPE)).astype(np.float32)
    if kv_dtype == "float16":
        pool = pool.astype(np.float16).astype(np.float32)  # the engine rounds K/V as it computes them
    return RemoteTier(pool, kv_dtype, retry_after_s=30.0)


def write_chain(tier, keys, placement):
    for i, key in enumerate(keys):
        tier.on_page_full(key, keys[i - 1] if i else b"", i, placement)
    assert tier.flush(timeout_s=10.0)


def test_pages_written_back_then_fetched_bit_identical(nodes):
    tier = make_tier()
    try:
        keys = chain_keys(4, b"a")
        write_chain(tier, keys, Placement([nodes[0]]))
        assert tier.stats.pages_written == 4
        placement = Placement([nodes[0]])
        assert tier.lookup(keys + chain_keys(2, b"missing"), placement) == 4
        assert tier.fill(keys, [10, 11, 12, 13], placement) == 4
        np.testing.assert_array_equal(tier.pool[10:14], tier.pool[0:4])
        assert tier.stats.pages_fetched == 4 and tier.stats.bytes_fetched == 4 * PAGE_FLOAT16
    finally:
        tier.close()


def test_dead_primary_falls_back_to_replica(nodes):
    tier = make_tier()
    try:
        keys = chain_keys(3, b"b")
        write_chain(tier, keys, Placement([nodes[1]]))
        dead = f"127.0.0.1:{free_port()}"
        placement = Placement([dead, nodes[1]])
        assert tier.lookup(keys, placement) == 3
        assert placement.source == nodes[1]
        assert tier.fill(keys, [5, 6, 7], placement) == 3
        np.testing.assert_array_equal(tier.pool[5:8], tier.pool[0:3])
        assert tier.stats.node_failures >= 1
    finally:
        tier.close()


def test_source_dying_between_lookup_and_fill_uses_a_replica(nodes):
    tier = make_tier()
    try:
        keys = chain_keys(2, b"c")
        write_chain(tier, keys, Placement([nodes[0], nodes[1]]))
        placement = Placement([nodes[0], nodes[1]])
        assert tier.lookup(keys, placement) == 2
        placement.source = f"127.0.0.1:{free_port()}"  # as if the answering node died since
        assert tier.fill(keys, [8, 9], placement) == 2
        np.testing.assert_array_equal(tier.pool[8:10], tier.pool[0:2])
    finally:
        tier.close()


def test_no_node_answering_costs_hits_not_errors():
    tier = make_tier()
    try:
        placement = Placement([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
        assert tier.lookup(chain_keys(2), placement) == 0
        assert tier.fill(chain_keys(2), [0, 1], placement) == 0
        tier.on_page_full(chain_keys(1)[0], b"", 0, placement)
        assert tier.flush(timeout_s=10.0)
        assert tier.stats.pages_written == 0 and tier.stats.pages_dropped == 2
    finally:
        tier.close()


def test_node_with_another_page_size_is_refused_with_one_log_line(nodes, caplog):
    tier = make_tier(kv_dtype="float32")  # pages twice the nodes' size
    try:
        with caplog.at_level(logging.WARNING, logger="worker.remote"):
            assert tier.lookup(chain_keys(1), Placement([nodes[0]])) == 0
            assert tier.lookup(chain_keys(1), Placement([nodes[0]])) == 0
        refusals = [r for r in caplog.records if "refusing kvnode" in r.getMessage()]
        assert len(refusals) == 1
        assert str(PAGE_FLOAT16) in refusals[0].getMessage()
    finally:
        tier.close()


def test_float32_pages_round_trip_exactly(nodes):
    with Daemon("node", ["--port", "0", "--page-bytes", str(PAGE_FLOAT16 * 2), "--capacity", "1MiB"]) as node:
        tier = make_tier(kv_dtype="float32")
        try:
            keys = chain_keys(2, b"f32")
            write_chain(tier, keys, Placement([node.address]))
            placement = Placement([node.address])
            assert tier.lookup(keys, placement) == 2
            assert tier.fill(keys, [3, 4], placement) == 2
            np.testing.assert_array_equal(tier.pool[3:5], tier.pool[0:2])
            with NodeClient(node.address) as client:
                assert client.info().used_pages == 2
        finally:
            tier.close()


def test_fill_into_scattered_blocks_lands_each_page_in_its_block(nodes):
    tier = make_tier()
    try:
        keys = chain_keys(5, b"scatter")
        write_chain(tier, keys, Placement([nodes[0]]))  # from blocks 0-4
        expected = tier.pool[0:5].copy()
        tier.pool[5:] = 0.0
        placement = Placement([nodes[0]])
        targets = [9, 10, 14, 6, 7]  # a run, a single, a run that goes back down the pool
        assert tier.lookup(keys, placement) == 5
        assert tier.fill(keys, targets, placement) == 5
        for page, target in enumerate(targets):
            np.testing.assert_array_equal(tier.pool[target], expected[page])
        untouched = [b for b in range(5, 16) if b not in targets]
        assert not tier.pool[untouched].any()
    finally:
        tier.close()


def test_the_write_back_queue_is_bounded_in_bytes_of_float32_pages():
    pool = np.zeros((4, *BLOCK_SHAPE), dtype=np.float32)
    page_f32 = pool[0].nbytes
    for queue_bytes, pages in ((page_f32 * 100, 100), (page_f32 * 100 + page_f32 - 1, 100), (1, 16)):
        tier = RemoteTier(pool, "float16", queue_bytes=queue_bytes)
        try:
            assert tier._outbox.maxsize == pages  # at least 16 pages, however small the bound
        finally:
            tier.close()
