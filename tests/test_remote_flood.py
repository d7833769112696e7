"""One client floods an engine with requests that each name 8 fresh kvnode addresses that never
answer; another client's request is served meanwhile with the right tokens, its pages still
fetched from a healthy node, and no lookup blocks the engine's thread for long.

Before the node table, each flood request cost its step 8 x 0.5 s of first contacts."""

import threading
import time

import pytest

from test_remote_nodes import Blackholes
from worker.engine.engine import Engine
from worker.model import load_model
from worker.remote.tier import Placement, RemoteTier

FLOOD = 24  # requests, each naming 8 fresh silent addresses: 192, past the table's 64 and the 16 probes
PARAMS = dict(max_new_tokens=40, ignore_eos=True)
SHARED = "You are a helpful assistant. Answer briefly, and cite what you read. "  # 4 full pages of 16 tokens


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def tiny_engine(model):
    return Engine(model, num_blocks=128, page_tokens=16, max_num_batched_tokens=256, seed=0)


def timed_lookups(tier, healthy: Placement):
    """Seconds each lookup of a flooding request (not `healthy`'s) held the engine's thread."""
    took, lookup = [], tier.lookup

    def timed(keys, placement):
        started = time.monotonic()
        try:
            return lookup(keys, placement)
        finally:
            if placement.addresses != healthy.addresses:
                took.append(time.monotonic() - started)

    tier.lookup = timed
    return took


def test_the_engine_serves_others_while_a_client_floods_it_with_silent_placements(tiny, make_node):
    victim_prompt = SHARED + "What does a kvnode store?"
    expected = tiny_engine(tiny).generate([victim_prompt], **PARAMS)[0].token_ids
    page_bytes = tiny_engine(tiny).kv_pool[0].nbytes
    node = make_node(capacity_pages=32, page_bytes=page_bytes, max_message_bytes=2**20)
    good = Placement([node.address])

    writer = tiny_engine(tiny)  # another worker wrote the shared pages
    writer_tier = RemoteTier(writer.kv_pool, "float32")
    writer.attach_remote_tier(writer_tier)
    try:
        writer.generate([SHARED + "First question?"], max_new_tokens=2, tier_context=good)
        assert writer_tier.flush(timeout_s=10.0) and writer_tier.stats.pages_written >= 4
    finally:
        writer_tier.close()

    engine = tiny_engine(tiny)
    # A worker's defaults, but for the healthy node's deadline: this node shares the test's process
    # (and its GIL) with the engine and the flood, and on a loaded machine it has missed 0.5 s.
    tier = RemoteTier(engine.kv_pool, "float32", lookup_timeout_s=2.0)
    engine.attach_remote_tier(tier)
    warm = engine.generate(["Hello there, a first request that knows the node."], max_new_tokens=2, tier_context=good)
    assert warm[0].finish_reason == "length"
    lookups = timed_lookups(tier, good)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if engine.wait_for_work(0.05):
                engine.step()

    stepping = threading.Thread(target=loop, name="engine-loop", daemon=True)
    try:
        with Blackholes(FLOOD * 8) as silent:
            stepping.start()
            flood = [engine.add_request(f"flood {i}: " + "fresh nodes for every request " * 2, max_new_tokens=2,
                                        tier_context=Placement(silent.addresses[8 * i : 8 * i + 8]))
                     for i in range(FLOOD)]
            started = time.monotonic()
            victim = engine.add_request(victim_prompt, tier_context=good, **PARAMS).result(timeout=60.0)
            took = time.monotonic() - started
            assert [h.result(timeout=60.0).finish_reason for h in flood] == ["length"] * FLOOD
            assert len(tier.nodes) <= 64 and tier.nodes.num_probes() <= 16
    finally:
        stop.set()
        stepping.join(10.0)
        tier.close()

    assert victim.token_ids == expected
    assert victim.usage.cached_tokens_remote == 64  # the healthy node served, flood or not
    assert len(lookups) >= FLOOD and max(lookups) < 1.0, f"a flood's lookup blocked the engine {max(lookups):.2f}s"
    assert took < 20.0, f"the other request took {took:.1f}s (before the node table: ~{FLOOD * 4} s)"
