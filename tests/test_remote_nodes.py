"""The remote tier's node table: nodes that never answer cost the engine a short, bounded wait;
a dead node backs off; the table and the probes in flight stay bounded, evicted clients closed.

A node that never answers is a local listening socket that accepts and never replies; one that
answers Info but hangs on Lookup is an in-process servicer that sleeps (bounded)."""

import contextlib
import hashlib
import selectors
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from kvnode.client import NodeClient, NodeError
from kvnode.service import KVStoreService
from worker.remote import nodes as remote_nodes
from worker.remote.tier import Placement, RemoteTier
from worker.remote.nodes import NodeTable

BLOCK_SHAPE = (2, 2, 2, 4, 8)  # layers, k/v, kv_heads, page_tokens, head_dim
PAGE_FLOAT16 = int(np.prod(BLOCK_SHAPE)) * 2
HANG_S = 10.0  # how long a hanging servicer sleeps at most


class Blackholes:
    """`count` local listening sockets that accept connections and never reply; one thread, bounded."""

    def __init__(self, count):
        self._selector = selectors.DefaultSelector()
        self._sockets = []
        for _ in range(count):
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ)
            self._sockets.append(listener)
        self.addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in self._sockets]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="blackholes", daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                with contextlib.suppress(OSError):
                    self._sockets.append(key.fileobj.accept()[0])  # kept open, never read or answered

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5.0)
        self._selector.close()
        for s in self._sockets:
            s.close()


class HangingLookup(KVStoreService):
    """Answers Info at once; Lookup sleeps until released (at most HANG_S)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def lookup(self, request, context):
        self.release.wait(HANG_S)
        return super().lookup(request, context)


def chain_keys(n, salt=b""):
    keys, parent = [], b"root"
    for i in range(n):
        parent = hashlib.blake2b(parent + salt + bytes([i]), digest_size=16).digest()
        keys.append(parent)
    return keys


def make_tier(**options):
    pool = np.zeros((16, *BLOCK_SHAPE), dtype=np.float32)
    return RemoteTier(pool, "float16", **options)


def healthy_node(make_node, keys):
    """An in-process node of the tier's page size holding `keys`."""
    node = make_node(capacity_pages=16, page_bytes=PAGE_FLOAT16)
    with node.client(use_data_plane=False) as client:
        pages = [bytes([i]) * PAGE_FLOAT16 for i in range(len(keys))]
        assert client.put_pages(keys, [b"", *keys[:-1]], pages).stored == len(keys)
    return node


def closed_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def timed(call, *args):
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


# ---- the engine's wait -----------------------------------------------------------


def test_a_lookup_naming_silent_nodes_returns_well_before_their_timeouts(make_node):
    keys = chain_keys(3, b"a")
    node = healthy_node(make_node, keys)
    tier = make_tier(lookup_timeout_s=2.0, first_contact_wait_s=0.1)  # 6 silent nodes: 12 s, one by one
    try:
        with Blackholes(6) as silent:
            placement = Placement([*silent.addresses, node.address])
            hits, took = timed(tier.lookup, keys, placement)
            assert took < 1.0, f"lookup blocked {took:.2f}s on nodes that never answer"
            if hits == 0:  # the node's first answer may come after the wait: the next request has it
                hits, took = timed(tier.lookup, keys, placement)
                assert took < 1.0
            assert hits == 3 and placement.source == node.address
            assert tier.fill(keys, [4, 5, 6], placement) == 3
            assert tier.nodes.num_probes() == 6  # still waiting for the silent ones, off the engine's thread
    finally:
        tier.close()
    assert tier.stats.pages_fetched == 3


def test_one_lookup_spends_its_timeout_once_across_nodes_that_hang(make_node):
    keys = chain_keys(2, b"hang")
    hanging = [make_node(page_bytes=PAGE_FLOAT16, service_cls=HangingLookup) for _ in range(4)]
    tier = make_tier(lookup_timeout_s=0.5)  # one by one, 2 s
    try:
        with tier.nodes.use([n.address for n in hanging]) as nodes:  # Info answers: the nodes are known good
            assert all(tier.nodes.ready(n, time.monotonic() + 10.0) for n in nodes)
        placement = Placement([n.address for n in hanging])
        hits, took = timed(tier.lookup, keys, placement)
        assert hits == 0 and took < 1.25, f"lookup blocked {took:.2f}s"
        assert tier.stats.node_failures == 1  # the first took the whole time; the others were not asked
        hits, took = timed(tier.lookup, keys, placement)
        assert hits == 0 and took < 1.25 and tier.stats.node_failures == 2  # the first skipped, the second failed
    finally:
        for node in hanging:
            node.service.release.set()
        tier.close()


def test_write_back_waits_for_first_contacts_once_a_batch_not_once_a_node(make_node):
    keys = chain_keys(2, b"write")
    node = make_node(capacity_pages=16, page_bytes=PAGE_FLOAT16)
    tier = make_tier(lookup_timeout_s=1.0)  # one by one, 6 s
    try:
        with Blackholes(6) as silent:
            placement = Placement([*silent.addresses, node.address])
            started = time.monotonic()
            for i, key in enumerate(keys):
                tier.on_page_full(key, keys[i - 1] if i else b"", i, placement)
            assert tier.flush(timeout_s=10.0)
            took = time.monotonic() - started
        assert took < 3.0, f"write-back took {took:.2f}s"
        assert tier.stats.pages_written == 2 and tier.stats.pages_dropped == 2 * 6
    finally:
        tier.close()


# ---- back-off and probes ---------------------------------------------------------


def test_a_failing_node_is_skipped_longer_each_time_in_a_row_up_to_a_cap():
    table = NodeTable(PAGE_FLOAT16, info_timeout_s=0.5, retry_after_s=1.0, max_retry_after_s=4.0, max_nodes=4,
                      max_probes=2)
    try:
        with table.use([closed_address()]) as (node,):
            assert not table.ready(node, time.monotonic() + 10.0)  # its probe failed, in the background
            table.succeeded(node)
            error = NodeError(node.address, grpc.StatusCode.UNAVAILABLE, "test")
            skips = []
            for _ in range(5):
                table.failed(node, error)
                skips.append(node.down_until - time.monotonic())
            assert [round(s) for s in skips] == [1, 2, 4, 4, 4]
            table.succeeded(node)
            table.failed(node, error)
            assert round(node.down_until - time.monotonic()) == 1
    finally:
        table.close()


def test_a_dead_node_is_probed_once_per_back_off_not_once_per_request():
    tier = make_tier(retry_after_s=30.0)
    try:
        dead = closed_address()
        assert tier.lookup(chain_keys(1), Placement([dead])) == 0
        node = tier.nodes.get(dead)
        assert node.probe is None or tier.nodes.ready(node, time.monotonic() + 5.0) is False
        for _ in range(20):
            assert tier.lookup(chain_keys(1), Placement([dead])) == 0
            assert node.probe is None and tier.nodes.num_probes() == 0
        assert tier.stats.node_failures == 1
    finally:
        tier.close()


def test_past_the_probe_cap_an_unknown_address_is_a_miss_without_a_probe():
    tier = make_tier(max_probes=2, first_contact_wait_s=0.05)
    try:
        with Blackholes(5) as silent:
            assert tier.lookup(chain_keys(1), Placement(silent.addresses)) == 0
            assert tier.nodes.num_probes() == 2
            assert [tier.nodes.get(a).probe is not None for a in silent.addresses] == [True, True, False, False, False]
    finally:
        tier.close()


# ---- the table's bound ---------------------------------------------------------------


@pytest.fixture
def clients(monkeypatch):
    """Every NodeClient the node table makes, and which of them were closed."""
    made, closed = [], []

    class Recorded(NodeClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(remote_nodes, "NodeClient", Recorded)
    return made, closed


def test_the_node_table_stays_bounded_and_closes_the_clients_it_evicts(make_node, clients):
    made, closed = clients
    keys = chain_keys(2, b"bound")
    node = healthy_node(make_node, keys)
    threads_before = threading.active_count()
    tier = make_tier(max_nodes=4, max_probes=2)
    try:
        for _ in range(30):
            placement = Placement([closed_address(), closed_address(), node.address])
            tier.lookup(keys, placement)
            assert len(tier.nodes) <= 4
        assert tier.lookup(keys, Placement([node.address])) == 2  # the one node in use all along was kept
        assert len(made) <= 61 and len(closed) == len(made) - len(tier.nodes)
        kept = {id(tier.nodes.get(address).client) for address in tier.nodes.addresses()}
        assert {id(c) for c in made} - {id(c) for c in closed} == kept
        assert len([t for t in threading.enumerate() if t.name.startswith("kv-probe")]) <= 2
        assert threading.active_count() <= threads_before + 10  # not one a client: 61 of them were made
    finally:
        tier.close()
    assert len(closed) == len(made)


def test_eviction_takes_a_node_not_answering_before_a_healthy_one_and_never_one_in_use(make_node, clients):
    made, closed = clients
    node = make_node(page_bytes=PAGE_FLOAT16)
    table = NodeTable(PAGE_FLOAT16, info_timeout_s=0.5, retry_after_s=30.0, max_retry_after_s=60.0, max_nodes=2,
                      max_probes=2)
    try:
        with table.use([node.address]) as (healthy,):
            assert table.ready(healthy, time.monotonic() + 10.0)
        dead = closed_address()
        with table.use([dead]) as (down,):
            assert not table.ready(down, time.monotonic() + 10.0)
        with table.use([closed_address()]) as (new,):  # the table is full: the dead node goes, though used later
            assert table.get(node.address) is healthy and table.get(dead) is None
            assert closed == [down.client]
            with table.use([node.address]), table.use([closed_address()]) as held:  # both nodes in use
                assert held == [] and len(table) == 2 and table.get(new.address) is new and closed == [down.client]
    finally:
        table.close()
    assert len(closed) == len(made)
