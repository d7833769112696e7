"""The vLLM connector when things go wrong, never stalling vLLM and never handing it bad bytes:
a page altered on the node fails its checksum (its block and every later one are recomputed, the
earlier ones land, the node drops it); a dead or hung kvnode is a miss within lookup_timeout_s and
fails its loads within load_timeout_s; saves that do not fit the save buffer go unsaved at once."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from cluster_helpers import node_process, started
from kvnode.data_plane.server import DataPlaneServer
from test_remote_altered_page import altering_env
from test_remote_nodes import Blackholes, HangingLookup
from vllm_connector.keys import block_keys, block_pages, layer_page_key
from vllm_connector.plan import BlockSave
from vllm_connector_helpers import (no_errors_logged,  # noqa: F401 - autouse
                                     BLOCK_SIZE, LAYOUT, NODE_ARGS, NUM_LAYERS, PAGE_BYTES, blocks, engine,
                                    random_layers, settings, tokens)

FP = LAYOUT.fingerprint()
NUM_SAVED = 5
A_IDS = [7, 3, 9, 1, 12, 5]  # engine A's blocks of the prompt
B_IDS = [2, 4, 6, 8, 10, 11]  # engine B's
MARGIN_S = 0.5  # past a timeout, for the threads and the test's polling


def chain(prompt, salt=""):
    """Every page key of the prompt's saved blocks, in chain order, and the blocks' keys."""
    keys = block_keys(FP, salt, prompt, BLOCK_SIZE, NUM_SAVED)
    return [k for b in range(NUM_SAVED) for k in block_pages(keys[b], keys[b - 1] if b else None, NUM_LAYERS)[0]], keys


def assert_altered_load(a, b, prompt, altered: int) -> None:
    num, errors, _ = b.load("r", prompt, B_IDS)
    assert num == NUM_SAVED * BLOCK_SIZE, "a lookup asks for the last layer's pages only: it finds all of them"
    assert errors == set(B_IDS[altered:NUM_SAVED])
    np.testing.assert_array_equal(blocks(b.layers, B_IDS[:altered]), blocks(a.layers, A_IDS[:altered]))
    counters = b.worker.counters
    assert (counters.pages_altered, counters.blocks_loaded, counters.blocks_failed) == \
        (1, altered, NUM_SAVED - altered)
    assert b.matched("again", prompt) == (altered * BLOCK_SIZE, altered > 0)  # dropped with what follows


@pytest.mark.parametrize("wire", ["data plane", "gRPC"])
@pytest.mark.parametrize("altered", [0, 2, 3])  # the first block; the first and the second of a later batch
def test_an_altered_page_fails_its_block_and_the_later_ones_and_the_node_drops_it(make_node, wire, altered):
    node = make_node(capacity_pages=64, page_bytes=PAGE_BYTES, max_keys=8)  # loads of 2 blocks a batch
    plane = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=8).start() if wire == "data plane" else None
    node.service.data_port = plane.port if plane else 0
    try:
        with engine(settings(node.address), random_layers(seed=30)) as a, engine(settings(node.address)) as b:
            prompt = tokens(NUM_SAVED * BLOCK_SIZE + 1, seed=31)
            a.save("w", prompt, A_IDS)
            pages, keys = chain(prompt)
            assert set(node.store.keys()) == set(pages)
            bad = layer_page_key(keys[altered], 1)
            node.store._pool[node.store._index[bad].slot, 5] ^= 0x04  # a flipped bit in the node's RAM

            assert_altered_load(a, b, prompt, altered)
            assert set(node.store.keys()) == set(pages[:pages.index(bad)])  # it and its descendants dropped
            node.store.check_invariants()
    finally:
        if plane:
            plane.stop()


def test_a_page_altered_in_a_kvnode_process_pool_is_refused_and_dropped_there(tmp_path):
    """The same against a real node, whose same-host clients read over its Unix socket or its shared pool."""
    prompt = tokens(NUM_SAVED * BLOCK_SIZE + 1, seed=32)
    pages, keys = chain(prompt)
    bad = layer_page_key(keys[2], 3)  # the last layer's: the lookup's own key
    with started(tmp_path, "node", "node", *NODE_ARGS, env=altering_env(bad)) as node:
        with engine(settings(node.address), random_layers(seed=33)) as a, engine(settings(node.address)) as b:
            a.save("w", prompt, A_IDS)
            assert_altered_load(a, b, prompt, 2)
            with b.worker.nodes.use([node.address]) as held:
                client = held[0].client
                assert client.lookup(pages) == pages.index(bad)
                assert client.stats()["reported_pages_dropped"] == len(pages) - pages.index(bad)
    assert "Traceback" not in (tmp_path / "node.log").read_text()


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_dead_or_hung_node_is_a_miss_within_the_lookup_timeout_and_fails_its_loads_in_time(tmp_path, fault):
    lookup_s, load_s = 0.4, 1.0
    with node_process(tmp_path, *NODE_ARGS) as node, contextlib.ExitStack() as stack:
        stack.callback(node.kill)  # also when the test fails: a stopped node is killed, by its pid
        s = settings(node.address, lookup_timeout_s=lookup_s, load_timeout_s=load_s)
        a = stack.enter_context(engine(s, random_layers(seed=40)))
        b = stack.enter_context(engine(s))
        prompt, other = tokens(4 * BLOCK_SIZE + 1, seed=41), tokens(2 * BLOCK_SIZE + 1, seed=42)
        a.save("w", prompt, A_IDS)
        a.save("w2", other, [20, 21, 22])
        assert b.load("warm", other, [20, 21, 22])[:2] == (2 * BLOCK_SIZE, set())  # B's sides met the node
        assert b.matched("planned", prompt) == (4 * BLOCK_SIZE, True)
        b.scheduler.after_alloc("planned", B_IDS, 4 * BLOCK_SIZE)
        plan = b.scheduler.plan({})
        assert [len(load.block_ids) for load in plan.loads] == [4]

        if fault == "killed":
            node.kill()
        else:
            os.kill(node.pid, signal.SIGSTOP)
        for engine_ in (b, stack.enter_context(engine(s))):  # one that met the node, one that never did
            begun = time.monotonic()
            assert engine_.matched("after", prompt, timeout_s=lookup_s + MARGIN_S) == (0, False)
            assert time.monotonic() - begun < lookup_s + MARGIN_S
            errors, seconds = engine_.run_loads(plan, {"planned"}, timeout_s=load_s + MARGIN_S)
            assert errors == set(B_IDS[:4]) and seconds < load_s + MARGIN_S
            assert engine_.worker.counters.blocks_failed == 4
        assert not blocks(b.layers, B_IDS[:4]).any(), "nothing came from the dead node"

        begun = time.monotonic()
        a.worker.save([BlockSave("w3", (node.address,), tuple(block_keys(FP, "", other, BLOCK_SIZE, 2)), 0, (20, 21))])
        assert time.monotonic() - begun < 0.2  # copied out; sent (and failed) on the saver's thread
        assert a.worker.wait_for_saves(load_s + MARGIN_S)
        assert a.worker.counters.blocks_unsaved == 2


def test_saves_past_the_save_buffer_go_unsaved_at_once_and_the_next_that_fits_is_sent(make_node):
    node = make_node(capacity_pages=64, page_bytes=PAGE_BYTES, max_keys=8)
    block_bytes = NUM_LAYERS * PAGE_BYTES  # 16 KiB: 64 blocks fill 1 MiB
    with engine(settings(node.address, save_buffer_mib=1), random_layers(seed=50)) as a:
        too_many = tuple(range(20)) * 4 + (0,)  # 81 blocks (vLLM's ids may repeat here: never sent)
        assert len(too_many) * block_bytes > 1 << 20
        a.worker.save([BlockSave("big", (node.address,), (b"\1" * 16,) * len(too_many), 0, too_many)])
        assert a.worker.counters.blocks_unsaved == len(too_many)
        prompt = tokens(3 * BLOCK_SIZE + 1, seed=51)
        a.save("fits", prompt, [4, 5, 6, 7])
        assert (a.worker.counters.blocks_saved, a.worker.counters.blocks_unsaved) == (3, len(too_many))
        keys = block_keys(FP, "", prompt, BLOCK_SIZE, 3)
        assert set(node.store.keys()) == {k for b in range(3) for k in block_pages(keys[b], None, NUM_LAYERS)[0]}

    with engine(settings(node.address, save_buffer_mib=0), random_layers(seed=52)) as z:
        z.save("none", tokens(3 * BLOCK_SIZE + 1, seed=53), [1, 2, 3, 4])
        assert (z.worker.counters.blocks_saved, z.worker.counters.blocks_unsaved) == (0, 3)
        assert len(node.store.keys()) == 3 * NUM_LAYERS  # nothing more sent


def test_the_save_buffer_holds_what_waits_to_be_sent_and_a_stuck_node_blocks_nothing():
    """Saves to a node that never answers: the first fills most of the buffer while its send waits;
    one that does not fit what is left goes unsaved at once, one that does is queued; vLLM's
    thread never waits. Once the sends gave up, every block is counted unsaved and the buffer is free."""
    with Blackholes(1) as holes:
        address = holes.addresses[0]
        with engine(settings(address, save_buffer_mib=1, load_timeout_s=1.0), random_layers(seed=60)) as a:
            def save(n):
                ids = tuple(i % 24 for i in range(n))
                a.worker.save([BlockSave(f"s{n}", (address,), (b"\2" * 16,) * n, 0, ids)])

            begun = time.monotonic()
            save(40)  # 640 KiB of 1 MiB: queued, its send waiting for the node
            save(30)  # 480 KiB: no room
            save(24)  # 384 KiB: exactly the rest
            save(1)   # none left
            assert time.monotonic() - begun < 0.5
            assert a.worker.counters.blocks_unsaved == 31 and a.worker.counters.blocks_saved == 0
            assert a.worker.wait_for_saves(5.0)
            assert (a.worker.counters.blocks_saved, a.worker.counters.blocks_unsaved) == (0, 95)
            assert a.worker._save_budget == 1 << 20


def test_a_lookup_still_running_at_its_deadline_is_a_miss_at_once(make_node):
    """vLLM is told 0 once lookup_timeout_s passed, also while the lookup's thread is still stuck in
    a call (here, a node whose Lookup hangs, seen through a clock run ahead past the deadline)."""
    node = make_node(capacity_pages=64, page_bytes=PAGE_BYTES, max_keys=8, service_cls=HangingLookup)
    ahead = [0.0]
    try:
        with engine(settings(node.address, lookup_timeout_s=5.0)) as b:
            b.scheduler.clock = lambda: time.monotonic() + ahead[0]
            prompt = tokens(3 * BLOCK_SIZE + 1, seed=70)
            assert b.scheduler.num_new_matched_tokens("r", prompt, "", 0) == (None, False)
            ahead[0] = 4.0
            assert b.scheduler.num_new_matched_tokens("r", prompt, "", 0) == (None, False)  # not yet
            ahead[0] = 5.0
            assert b.scheduler.num_new_matched_tokens("r", prompt, "", 0) == (0, False)
            assert not b.scheduler._lookups["r"].future.done(), "the lookup ended: this test tested nothing"
            b.scheduler.after_alloc("r", [0, 1, 2, 3], 0)
            assert b.scheduler.plan({}).loads == []
    finally:
        node.service.release.set()
