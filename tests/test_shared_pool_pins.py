"""Pages read in place in the node's shared pool (kvnode/client/shared_pool_pins.py): shared_pool_file
gives the caller its own descriptor of the mapped pool and a generation that a remap changes;
pin_pages names the slots of pages it checked and leaves them pinned until release, and gives
None, with nothing pinned, whenever the pages cannot be read in place."""

from __future__ import annotations

import gc
import os
import time

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, free_port, node_process, wait_for
from data_plane_helpers import GOOD, GOOD_PARENTS, pages
from kvnode.wire import shared_pool
from kvnode.client import NodeClient, NodeError, PageRejected, PinnedPages, SharedPoolFile
from kvnode.client.data_client import DataPlaneClient
from kvnode.disk.tier import DiskTier
from kvnode.store.page_store import PageStore
from store_helpers import key
from test_data_plane_shared_pool import ARGS, shared_node
from test_node_checksums import flip_byte_in_pool

pytestmark = pytest.mark.skipif(not shared_pool.supported(), reason="the shared pool needs Linux (memfd, SO_PEERCRED)")


def mapped(file: SharedPoolFile) -> np.ndarray:
    """The pool as the worker maps it: from the descriptor it was given, which it then closes."""
    try:
        return shared_pool.map_read_only(file.fd, file.pages, file.page_bytes)
    finally:
        os.close(file.fd)


def put_chain(client: NodeClient, keys: list[bytes], data: np.ndarray, per_call: int = 8) -> None:
    parents = [b"", *keys[:-1]]
    for start in range(0, len(keys), per_call):
        end = start + per_call
        assert client.put_pages(keys[start:end], parents[start:end], data[start:end]).stored == len(keys[start:end])


def test_shared_pool_file_is_a_descriptor_of_the_mapped_pool():
    with shared_node() as (node, server), node.client() as client:
        assert client.shared_pool_file() is None, "nothing mapped yet"
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert client.map_shared_pool(timeout=5)
        first, second = client.shared_pool_file(), client.shared_pool_file()
        assert first.fd != second.fd, "each call gives a descriptor of its own"
        assert (first.pages, first.page_bytes) == (16, NODE_PAGE_BYTES)
        assert first.generation == second.generation > 0
        pool, other = mapped(first), mapped(second)
        slots = [node.store._index[k].slot for k in GOOD]
        np.testing.assert_array_equal(pool[slots], pages(3))
        np.testing.assert_array_equal(other[slots], pages(3))
        reader = client._data.shared_pool
        assert reader._fd is not None
    assert reader._fd is None and client.shared_pool_file() is None, "the reader kept the descriptor after close"


def test_shared_pool_state_says_what_the_client_did_with_the_nodes_pool():
    with shared_node() as (node, server), node.client() as client:
        assert client.shared_pool_state() is None, "no data plane client before the first contact"
        client.prepare_data_plane()  # begins the mapping on a thread of its own
        assert client.shared_pool_state() in ("mapping", "mapped")
        assert client.shared_pool_state(wait=10) == "mapped"
        file = client.shared_pool_file()
        assert file is not None, "mapped: a descriptor of it to be had"
        os.close(file.fd)
    with shared_node(share_pool=False) as (node, server):
        with node.client() as refused:
            refused.prepare_data_plane()
            assert refused.shared_pool_state(wait=10) == "refused"
        with node.client(unix_socket=False) as tcp:
            tcp.prepare_data_plane()
            assert tcp.shared_pool_state() == "refused", "over TCP it is never asked"


def test_no_shared_pool_file_nor_pins_with_tls_tcp_or_no_shared_pool():
    with shared_node(share_pool=False) as (node, server), node.client() as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert not client.map_shared_pool(timeout=5)
        assert client.shared_pool_file() is None and client.pin_pages(GOOD) is None
    with shared_node() as (node, server):
        with node.client(unix_socket=False) as tcp:
            assert tcp.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
            assert not tcp.map_shared_pool(timeout=5)
            assert tcp.shared_pool_file() is None and tcp.pin_pages(GOOD) is None
        with node.client() as tls:
            tls._data_plane().close()
            tls._data = DataPlaneClient("127.0.0.1", server.port, tls=object(), unix_name=server.unix_name)
            assert tls._data_plane() is tls._data and tls._data.pool_state == "refused"
            assert tls.shared_pool_file() is None and tls.pin_pages(GOOD) is None
        assert node.store.num_pinned() == 0 and server.pages_by_slot == 0


def test_a_restarted_node_is_mapped_under_a_new_generation(tmp_path):
    ports = ("--port", str(free_port()), "--data-port", str(free_port()))
    client = NodeClient(f"127.0.0.1:{ports[1]}")
    keys = [key(i) for i in range(1, 4)]
    try:
        with node_process(tmp_path, *ARGS, *ports):
            put_chain(client, keys, pages(3))
            assert client.map_shared_pool(timeout=10)
            old = client.shared_pool_file()
            pinned = client.pin_pages(keys)
            assert pinned.generation == old.generation
            np.testing.assert_array_equal(mapped(old)[pinned.slots], pages(3))
            pinned.release()
        with node_process(tmp_path, *ARGS, *ports):
            put_chain(client, keys, pages(3, first=7))  # the old name is gone: TCP, and the old mapping dropped
            assert client.map_shared_pool(timeout=10)
            new = client.shared_pool_file()
            assert new.generation != old.generation
            pinned = client.pin_pages(keys)
            assert pinned.generation == new.generation
            np.testing.assert_array_equal(mapped(new)[pinned.slots], pages(3, first=7))
            pinned.release()
    finally:
        client.close()


def test_pinned_pages_stay_in_their_slots_until_released():
    with shared_node() as (node, server), node.client() as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert client.map_shared_pool(timeout=5)
        pool = mapped(client.shared_pool_file())
        pinned = client.pin_pages(GOOD)
        assert isinstance(pinned, PinnedPages) and pinned.page_bytes == NODE_PAGE_BYTES
        assert pinned.generation == client.shared_pool_file().generation
        assert pinned.slots == [node.store._index[k].slot for k in GOOD]
        np.testing.assert_array_equal(pool[pinned.slots], pages(3))
        assert node.store.num_pinned() == 3
        others = [key(100 + i) for i in range(16)]
        for k, row in zip(others, pages(16, first=5)):  # fills the store: only unpinned pages may go
            node.store.put(k, b"", row.tobytes())
        assert all(k in node.store for k in GOOD) and node.store.num_pinned() == 3
        np.testing.assert_array_equal(pool[pinned.slots], pages(3))
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))  # other fetches go on meanwhile
        pinned.release()
        pinned.release()  # idempotent
        assert pinned.released and wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
        for _ in range(5):  # the connection went back to the pool: no new one each time
            again = client.pin_pages(GOOD)
            np.testing.assert_array_equal(pool[again.slots], pages(3))
            again.release()
        assert len(client._data._idle) <= 2 and server.num_connections() <= 2
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
        node.store.check_invariants()


def test_keys_beyond_one_request_are_pinned_over_several_and_more_than_four_give_none():
    store = PageStore(40, NODE_PAGE_BYTES, shared_pool=True)
    keys = [key(i) for i in range(1, 34)]
    data = pages(33)
    with shared_node(store) as (node, server), node.client() as client:
        put_chain(client, keys[:32], data[:32])
        assert client.map_shared_pool(timeout=5)
        pool = mapped(client.shared_pool_file())
        pinned = client.pin_pages(keys[:20])  # the node takes 8 keys a request: 3 requests
        np.testing.assert_array_equal(pool[pinned.slots], data[:20])
        assert node.store.num_pinned() == 20
        pinned.release()
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
        pinned = client.pin_pages(keys[:32])  # 4 requests: the most
        assert len(pinned.slots) == 32
        pinned.release()
        assert client.pin_pages(keys) is None, "33 keys need 5 requests"
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)


def test_an_altered_page_is_rejected_and_nothing_stays_pinned():
    with shared_node() as (node, server), node.client() as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert client.map_shared_pool(timeout=5)
        flip_byte_in_pool(node, GOOD[1])
        with pytest.raises(PageRejected) as rejected:
            client.pin_pages(GOOD)
        assert (rejected.value.index, rejected.value.key) == (1, GOOD[1])
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)


def test_pages_pinned_unchecked_are_checked_by_the_caller_before_the_release():
    with shared_node() as (node, server), node.client() as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert client.map_shared_pool(timeout=5)
        pinned = client.pin_pages(GOOD, check=False)
        assert pinned.first_altered() is None
        flip_byte_in_pool(node, GOOD[2])
        assert pinned.first_altered() == 2 and node.store.num_pinned() == 3, "still the caller's to release"
        pinned.release()
        with pytest.raises(RuntimeError, match="release"):
            pinned.first_altered()
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)


def test_an_unknown_key_is_not_found_and_nothing_stays_pinned():
    with shared_node() as (node, server), node.client() as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert client.map_shared_pool(timeout=5)
        with pytest.raises(NodeError) as missing:
            client.pin_pages([*GOOD, key(999)])
        assert missing.value.code == grpc.StatusCode.NOT_FOUND and key(999).hex() in missing.value.details
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
        pinned = client.pin_pages(GOOD)  # the client goes on
        pinned.release()


def test_a_page_without_a_slot_gives_none_and_nothing_stays_pinned(tmp_path):
    """RAM holds 2 pages: of 4 on disk only, the node promotes 2 and has no slot for the others."""
    store = PageStore(2, NODE_PAGE_BYTES, disk=DiskTier(tmp_path, 8, NODE_PAGE_BYTES), shared_pool=True)
    keys = [key(i) for i in range(1, 7)]
    for parent, k, row in zip([b"", *keys[:-1]], keys, pages(6)):
        store.put(k, parent, row.tobytes())
    store.flush()
    with shared_node(store) as (node, server), node.client() as client:
        assert client.map_shared_pool(timeout=5)
        assert client.pin_pages(keys[:4]) is None
        assert store.stats.promotions >= 2, "the GET_SLOTS did not reach the node"
        assert wait_for(lambda: store.num_pinned() == 0, timeout_s=2.0)
        np.testing.assert_array_equal(client.get_pages(keys[:4]), pages(6)[:4])
        store.check_invariants()


def test_a_stale_pooled_connection_is_retried_and_unreleased_pins_are_not_leaked():
    with shared_node(timeout_s=0.5) as (node, server), node.client() as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert client.map_shared_pool(timeout=5)
        client.pin_pages(GOOD).release()
        assert wait_for(lambda: server.num_connections() == 0, timeout_s=5.0)  # the node closed the idle pooled one
        pinned = client.pin_pages(GOOD)
        assert pinned is not None and node.store.num_pinned() == 3
        del pinned  # never released: collected, its connection closed, the node unpins
        gc.collect()
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=0.4), "pins outlived a collected PinnedPages"
        with pytest.raises(NodeError) as late:
            client.pin_pages(GOOD, timeout=1e-9)  # the deadline bounds the call
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
