"""The KVStore gRPC service in-process, through NodeClient: info, round trips, chunking,
counters, leases, health and reflection."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster_helpers import NODE_CAPACITY_PAGES, NODE_PAGE_BYTES, raw_channel, serve_node
from kvcache import __version__
from kvnode.wire import grpc_frames as wire
from kvnode.wire.checksum import page_checksum
from kvnode.client import NodeClient, NodeError
from kvnode.service import SERVICE_NAME, KVStoreService
from kvnode.store.page_store import PageStore
from protos import kvcache_pb2 as pb
from store_helpers import key


def chain(n: int, start: int = 0) -> tuple[list[bytes], list[bytes]]:
    """Keys of a chain of n pages and their parents (the first is a root)."""
    keys = [key(start + i) for i in range(n)]
    return keys, [b""] + keys[:-1]


def random_pages(n: int, page_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, page_bytes), dtype=np.uint8)


def test_info_describes_the_node(node, client):
    info = client.info()
    assert info.node_id == "test-node"
    assert info.version == __version__
    assert (info.page_bytes, info.capacity_pages) == (NODE_PAGE_BYTES, NODE_CAPACITY_PAGES)
    assert (info.used_pages, info.leased_pages, info.free_pages) == (0, 0, NODE_CAPACITY_PAGES)
    assert (info.max_keys_per_request, info.max_message_bytes) == (8, 64 * 1024)


def test_put_lookup_get_round_trip_gives_the_same_bytes(node, client):
    keys, parents = chain(3)
    pages = random_pages(3, NODE_PAGE_BYTES)
    result = client.put_pages(keys, parents, pages)
    assert result.outcomes == ("stored",) * 3
    assert client.lookup(keys + [key(99)]) == 3
    got = client.get_pages(keys)
    assert got.shape == (3, NODE_PAGE_BYTES) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, pages)
    np.testing.assert_array_equal(client.get_pages(keys[1:2]), pages[1:2])  # any subset, in request order
    np.testing.assert_array_equal(client.get_pages([keys[2], keys[0]]), pages[[2, 0]])
    info = client.info()
    assert (info.used_pages, info.free_pages) == (3, NODE_CAPACITY_PAGES - 3)
    node.store.check_invariants()


def test_get_pages_writes_into_a_given_array(client):
    keys, parents = chain(2)
    pages = random_pages(2, NODE_PAGE_BYTES)
    client.put_pages(keys, parents, pages)
    out = np.zeros((2, NODE_PAGE_BYTES), dtype=np.uint8)
    assert client.get_pages(keys, out=out) is out
    np.testing.assert_array_equal(out, pages)
    with pytest.raises(ValueError, match="shape"):
        client.get_pages(keys, out=np.zeros((3, NODE_PAGE_BYTES), dtype=np.uint8))


def test_put_outcomes_over_the_wire(node, client):
    keys, parents = chain(2)
    pages = random_pages(3, NODE_PAGE_BYTES)
    result = client.put_pages([keys[0], keys[0], key(50)], [b"", b"", key(49)], pages)
    assert result.outcomes == ("stored", "already_present", "refused_no_parent")
    assert (result.stored, result.already_present, result.refused) == (1, 1, 1)
    assert set(node.store.keys()) == {keys[0]}


def test_put_refused_for_room_when_every_evictable_page_is_leased(make_node, clock):
    node = make_node(capacity_pages=2)
    with node.client() as client:
        keys, parents = chain(2)
        client.put_pages(keys, parents, random_pages(2, NODE_PAGE_BYTES))
        assert client.lookup(keys, lease_ms=1000) == 2
        assert client.info().leased_pages == 2
        result = client.put_pages([key(10)], [b""], random_pages(1, NODE_PAGE_BYTES))
        assert result.outcomes == ("refused_no_room",)
        np.testing.assert_array_equal(client.get_pages(keys), random_pages(2, NODE_PAGE_BYTES))
        clock.advance(1.0)
        assert client.info().leased_pages == 0
        assert client.put_pages([key(10)], [b""], random_pages(1, NODE_PAGE_BYTES)).outcomes == ("stored",)
    node.store.check_invariants()


def test_lookup_without_lease_leases_nothing(node, client):
    keys, parents = chain(2)
    client.put_pages(keys, parents, random_pages(2, NODE_PAGE_BYTES))
    assert client.lookup(keys) == 2
    assert client.info().leased_pages == 0
    assert client.lookup(keys[:1], lease_ms=500) == 1
    assert client.info().leased_pages == 1


def test_stats_counters_move_as_expected(node, client):
    assert set(client.stats().values()) == {0}
    keys, parents = chain(3)
    client.put_pages(keys, parents, random_pages(3, NODE_PAGE_BYTES))
    client.put_pages(keys[:1], parents[:1], random_pages(1, NODE_PAGE_BYTES))
    client.lookup(keys + [key(77)])
    client.lookup([key(78)])
    client.get_pages(keys[:2])
    stats = client.stats()
    disk = {name: stats.pop(name) for name in list(stats) if name.startswith(("disk_", "promotions", "demotions",
                                                                                "corrupted_", "orphaned_", "recover"))}
    assert set(disk.values()) == {0} and len(disk) == 9, "a node without a disk tier counts nothing there"
    assert stats == {
        "lookups": 2,
        "hit_pages": 3,
        "miss_pages": 2,
        "puts": 4,
        "stored_pages": 3,
        "evictions": 0,
        "refusals": 0,
        "bytes_in": 3 * NODE_PAGE_BYTES,  # the page already present adds nothing
        "bytes_out": 2 * NODE_PAGE_BYTES,
        "get_pages": 2,
        "reported_pages_dropped": 0,
    }


def test_evictions_and_refusals_are_counted(make_node):
    node = make_node(capacity_pages=2)
    with node.client() as client:
        client.put_pages([key(1), key(2), key(3)], [b""] * 3, random_pages(3, NODE_PAGE_BYTES))
        client.put_pages([key(5)], [key(4)], random_pages(1, NODE_PAGE_BYTES))
        stats = client.stats()
    assert (stats["evictions"], stats["refusals"], stats["stored_pages"]) == (1, 1, 3)
    assert stats["bytes_in"] == 3 * NODE_PAGE_BYTES  # the refused page's bytes do not count


# ---- chunking -----------------------------------------------------------------------


def get_pages_messages(address: str, keys: list[bytes]) -> list[bytes]:
    channel = raw_channel(address)
    try:
        call = channel.unary_stream(f"/{SERVICE_NAME}/GetPages", pb.GetPagesRequest.SerializeToString, None)
        return list(call(pb.GetPagesRequest(keys=keys), timeout=5))
    finally:
        channel.close()


def test_a_page_larger_than_one_message_is_chunked_both_ways(make_node):
    max_message = 4096
    page_bytes = 10_000  # three chunks per page
    node = make_node(capacity_pages=4, page_bytes=page_bytes, max_message_bytes=max_message)
    keys, parents = chain(3)
    pages = random_pages(3, page_bytes, seed=1)
    with node.client() as client:
        # Stored whole through a server that refuses any message over 4096 bytes: the client chunked.
        assert client.put_pages(keys, parents, pages).outcomes == ("stored",) * 3
        np.testing.assert_array_equal(client.get_pages(keys), pages)
    for k, expected in zip(keys, pages):
        assert node.store.read([k]) == expected.tobytes()
    messages = get_pages_messages(node.address, keys)
    assert all(len(m) <= max_message for m in messages)
    chunks = [wire.parse_page_chunk(m) for m in messages]
    assert len(chunks) == 3 * 3
    for page_index in range(3):
        mine = [(offset, bytes(data), bytes(sums)) for index, offset, data, sums in chunks if index == page_index]
        assert [offset for offset, _, _ in mine] == sorted(offset for offset, _, _ in mine)  # in order
        assert b"".join(data for _, data, _ in mine) == pages[page_index].tobytes()  # contiguous, whole
        assert [sums for _, _, sums in mine] == [page_checksum(keys[page_index], pages[page_index])] + [b""] * 2


def test_small_pages_are_grouped_into_few_messages_within_the_limit(make_node):
    max_message, page_bytes = 4096, 1000  # four pages fit one message
    node = make_node(capacity_pages=8, page_bytes=page_bytes, max_message_bytes=max_message, max_keys=8)
    keys, parents = chain(6)
    pages = random_pages(6, page_bytes, seed=2)
    with node.client() as client:
        client.put_pages(keys, parents, pages)
        np.testing.assert_array_equal(client.get_pages(keys), pages)
    messages = get_pages_messages(node.address, keys)
    assert all(len(m) <= max_message for m in messages)
    assert len(messages) == 2
    assert b"".join(bytes(wire.parse_page_chunk(m)[2]) for m in messages) == pages.tobytes()
    sums = b"".join(bytes(wire.parse_page_chunk(m)[3]) for m in messages)
    assert sums == b"".join(page_checksum(k, row) for k, row in zip(keys, pages))  # one per page, with it


def test_a_page_of_exactly_the_chunk_size_and_one_byte_more(make_node):
    max_message = 4096
    for page_bytes in (max_message - 64, max_message - 63):
        node = make_node(capacity_pages=2, page_bytes=page_bytes, max_message_bytes=max_message)
        pages = random_pages(2, page_bytes, seed=page_bytes)
        keys, parents = chain(2)
        with node.client() as client:
            assert client.put_pages(keys, parents, pages).stored == 2
            np.testing.assert_array_equal(client.get_pages(keys), pages)
        assert all(len(m) <= max_message for m in get_pages_messages(node.address, keys))


# ---- health and reflection ----------------------------------------------------------


def test_health_service_answers_serving(node):
    channel = raw_channel(node.address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_reflection_lists_the_service_and_describes_it(node):
    channel = raw_channel(node.address)
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    finally:
        channel.close()
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    files = described.file_descriptor_response.file_descriptor_proto
    assert files and any(b"KVStore" in f for f in files)


# ---- clients at once, and a node that is not there ----------------------------------


def test_concurrent_clients_find_the_pages_they_leased():
    """Four clients put, lease and fetch at once on a small store under eviction pressure:
    whatever a lookup leased, the following fetch gets, byte for byte."""
    store = PageStore(12, 256, clock=time.monotonic)
    failures: list[str] = []
    fetched = [0]

    def work(worker: int, address: str) -> None:
        try:
            with NodeClient(address) as client:
                for i in range(15):
                    keys, parents = chain(2, start=1000 * worker + 10 * i)
                    pages = random_pages(2, 256, seed=1000 * worker + i)
                    client.put_pages(keys, parents, pages)
                    hits = client.lookup(keys, lease_ms=5000)
                    if hits:
                        got = client.get_pages(keys[:hits])
                        if not np.array_equal(got, pages[:hits]):
                            failures.append(f"worker {worker} iteration {i}: wrong bytes")
                        fetched[0] += hits
                    client.lookup(keys)  # renews nothing
        except Exception as exc:  # reported below: a thread's exception would otherwise vanish
            failures.append(f"worker {worker}: {exc!r}")

    with serve_node(store) as node:
        threads = [threading.Thread(target=work, args=(w, node.address)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
    assert not failures
    assert fetched[0] > 0
    store.check_invariants()
    assert store.stats.evictions > 0 or store.stats.refusals > 0  # the store really was under pressure


def test_a_call_to_a_node_that_is_not_there_fails_within_its_deadline():

    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with NodeClient(address, timeout=1.0) as client:
            started = time.monotonic()
            with pytest.raises(NodeError) as raised:
                client.lookup([key(1)])
    assert raised.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert raised.value.address == address
    assert time.monotonic() - started < 3.0


def test_put_pages_needs_one_parent_and_one_page_per_key(client):
    with pytest.raises(ValueError, match="give one of each per page"):
        client.put_pages([key(1), key(2)], [b""], random_pages(2, NODE_PAGE_BYTES))


def test_put_pages_takes_any_contiguous_rows(node, client):
    rows = np.arange(2 * NODE_PAGE_BYTES // 4, dtype=np.float32).reshape(2, -1)  # float32 rows of page_bytes
    keys, parents = chain(2)
    assert client.put_pages(keys, parents, rows).stored == 2
    np.testing.assert_array_equal(client.get_pages(keys).view(np.float32), rows)


def test_put_pages_refuses_pages_it_cannot_send_before_sending_anything(node, client):
    strided = np.zeros((2, 2 * NODE_PAGE_BYTES), dtype=np.uint8)[:, ::2]  # rows of page_bytes, not contiguous
    keys, parents = chain(2)
    with pytest.raises(ValueError, match="page 0 is not a C-contiguous bytes-like buffer"):
        client.put_pages(keys, parents, strided)
    with pytest.raises(TypeError):
        client.put_pages(["not bytes"], [b""], random_pages(1, NODE_PAGE_BYTES))
    assert client.stats()["puts"] == 0
    assert node.store.keys() == []


def test_a_whole_page_item_with_padding_does_not_keep_its_message_alive():
    """A PutItem with one whole page and a large unknown field: the call keeps the page, not the
    whole message (a view would: 256 items of 8 MiB held 2 GiB for 32 MiB of pages); a plain
    item's page stays a view of its message (no copy)."""
    page_bytes, padding = 4096, 1 << 20
    service = KVStoreService(PageStore(8, page_bytes))

    def item(i: int, last: bool, pad: int) -> bytes:
        unknown = wire._tag(15, wire._LEN) + wire._varint(pad) + bytes(pad) if pad else b""
        return unknown + wire.put_item(key(i), b"", bytes([i]) * page_bytes, last)

    for pad in (padding, 0):
        items = service._receive_pages(wire.parse_put_item(item(i, i == 3, pad)) for i in range(4))
        assert [bytes(page) for _, _, page, _ in items] == [bytes([i]) * page_bytes for i in range(4)]
        behind = [len(memoryview(page).obj) for _, _, page, _ in items]  # the buffer each page keeps alive
        assert all(page_bytes <= size < page_bytes + 1024 for size in behind), behind
