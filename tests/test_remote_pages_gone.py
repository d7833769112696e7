"""A page gone from its kvnode between the lookup and the fetch (evicted once its lease lapsed, or
dropped by another worker's DropPages) is a miss, not a failing node (worker/remote/tier.py: RemoteTier._fetch_failed):
the request computes those tokens, and the node is still used by the next request. Each of the
tier's three fetches: whole pages (`fill`), layer by layer, and read in place."""

import logging

import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, serve_node, wait_for
from kvnode.wire import shared_pool
from kvnode.store.page_store import PageStore
from test_remote_fill import chain_keys
from worker.engine.engine import Engine
from worker.model import load_model
from worker.remote.tier import Placement, RemoteTier

SHARED = "You are a helpful assistant. Answer briefly, and cite what you read. "  # 4 full pages of 16 tokens
BLOCK_SHAPE = (2, 2, 2, 8, 8)  # layers, k/v, kv_heads, page_tokens, head_dim: 1,024 bytes in float16


def drop(store: PageStore, key: bytes) -> None:
    """What DropPages does to a page (leased or not): it and its descendants leave the node."""
    with store._lock:
        store._drops.drop_subtree(key)


def assert_still_used(tier, address):
    assert tier.stats.node_failures == 0
    with tier.nodes.use([address]) as nodes:
        assert nodes[0].answered and nodes[0].num_failures == 0, "the node that answered NOT_FOUND is skipped"


class PagesGoneAfterLookup(RemoteTier):
    """A tier whose node loses the pages of the next lookup that hits, right after it answered."""

    store: PageStore | None = None

    def lookup(self, keys, placement):
        hits = super().lookup(keys, placement)
        if hits and self.store is not None:
            store, self.store = self.store, None
            drop(store, keys[0])
        return hits


def test_a_request_whose_pages_went_is_computed_and_the_node_serves_the_next_one():
    model = load_model("tiny")
    prompts = [f"Preamble {i}. " + SHARED + "What does a kvnode store?" for i in range(2)]

    def engine():
        return Engine(model, num_blocks=256, page_tokens=16, max_num_batched_tokens=256, seed=0)

    colds = [engine().generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts]
    writer, reader = engine(), engine()
    store = PageStore(64, writer.kv_pool[0].nbytes)
    with serve_node(store, max_keys=64, max_message_bytes=2**20) as node:
        tiers = [RemoteTier(writer.kv_pool, "float32"), PagesGoneAfterLookup(reader.kv_pool, "float32")]
        try:
            writer.attach_remote_tier(tiers[0])
            for prompt in prompts:
                writer.generate([prompt], max_new_tokens=2, tier_context=Placement([node.address]))
            assert tiers[0].flush(timeout_s=10.0) and tiers[0].stats.pages_written >= 8
            reader.attach_remote_tier(tiers[1])
            tiers[1].store = store
            gone = reader.generate([prompts[0]], max_new_tokens=8, ignore_eos=True,
                                   tier_context=Placement([node.address]))[0]
            assert tiers[1].stats.fetches_not_found == 1, "the fetch did not meet the pages gone"
            assert gone.token_ids == colds[0].token_ids and gone.usage.cached_tokens_remote == 0
            assert_still_used(tiers[1], node.address)
            warm = reader.generate([prompts[1]], max_new_tokens=8, ignore_eos=True,
                                   tier_context=Placement([node.address]))[0]
            assert warm.token_ids == colds[1].token_ids and warm.usage.cached_tokens_remote >= 4 * 16
            assert tiers[1].stats.node_failures == 0
        finally:
            for tier in tiers:
                tier.close()


def written(client, keys, pool):
    assert client.put_pages(keys, [b"", *keys[:-1]], [pool[i].tobytes() for i in range(len(keys))]).stored == len(keys)


def test_a_layerwise_fill_whose_pages_went_leaves_the_node_in_use(make_node, caplog):
    pool = np.random.default_rng(0).standard_normal((16, *BLOCK_SHAPE)).astype(np.float16)
    node = make_node(capacity_pages=16, page_bytes=NODE_PAGE_BYTES)
    tier = RemoteTier(pool, "float16", layerwise_fill=True)
    gone, kept = chain_keys(3, b"gone"), chain_keys(3, b"kept")
    try:
        with node.client() as client:
            written(client, gone, pool)
            written(client, kept, pool)
        placement = Placement([node.address])
        # the tier meets a node off the caller's thread: a lookup under load may come before it
        assert wait_for(lambda: tier.lookup(gone, placement) == 3, timeout_s=10.0)
        drop(node.store, gone[0])
        assert tier.fill_layerwise(gone, [8, 9, 10], placement, lambda layer: None) == 0
        assert tier.stats.fetches_not_found == 1
        assert_still_used(tier, node.address)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "a routine miss logged a warning"
        placement = Placement([node.address])
        assert wait_for(lambda: tier.lookup(kept, placement) == 3, timeout_s=10.0)
        assert tier.fill_layerwise(kept, [8, 9, 10], placement, lambda layer: None) == 3
        np.testing.assert_array_equal(pool[8:11], pool[0:3])
    finally:
        tier.close()


@pytest.mark.skipif(not shared_pool.supported(), reason="the shared pool needs Linux (memfd, SO_PEERCRED)")
def test_pages_gone_before_their_pin_in_place_leave_the_node_in_use():
    from test_data_plane_shared_pool import shared_node
    from worker.kv.block_arena import BlockArena

    arena = BlockArena(16, BLOCK_SHAPE, np.float16)
    arena.local[:] = np.random.default_rng(0).standard_normal((16, *BLOCK_SHAPE))
    tier = RemoteTier(arena.local, "float16")
    assert tier.in_place is not None
    gone, kept = chain_keys(3, b"gone"), chain_keys(3, b"kept")
    try:
        with shared_node() as (node, server), node.client() as client:
            written(client, gone, arena.local)
            written(client, kept, arena.local)
            placement = Placement([node.address])
            assert tier.lookup(gone, placement) == 3  # the first contact maps the node's pool into the arena
            assert wait_for(lambda: tier.in_place.attached(node.address), timeout_s=10.0)
            drop(node.store, gone[0])
            assert tier.fill_in_place(gone, [8, 9, 10], placement) is None
            assert tier.stats.fetches_not_found == 1
            assert_still_used(tier, node.address)
            placement = Placement([node.address])
            assert tier.lookup(kept, placement) == 3
            pages = tier.fill_in_place(kept, [8, 9, 10], placement)
            assert pages is not None and len(pages) == 3
            pages.release()
    finally:
        tier.close()
