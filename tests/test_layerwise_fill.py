"""Layer-wise overlap of a remote fill with the suffix's forward (issue 19): a request whose prefix
comes from a kvnode joins a step of its own once its first layer landed, each layer computed once
that layer of its pages is in the pool. Its tokens equal the cold run's and the warm-local run's
(float32, float16, int8 and int4 KV, GPT-2 and Llama shapes); a fill that fails part way, a page that fails
its checksum (the pages before it are still reused), and a layer that comes late all still give
the exact tokens, with usage saying what was reused; a request decoding meanwhile gets its own exact tokens."""

from __future__ import annotations

import time

import grpc
import pytest

from kvnode.client import NodeError
from kvnode.data_plane.server import DataPlaneServer
from remote_tier_helpers import GPT2_AND_LLAMA, PAGE_TOKENS, PARAMS, PROMPT, SHARED, engine
from remote_tier_helpers import models, node  # noqa: F401 - fixtures, asked for by name
from worker.model.testing import gpt2_config, random_model
from worker.kv.pages import page_keys, tenant_root
from worker.remote.tier import Placement, RemoteTier

MODELS = {
    **GPT2_AND_LLAMA,
    # gpt2-small-shape's 12 layers and heads, small widths: a band per layer of a GPT-2 page
    "gpt2-12-layers": lambda: random_model(gpt2_config(n_layers=12, n_heads=12, n_kv_heads=12, d_model=192,
                                                      head_dim=16, d_ff=384, max_positions=512), seed=3),
}


class SlowLayers:
    """Wraps a tier's fill_layerwise: each layer after the first is passed on `delay_s` late (the
    forward must wait for it); `fail_after` ends the fill with a failure once that many layers landed."""

    def __init__(self, tier, delay_s=0.01, late_layer=None, late_s=0.0, fail_after=None):
        self.tier, self.delay_s, self.late_layer, self.late_s, self.fail_after = tier, delay_s, late_layer, late_s, fail_after
        self.calls = 0
        tier_fill = tier.fill_layerwise

        def fill_layerwise(keys, block_ids, placement, landed):
            self.calls += 1

            def slow(layer):
                if self.fail_after is not None and layer >= self.fail_after:
                    raise NodeError(placement.source, grpc.StatusCode.UNAVAILABLE, "the test's node fails here")
                if layer:
                    time.sleep(self.late_s if layer == self.late_layer else self.delay_s)
                landed(layer)

            return tier_fill(keys, block_ids, placement, slow)

        tier.fill_layerwise = fill_layerwise


def written(model, kv_dtype, node_factory):
    """A node holding the shared prefix's pages, written back by another worker."""
    writer = engine(model, kv_dtype)
    node = node_factory(writer.kv_pool[0].nbytes)   # the pool is in the KV dtype
    tier = RemoteTier(writer.kv_pool, kv_dtype)
    writer.attach_remote_tier(tier)
    try:
        writer.generate([SHARED + "First question?"], max_new_tokens=2, tier_context=Placement([node.address]))
        assert tier.flush(timeout_s=10.0) and tier.stats.pages_written >= 8
    finally:
        tier.close()
    return node


def warm_engine(model, kv_dtype, **slow):
    reader = engine(model, kv_dtype)
    # First contact may wait for the node's probe: these tests are not about it, and on a loaded
    # machine the default 0.1 s sometimes made the warm run a miss.
    tier = RemoteTier(reader.kv_pool, kv_dtype, layerwise_fill=True, first_contact_wait_s=5.0, lookup_timeout_s=5.0)
    SlowLayers(tier, **slow)
    reader.attach_remote_tier(tier)
    return reader, tier


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8", "int4"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_layerwise_warm_run_gives_the_cold_and_the_warm_local_tokens(models, node, name, kv_dtype):
    model = models[name]
    cold = engine(model, kv_dtype).generate([PROMPT], **PARAMS)[0]
    local = engine(model, kv_dtype)
    local.generate([SHARED + "First question?"], max_new_tokens=2)
    warm_local = local.generate([PROMPT], **PARAMS)[0]
    assert warm_local.usage.cached_tokens_local >= 8 * PAGE_TOKENS
    placement = Placement([written(model, kv_dtype, node).address])
    reader, tier = warm_engine(model, kv_dtype)
    try:
        warm = reader.generate([PROMPT], tier_context=placement, **PARAMS)[0]
    finally:
        tier.close()
    assert warm.token_ids == cold.token_ids == warm_local.token_ids
    assert warm.usage.cached_tokens_remote == warm_local.usage.cached_tokens_local
    assert reader.connector.layerwise_loads.num_early_joins == 1 and reader.connector.layerwise_loads.num_unjoined == 0
    assert reader.connector.layerwise_loads.num_layer_waits > 0, "the forward never waited for a layer: nothing overlapped"
    assert reader.scheduler.remote.num_layerwise_discarded == 0 and tier.stats.pages_rejected == 0


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_fill_failing_part_way_gives_the_exact_tokens_computed(models, node, kv_dtype):
    model = models["tiny"]
    cold = engine(model, kv_dtype).generate([PROMPT], **PARAMS)[0]
    placement = Placement([written(model, kv_dtype, node).address])
    reader, tier = warm_engine(model, kv_dtype, fail_after=2)
    try:
        warm = reader.generate([PROMPT], tier_context=placement, **PARAMS)[0]
    finally:
        tier.close()
    assert warm.token_ids == cold.token_ids
    assert warm.usage.cached_tokens_remote == 0 and warm.usage.computed_tokens == warm.usage.prompt_tokens
    assert reader.connector.layerwise_loads.num_early_joins == 1 and reader.connector.layerwise_loads.num_unjoined == 1


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_page_failing_its_checksum_throws_the_step_away_keeps_the_pages_before_it_and_gives_the_exact_tokens(models, node, kv_dtype):
    model = models["gpt2-12-layers"]
    cold = engine(model, kv_dtype).generate([PROMPT], **PARAMS)[0]
    kvnode = written(model, kv_dtype, node)
    tokens = model.tokenizer.encode(PROMPT)
    keys = page_keys(tenant_root(engine(model, kv_dtype).fingerprint, ""), tokens[: 3 * PAGE_TOKENS], PAGE_TOKENS)
    store = kvnode.store
    store._pool[store._index[keys[2]].slot, store.page_bytes - 3] ^= 0x10  # in the last layer's band
    reader, tier = warm_engine(model, kv_dtype)
    try:
        warm = reader.generate([PROMPT], tier_context=Placement([kvnode.address]), **PARAMS)[0]
    finally:
        tier.close()
    assert warm.token_ids == cold.token_ids  # the pages before the altered one reused, the rest computed
    assert warm.usage.cached_tokens_remote == 2 * PAGE_TOKENS
    assert warm.usage.computed_tokens == warm.usage.prompt_tokens - 2 * PAGE_TOKENS
    assert tier.stats.pages_rejected == 1 and reader.scheduler.remote.num_layerwise_discarded == 1
    assert reader.connector.layerwise_loads.num_early_joins == 1


def test_a_late_layer_sends_the_request_back_to_wait_for_its_load(models, node):
    model = models["tiny"]
    cold = engine(model, "float32").generate([PROMPT], **PARAMS)[0]
    placement = Placement([written(model, "float32", node).address])
    reader, tier = warm_engine(model, "float32", late_layer=2, late_s=0.4)  # past the engine's 0.1 s
    try:
        warm = reader.generate([PROMPT], tier_context=placement, **PARAMS)[0]
    finally:
        tier.close()
    assert warm.token_ids == cold.token_ids
    assert warm.usage.cached_tokens_remote == 8 * PAGE_TOKENS  # the load landed whole: used as any
    assert reader.connector.layerwise_loads.num_early_joins == 1 and reader.connector.layerwise_loads.num_unjoined == 1
    assert reader.scheduler.remote.num_layerwise_discarded == 0


OTHER_TOKENS = 40


def test_a_request_decoding_meanwhile_gets_its_own_tokens(models, node):
    model = models["tiny"]
    other = "A request of its own, decoding while the other one's pages land."
    expected = {p: engine(model, "float32").generate([p], **PARAMS)[0].token_ids for p in (PROMPT, other)}
    placement = Placement([written(model, "float32", node).address])
    reader, tier = warm_engine(model, "float32")
    try:
        decoding = reader.add_request(other, max_new_tokens=OTHER_TOKENS, ignore_eos=True, tier_context=Placement([]))
        for _ in range(4):  # its prompt, then a few tokens
            reader.step()
        assert len(reader.scheduler.running) == 1 and decoding.completion is None
        warm = reader.add_request(PROMPT, tier_context=placement, **PARAMS)
        decoded = []  # the other's tokens so far, at each step until the warm request ends
        while warm.completion is None:
            reader.step()
            live = reader._live.get(decoding.request_id)  # gone once it has all its tokens (a slow load)
            decoded.append(len(live.request.output_token_ids) if live is not None else OTHER_TOKENS)
        while decoding.completion is None:
            reader.step()
    finally:
        tier.close()
    assert warm.completion.token_ids == expected[PROMPT]
    assert decoding.completion.token_ids[: len(expected[other])] == expected[other]
    assert warm.completion.usage.cached_tokens_remote == 8 * PAGE_TOKENS
    assert reader.connector.layerwise_loads.num_early_joins == 1
    assert decoded[-1] - decoded[0] >= PARAMS["max_new_tokens"] - 1, f"the other stopped decoding: {decoded}"


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("targets", ["consecutive", "scattered"])
def test_fill_layerwise_writes_what_the_simple_path_writes(make_node, kv_dtype, targets):
    import numpy as np

    import test_remote_fill as fill

    keys = fill.chain_keys(fill.PAGES, b"layerwise" + kv_dtype.encode())
    node, _ = fill.stored_node(make_node, kv_dtype, keys)
    plane = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=64).start()
    node.service.data_port = plane.port
    block_ids = fill.TARGETS[targets]
    expected = np.zeros((fill.BLOCKS, *fill.BLOCK_SHAPE), dtype=np.float32)
    fill.simple_fill(node.address, keys, block_ids, expected, kv_dtype, 256)
    tier = fill.make_tier(kv_dtype)
    tier.pool[fill.PAGES:] = 0.0
    try:
        placement = Placement([node.address])
        assert tier.lookup(keys, placement) == fill.PAGES
        landed = []
        assert tier.fill_layerwise(keys, block_ids, placement, landed.append) == fill.PAGES
        assert landed == list(range(fill.BLOCK_SHAPE[0]))
        np.testing.assert_array_equal(fill.bits(tier.pool[fill.PAGES:]), fill.bits(expected[fill.PAGES:]))
    finally:
        tier.close()
        plane.stop()


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_page_aligned_prompt_the_node_holds_whole_computes_its_last_token_alone(models, node, kv_dtype):
    """Every page of the prompt comes from the node: the last token is computed over them, and the
    fetched pages are left as the node sent them (nothing written into a page still landing)."""
    import numpy as np

    from kvnode.client import NodeClient

    model = models["tiny"]
    aligned = SHARED[: 8 * PAGE_TOKENS]   # the tiny model's byte tokens: exactly 8 pages
    cold = engine(model, kv_dtype).generate([aligned], **PARAMS)[0]
    address = written(model, kv_dtype, node).address
    reader, tier = warm_engine(model, kv_dtype)
    try:
        warm = reader.generate([aligned], tier_context=Placement([address]), **PARAMS)[0]
    finally:
        tier.close()
    assert warm.token_ids == cold.token_ids
    assert (warm.usage.cached_tokens_remote, warm.usage.computed_tokens) == (8 * PAGE_TOKENS - 1, 1)
    assert reader.connector.layerwise_loads.num_early_joins == 1 and reader.scheduler.remote.num_layerwise_discarded == 0
    keys = page_keys(tenant_root(reader.fingerprint, ""), list(warm.prompt_token_ids), PAGE_TOKENS)
    blocks = reader.pool.lookup(keys)
    assert len(blocks) == 8
    with NodeClient(address) as client:
        sent = client.get_pages(keys)
    held = reader.kv_pool[blocks]
    if kv_dtype == "float16":
        held = held.astype(np.float16)
    np.testing.assert_array_equal(held.reshape(8, -1).view(np.uint8), sent)
