"""The asynchronous KV connector: a request whose pages come from a slow kvnode waits aside while
the others decode, and falls back to computing when its fetch fails, with the tokens of a cold run."""

import threading
import time

import numpy as np
import pytest

from cluster_helpers import serve_node
from kvnode.service import KVStoreService
from kvnode.store.page_store import PageStore
from worker.connector.connector import Tier
from worker.engine.engine import Engine
from worker.model import load_model
from worker.remote.tier import Placement, RemoteTier

SHARED = "You are a helpful assistant. Answer briefly, and cite what you read. "  # 4 full pages of 16 tokens
DELAY_S = 2.0
DECODERS = 8
ATTEMPTS = 3  # a window the machine's other load disturbed is measured again
CALM_S = 0.4


class SlowGetPages(KVStoreService):
    """A kvnode whose GetPages answers after DELAY_S (bounded); its other methods as usual."""

    def get_pages(self, request, context):
        time.sleep(DELAY_S)
        yield from super().get_pages(request, context)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def tiny_engine(model, tier_factory=None):
    engine = Engine(model, num_blocks=256, page_tokens=16, max_num_batched_tokens=256, seed=0)
    if tier_factory is not None:
        engine.attach_remote_tier(tier_factory(engine))
    return engine


class Stepping:
    """A loop thread stepping the engine, as the worker's service does."""

    def __init__(self, engine):
        self.engine, self.stop = engine, threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    def _loop(self):
        while not self.stop.is_set():
            if self.engine.wait_for_work(0.05):
                self.engine.step()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10.0)


class TokenTimes:
    """When each delta of a request reached its reader (a thread per request)."""

    def __init__(self, handle):
        self.handle, self.times = handle, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for delta in self.handle:
            if delta.token_ids:
                self.times.append(time.monotonic())

    def gaps(self, start, end):
        times = [t for t in self.times if start <= t <= end]
        return np.diff(times)


def wait_until(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_others_decode_at_their_pace_while_a_request_waits_for_a_slow_kvnode(tiny):
    """Inter-token latency of 8 decoders while a request's fetch waits on a node that answers
    GetPages after 2 s, beside the windows just before and after it (the machine is shared, so
    the baseline is taken on both sides). A fetch inside the engine's step would stop them all
    for the fetch's 1 s deadline."""
    prefixes = [f"Preamble {attempt}. " + SHARED for attempt in range(ATTEMPTS)]  # distinct pages per attempt
    prompts = [prefix + "What does a kvnode store?" for prefix in prefixes]
    colds = [tiny_engine(tiny).generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts]
    page_bytes = tiny_engine(tiny).kv_pool[0].nbytes
    store = PageStore(64, page_bytes)
    with serve_node(store, max_keys=64, max_message_bytes=2**20, service_cls=SlowGetPages) as node:
        placement = lambda: Placement([node.address])  # noqa: E731
        writer_tier = []
        writer = tiny_engine(tiny, lambda e: writer_tier.append(RemoteTier(e.kv_pool, "float32")) or writer_tier[0])
        try:
            writer.generate([prefix + "First question?" for prefix in prefixes], max_new_tokens=2,
                            tier_context=placement())
            assert writer_tier[0].flush(timeout_s=10.0) and writer_tier[0].stats.pages_written >= 4 * ATTEMPTS
        finally:
            writer_tier[0].close()

        tiers = []
        # retry_after_s: the node that timed out is asked again by the next attempt.
        engine = tiny_engine(tiny, lambda e: tiers.append(RemoteTier(e.kv_pool, "float32", lookup_timeout_s=2.0,
                                                                     retry_after_s=0.01)) or tiers[0])
        ratios, stalls = [], []
        try:
            with Stepping(engine):
                for prompt, cold in zip(prompts, colds):
                    decoders = [TokenTimes(engine.add_request(f"decoder {i}: ", max_new_tokens=1000, ignore_eos=True,
                                                              tier_context=Placement([])))
                                for i in range(DECODERS)]
                    wait_until(lambda: all(len(d.times) >= 20 for d in decoders), 30.0)
                    before = time.monotonic()
                    time.sleep(CALM_S)
                    slow_start = time.monotonic()
                    out = engine.add_request(prompt, max_new_tokens=8, ignore_eos=True,
                                             tier_context=placement()).result(timeout=30.0)
                    slow_end = time.monotonic()
                    time.sleep(CALM_S)
                    after = time.monotonic()
                    assert all(d.handle.completion is None for d in decoders), "the decoders ran out of tokens"
                    # The fetch outlived its deadline (1 s for these few pages): computed, the cold run's tokens.
                    assert out.token_ids == cold.token_ids
                    assert out.usage.cached_tokens_remote == 0 and out.usage.computed_tokens == out.usage.prompt_tokens
                    assert slow_end - slow_start >= 0.9  # it did wait for the slow node, aside
                    calm = np.concatenate([d.gaps(before, slow_start) for d in decoders]
                                          + [d.gaps(slow_end, after) for d in decoders])
                    during = np.concatenate([d.gaps(slow_start, slow_end) for d in decoders])
                    ratios.append(during.mean() / calm.mean())
                    stalls.append(during.max())
                    for d in decoders:
                        engine.cancel(d.handle)
                    if ratios[-1] <= 1.5:
                        break  # else the machine was busier in that window: measured again
        finally:
            tiers[0].close()

    assert tiers[0].stats.fetch_failures == len(ratios)
    assert min(ratios) <= 1.5, f"inter-token latency while the fetch waited / around it: {ratios}"
    # The stall this test is about, in the calmest attempt: a fetch inside the step would stop the
    # decoders for its whole wait (>= 0.9 s, asserted above); a loaded machine alone gave up to 0.74 s.
    calmest = ratios.index(min(ratios))
    assert stalls[calmest] < 0.8, f"a decoder stalled {stalls[calmest]:.2f}s (all attempts: {stalls})"


def test_a_load_that_hangs_is_given_up_and_the_request_computed(tiny):
    """A tier whose fill never returns on its own: the connector's bound ends the wait."""
    release = threading.Event()

    class HangingTier(Tier):
        def __init__(self, pool):
            self.pool, self.pages, self.fills = pool, {}, 0

        def lookup(self, keys, context):
            n = 0
            while n < len(keys) and keys[n] in self.pages:
                n += 1
            return n

        def fill(self, keys, block_ids, context):
            self.fills += 1
            release.wait(30.0)  # bounded, released by the test
            return 0

        def on_page_full(self, key, parent, block_id, context):
            self.pages[key] = self.pool[block_id].copy()

    prompt = SHARED + "What does a kvnode store?"
    cold = tiny_engine(tiny).generate([prompt], max_new_tokens=8, ignore_eos=True)[0]
    engine = tiny_engine(tiny)
    tier = HangingTier(engine.kv_pool)
    engine.attach_remote_tier(tier)
    engine.connector.timeout_s = 0.3
    engine.generate([SHARED + "First question?"], max_new_tokens=2)
    engine.pool.check_invariants()
    fresh = tiny_engine(tiny)
    fresh.attach_remote_tier(HangingTier(fresh.kv_pool))
    fresh.connector.tier.pages = dict(tier.pages)
    fresh.connector.timeout_s = 0.3
    try:
        out = fresh.generate([prompt], max_new_tokens=8, ignore_eos=True)[0]
        assert out.token_ids == cold.token_ids and out.usage.cached_tokens_remote == 0
        assert fresh.connector.num_loads_given_up == 1
        held = fresh.pool.num_blocks - fresh.get_num_free_blocks()
        assert held == 4  # the hung load's blocks are not reused while the loader may write them
        with pytest.raises(RuntimeError, match="finish them first"):  # its connector still owes them
            fresh.attach_remote_tier(None)
    finally:
        release.set()
    wait_until(fresh.connector.has_releases, 5.0)
    # Nothing else is live: only this says a loop thread must step to release them.
    assert fresh.has_unfinished() and fresh.wait_for_work(timeout=0)
    assert fresh.step() == [] and fresh.get_num_free_blocks() == fresh.pool.num_blocks
    assert fresh.connector.num_pending() == 0 and not fresh.has_unfinished()
    fresh.pool.check_invariants()


def test_the_lookup_starts_when_a_request_arrives_and_its_load_in_the_first_step(tiny):
    """Prefetch on arrival: the tier is asked before the engine steps at all, so the first step
    already parks the request with its load started, and the answer is the cold run's."""
    prompt = SHARED + "What does a kvnode store?"
    cold = tiny_engine(tiny).generate([prompt], max_new_tokens=8, ignore_eos=True)[0]
    looked_up = threading.Event()
    filled = threading.Event()

    class DictTier(Tier):
        def __init__(self, pool):
            self.pool, self.pages = pool, {}

        def lookup(self, keys, context):
            looked_up.set()
            n = 0
            while n < len(keys) and keys[n] in self.pages:
                n += 1
            return n

        def fill(self, keys, block_ids, context):
            for key, block in zip(keys, block_ids):
                self.pool[block] = self.pages[key]
            filled.set()
            return len(keys)

        def on_page_full(self, key, parent, block_id, context):
            self.pages[key] = self.pool[block_id].copy()

    writer = tiny_engine(tiny)
    writer.attach_remote_tier(source := DictTier(writer.kv_pool))
    writer.generate([SHARED + "First question?"], max_new_tokens=2)
    engine = tiny_engine(tiny)
    engine.attach_remote_tier(tier := DictTier(engine.kv_pool))
    tier.pages = dict(source.pages)
    handle = engine.add_request(prompt, max_new_tokens=8, ignore_eos=True)
    assert looked_up.wait(5.0)  # no step has run
    wait_until(lambda: engine.connector.lookups.num_in_flight() == 0, 5.0)
    assert engine.step() == []  # the first step parks it, its load started
    assert engine.num_waiting() == 1 and engine.num_running() == 0
    assert filled.wait(5.0)
    while handle.completion is None:
        engine.step()
    out = handle.completion
    assert out.token_ids == cold.token_ids
    assert out.usage.cached_tokens_remote == 64 and out.usage.computed_tokens == out.usage.prompt_tokens - 64


def test_close_is_bounded_by_a_hung_call_and_a_closed_connector_answers_a_miss_at_once():
    """A lookup that does not return holds close() for its timeout only; what is asked after the
    close is a miss without a call, and once the hung call ends no connector thread is left."""
    from types import SimpleNamespace

    from worker.connector.connector import KVConnector, Landed

    release, entered, calls = threading.Event(), threading.Event(), []

    class HungTier(Tier):
        def lookup(self, keys, context):
            calls.append(keys)
            entered.set()
            release.wait(30.0)  # bounded, released by the test
            return len(keys)

        def fill(self, keys, block_ids, context):
            return len(keys)

        def on_page_full(self, key, parent, block_id, context):
            pass

    before = set(threading.enumerate())
    connector = KVConnector(HungTier())
    hung = SimpleNamespace(request_id="hung", tier_context=None)
    try:
        connector.lookups.start(hung, [b"k" * 16])
        assert entered.wait(5.0)
        started = time.monotonic()
        assert connector.close(wait_s=0.3) is False  # the hung call still runs
        assert time.monotonic() - started < 5.0, "close waited for the hung call"
        late = SimpleNamespace(request_id="late", tier_context=None)
        connector.lookups.start(late, [b"a" * 16])
        assert connector.lookups.take(late) == 0  # a miss, no call
        blocks = [3]
        connector.start_load(late, [b"a" * 16], blocks)
        assert connector.take_finished_loads().landed == [(late, Landed(0))]
        assert len(calls) == 1
    finally:
        release.set()
    wait_until(lambda: not [t for t in threading.enumerate() if t not in before and t.name.startswith("kv-")], 5.0)


class LayerwiseTier(Tier):
    """A remote tier that finds and fills every page; subclasses land the layers as a test needs."""

    layerwise_fill = True

    def lookup(self, keys, context):
        return len(keys)

    def fill(self, keys, block_ids, context):
        return len(keys)

    def on_page_full(self, key, parent, block_id, context):
        pass


def joined_early(tier, **options):
    """A connector over `tier` and a request whose layer-wise load started and joined a step early."""
    from types import SimpleNamespace

    from worker.connector.connector import KVConnector

    connector = KVConnector(tier, **options)
    request = SimpleNamespace(request_id="early", tier_context=None)
    connector.start_load(request, [b"k" * 16], [0])
    wait_until(lambda: connector.layerwise_loads.can_join_early(request), 5.0)
    connector.layerwise_loads.join_early(request)
    return connector, request


def test_a_layerwise_load_trickling_its_layers_holds_one_step_at_most_its_step_budget():
    """Each layer lands just inside the per-layer wait; the step's waits together still end at
    step_wait_s, so a node sending just in time cannot hold the engine for layers x layer_wait_s."""
    layers, gap_s = 30, 0.06
    stop = threading.Event()

    class TricklingTier(LayerwiseTier):
        def fill_layerwise(self, keys, block_ids, context, landed):
            for layer in range(layers):
                if stop.wait(gap_s):  # bounded: the test stops it
                    return 0
                landed(layer)
            return len(keys)

    connector, request = joined_early(TricklingTier(), layer_wait_s=0.1, step_wait_s=0.25)
    try:
        started, waited = time.monotonic(), []
        for layer in range(layers):
            if not connector.layerwise_loads.wait_layer(request, layer):
                break
            waited.append(layer)
        spent = time.monotonic() - started
        assert 1 <= len(waited) < layers - 1, waited  # some layers came in time, then the budget ran out
        assert spent < 0.25 + 0.15, f"the step waited {spent:.2f}s for its layers, over its 0.25 s budget"
        assert connector.layerwise_loads.num_layer_waits >= 2
    finally:
        stop.set()
        connector.close(wait_s=2.0)


def test_the_step_budget_counts_only_layer_waits_not_the_forwards_compute_between_them():
    """A forward that computes for longer than the budget still gets a layer that lands soon after."""
    released = threading.Event()

    class LateLastLayerTier(LayerwiseTier):
        def fill_layerwise(self, keys, block_ids, context, landed):
            landed(0)
            released.wait(5.0)  # bounded: the test releases it
            landed(1)
            return len(keys)

    connector, request = joined_early(LateLastLayerTier(), layer_wait_s=0.1, step_wait_s=0.05)
    try:
        assert connector.layerwise_loads.wait_layer(request, 0)  # landed: no wait
        time.sleep(0.1)  # layer 0's compute, twice the step's budget for waits
        threading.Timer(0.02, released.set).start()
        assert connector.layerwise_loads.wait_layer(request, 1), "the compute before the wait used up the budget for waits"
    finally:
        released.set()
        connector.close(wait_s=2.0)
