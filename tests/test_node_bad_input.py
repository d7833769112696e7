"""Bad input to the KVStore service (docs/architecture.md, invariants): each gets a clear status and
message, changes nothing, and the node goes on serving with its invariants intact. Every method
that reflection lists gets bad input against a real node in test_node_bad_input_every_method.py."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, raw_channel, serve_node
from kvnode.wire import grpc_frames as wire
from kvnode.client import NodeError
from kvnode.service import SERVICE_NAME, KVStoreService
from kvnode.store.page_store import MAX_LEASE_MS, PageStore
from protos import kvcache_pb2 as pb
from store_helpers import key

MAX_KEYS = 8
GOOD = [key(i) for i in range(3)]
GOOD_PARENTS = [b"", GOOD[0], GOOD[1]]
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def pages(n: int, size: int = NODE_PAGE_BYTES) -> list[bytes]:
    return [bytes([i + 1]) * size for i in range(n)]


@pytest.fixture
def seeded(node, client):
    """The node with a chain of three pages stored, so 'nothing changed' has something to keep."""
    assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
    return node


def assert_unharmed(node, client, stored: set[bytes]) -> None:
    """Invariants hold, exactly `stored` is cached, and the node still answers a full round trip."""
    node.store.check_invariants()
    assert set(node.store.keys()) == stored
    assert client.info().used_pages == len(stored)
    assert client.lookup(GOOD) == 3
    np.testing.assert_array_equal(client.get_pages(GOOD), np.frombuffer(b"".join(pages(3)), np.uint8).reshape(3, -1))
    probe = key(1000)
    assert client.put_pages([probe], [b""], pages(1)).stored == 1
    assert client.lookup([probe]) == 1


def expect_error(call, code: grpc.StatusCode, *fragments: str) -> NodeError:
    with pytest.raises(NodeError) as raised:
        call()
    error = raised.value
    assert error.code == code, error
    for fragment in fragments:
        assert fragment in error.details, error.details
    return error


# ---- through the client --------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"", b"x" * 15, b"x" * 17], ids=["empty", "15 bytes", "17 bytes"])
def test_lookup_with_a_key_of_the_wrong_length(seeded, client, bad):
    expect_error(lambda: client.lookup([GOOD[0], bad]), INVALID, f"key must be 16 bytes, got {len(bad)}")
    assert client.stats()["lookups"] == 0
    assert_unharmed(seeded, client, set(GOOD))


@pytest.mark.parametrize("bad", [b"x" * 15, b"x" * 17])
def test_get_with_a_key_of_the_wrong_length(seeded, client, bad):
    expect_error(lambda: client.get_pages([GOOD[0], bad]), INVALID, f"key must be 16 bytes, got {len(bad)}")
    assert client.stats()["get_pages"] == 0
    assert_unharmed(seeded, client, set(GOOD))


@pytest.mark.parametrize("bad", [b"x" * 15, b"x" * 17])
def test_put_with_a_key_of_the_wrong_length_stores_nothing(seeded, client, bad):
    new = key(50)
    expect_error(
        lambda: client.put_pages([new, bad], [GOOD[2], new], pages(2)), INVALID, f"key must be 16 bytes, got {len(bad)}"
    )
    assert_unharmed(seeded, client, set(GOOD))


@pytest.mark.parametrize("bad", [b"p" * 15, b"p" * 17])
def test_put_with_a_parent_of_the_wrong_length_stores_nothing(seeded, client, bad):
    expect_error(
        lambda: client.put_pages([key(50), key(51)], [GOOD[2], bad], pages(2)),
        INVALID,
        f"parent key must be 16 bytes, got {len(bad)}",
    )
    assert_unharmed(seeded, client, set(GOOD))


def test_put_of_a_page_naming_itself_as_parent(seeded, client):
    k = key(50)
    expect_error(lambda: client.put_pages([k], [k], pages(1)), INVALID, "names itself as its parent")
    assert_unharmed(seeded, client, set(GOOD))


@pytest.mark.parametrize("size", [NODE_PAGE_BYTES - 1, 1, NODE_PAGE_BYTES + 1, 3 * NODE_PAGE_BYTES])
def test_put_of_a_page_of_the_wrong_size_stores_nothing(seeded, client, size):
    keys = [key(50), key(51)]
    data = [bytes(NODE_PAGE_BYTES), bytes(size)]
    error = expect_error(lambda: client.put_pages(keys, [GOOD[2], keys[0]], data), INVALID, keys[1].hex(),
                         str(NODE_PAGE_BYTES))
    if size > NODE_PAGE_BYTES:
        assert f"more than {NODE_PAGE_BYTES} bytes" in error.details
    assert_unharmed(seeded, client, set(GOOD))


def test_more_keys_than_the_limit(seeded, client):
    keys = [key(100 + i) for i in range(MAX_KEYS + 1)]
    message = f"{MAX_KEYS + 1} keys in one request; this node takes at most {MAX_KEYS}"
    expect_error(lambda: client.lookup(keys), INVALID, message)
    expect_error(lambda: client.get_pages(keys), INVALID, message)
    parents = [b""] + keys[:-1]
    expect_error(lambda: client.put_pages(keys, parents, pages(MAX_KEYS + 1)), INVALID, message)
    assert_unharmed(seeded, client, set(GOOD))  # not even the first MAX_KEYS pages were stored


def test_exactly_the_limit_is_accepted(node, client):
    keys = [key(100 + i) for i in range(MAX_KEYS)]
    assert client.put_pages(keys, [b""] + keys[:-1], pages(MAX_KEYS)).stored == MAX_KEYS
    assert client.lookup(keys) == MAX_KEYS
    assert client.get_pages(keys).shape == (MAX_KEYS, NODE_PAGE_BYTES)


def test_fetch_of_a_page_that_is_not_cached_names_it(seeded, client):
    missing = key(77)
    expect_error(lambda: client.get_pages([GOOD[0], missing]), NOT_FOUND, missing.hex(), "not cached")
    assert client.stats()["get_pages"] == 0  # refused before any page was sent
    assert_unharmed(seeded, client, set(GOOD))


def test_fetch_of_no_keys_is_an_empty_array_without_a_call(seeded, client):
    got = client.get_pages([])
    assert got.shape == (0, NODE_PAGE_BYTES) and got.dtype == np.uint8
    assert client.stats()["get_pages"] == 0
    assert_unharmed(seeded, client, set(GOOD))


def test_a_raw_get_pages_of_no_keys_is_invalid_argument(seeded, client):
    channel = raw_channel(seeded.address)
    try:
        call = channel.unary_stream(f"/{SERVICE_NAME}/GetPages", None, None)
        expect_rpc_error(lambda: list(call(pb.GetPagesRequest().SerializeToString(), timeout=5)), INVALID,
                         "at least one key")
    finally:
        channel.close()
    assert_unharmed(seeded, client, set(GOOD))


@pytest.mark.parametrize("lease_ms", [MAX_LEASE_MS + 1, 2**32 - 1])
def test_a_lease_too_long(seeded, client, lease_ms):
    expect_error(lambda: client.lookup(GOOD, lease_ms=lease_ms), INVALID, f"between 0 and {MAX_LEASE_MS}")
    assert client.info().leased_pages == 0
    assert_unharmed(seeded, client, set(GOOD))


def test_empty_put_stream(seeded, client):
    expect_error(lambda: client.put_pages([], [], []), INVALID, "carried no pages")
    assert_unharmed(seeded, client, set(GOOD))


# ---- hand-made streams and raw bytes -------------------------------------------------


def put_raw(address: str, messages: list[bytes], timeout: float = 5.0) -> bytes:
    channel = raw_channel(address)
    try:
        return channel.stream_unary(f"/{SERVICE_NAME}/PutPages", None, None)(iter(messages), timeout=timeout)
    finally:
        channel.close()


def unary_raw(address: str, method: str, request: bytes, timeout: float = 5.0) -> bytes:
    channel = raw_channel(address)
    try:
        return channel.unary_unary(f"/{SERVICE_NAME}/{method}", None, None)(request, timeout=timeout)
    finally:
        channel.close()


def expect_rpc_error(call, code: grpc.StatusCode, *fragments: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error = raised.value
    assert error.code() == code, (error.code(), error.details())
    for fragment in fragments:
        assert fragment in (error.details() or ""), error.details()
    return error


def test_a_raw_put_stream_is_accepted(node, client):
    """The hand-made streams below are well formed but for their one flaw: this one has none."""
    reply = pb.PutReply.FromString(put_raw(node.address, [wire.put_item(key(50), b"", pages(1)[0], last=True)]))
    assert list(reply.outcomes) == [pb.PutReply.STORED]
    assert key(50) in node.store


def test_a_stream_without_its_last_mark_stores_nothing(seeded, client):
    """Only the final item's mark tells a complete stream from one grpcio ended early."""
    items = [wire.put_item(key(50), GOOD[2], pages(1)[0]), wire.put_item(key(51), key(50), pages(1)[0])]
    expect_rpc_error(lambda: put_raw(seeded.address, items), INVALID, "without an item marked last")
    assert_unharmed(seeded, client, set(GOOD))


def test_an_item_after_the_last_one_stores_nothing(seeded, client):
    items = [wire.put_item(key(50), GOOD[2], pages(1)[0], last=True), wire.put_item(key(51), key(50), pages(1)[0])]
    expect_rpc_error(lambda: put_raw(seeded.address, items), INVALID, "after the one marked last")
    assert_unharmed(seeded, client, set(GOOD))


def test_a_stream_that_ends_mid_page_stores_nothing(seeded, client):
    k = key(50)
    half = NODE_PAGE_BYTES // 2
    first = wire.put_item(key(49), GOOD[2], pages(1)[0])
    expect_rpc_error(
        lambda: put_raw(seeded.address, [first, wire.put_item(k, key(49), bytes(half))]),
        INVALID,
        k.hex(),
        f"ended after {half} of {NODE_PAGE_BYTES} bytes",
    )
    assert_unharmed(seeded, client, set(GOOD))


def test_a_new_page_before_the_last_one_is_complete_stores_nothing(seeded, client):
    k = key(50)
    messages = [wire.put_item(k, GOOD[2], bytes(10)), wire.put_item(key(51), k, bytes(NODE_PAGE_BYTES))]
    expect_rpc_error(lambda: put_raw(seeded.address, messages), INVALID, k.hex(), "ended after 10 of")
    assert_unharmed(seeded, client, set(GOOD))


def test_a_continuation_without_a_preceding_key_stores_nothing(seeded, client):
    messages = [wire.put_item(b"", b"", bytes(NODE_PAGE_BYTES))]
    expect_rpc_error(lambda: put_raw(seeded.address, messages), INVALID, "has no key and follows no page")
    complete = wire.put_item(key(50), GOOD[2], bytes(NODE_PAGE_BYTES))  # a whole page, then a stray continuation
    expect_rpc_error(lambda: put_raw(seeded.address, [complete] + messages), INVALID, "has no key and follows no page")
    assert_unharmed(seeded, client, set(GOOD))


def test_a_continuation_carrying_a_parent_stores_nothing(seeded, client):
    k = key(50)
    messages = [wire.put_item(k, GOOD[2], bytes(10)), wire.put_item(b"", GOOD[1], bytes(NODE_PAGE_BYTES - 10))]
    expect_rpc_error(lambda: put_raw(seeded.address, messages), INVALID, "continuation item must not carry a parent")
    assert_unharmed(seeded, client, set(GOOD))


GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1 claims ~4 GiB that are not there


@pytest.mark.parametrize(
    "method, message_name",
    [("Lookup", "LookupRequest"), ("GetPages", "GetPagesRequest"), ("Info", "InfoRequest"), ("Stats", "StatsRequest")],
)
def test_a_unary_request_that_does_not_parse(seeded, client, method, message_name):
    channel = raw_channel(seeded.address)
    try:
        if method == "GetPages":
            call = lambda: list(channel.unary_stream(f"/{SERVICE_NAME}/{method}", None, None)(GARBAGE, timeout=5))
        else:
            call = lambda: channel.unary_unary(f"/{SERVICE_NAME}/{method}", None, None)(GARBAGE, timeout=5)
        expect_rpc_error(call, INVALID, f"{message_name} message does not parse")
    finally:
        channel.close()
    assert_unharmed(seeded, client, set(GOOD))


def test_a_put_stream_whose_only_message_does_not_parse(seeded, client):
    expect_rpc_error(lambda: put_raw(seeded.address, [GARBAGE]), INVALID, "PutItem message does not parse",
                     "nothing stored")
    assert_unharmed(seeded, client, set(GOOD))


@pytest.mark.parametrize("position", [1, 2])
def test_a_put_stream_whose_later_message_does_not_parse_stores_nothing(seeded, client, position):
    """grpcio's threaded server may end the handler's iterator early on such a message: the items
    before it must not be stored as if the stream were complete."""
    good = [wire.put_item(key(50), GOOD[2], pages(1)[0]), wire.put_item(key(51), key(50), pages(1)[0])]
    messages = good[:position] + [GARBAGE] + good[position:]
    expect_rpc_error(lambda: put_raw(seeded.address, messages), INVALID, "PutItem message does not parse")
    assert_unharmed(seeded, client, set(GOOD))


def test_a_message_over_the_size_limit(make_node):
    node = make_node(max_message_bytes=4096)
    with node.client() as client:
        client.put_pages(GOOD, GOOD_PARENTS, pages(3))
        too_big = pb.LookupRequest(keys=[key(i) for i in range(300)]).SerializeToString()
        assert len(too_big) > 4096
        expect_rpc_error(lambda: unary_raw(node.address, "Lookup", too_big), grpc.StatusCode.RESOURCE_EXHAUSTED,
                         "larger than max")
        item = wire.put_item(key(50), GOOD[2], bytes(5000))
        expect_rpc_error(lambda: put_raw(node.address, [item]), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
        first = wire.put_item(key(50), GOOD[2], bytes(NODE_PAGE_BYTES))
        expect_rpc_error(lambda: put_raw(node.address, [first, item]), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert_unharmed(node, client, set(GOOD))


class _PutWatcher(KVStoreService):
    """Tells when each PutPages handler has returned, however it ended."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.put_done = threading.Semaphore(0)

    def put_pages(self, request_iterator, context):
        try:
            return super().put_pages(request_iterator, context)
        finally:
            self.put_done.release()


def test_a_put_stream_the_client_abandons_midway_stores_nothing(clock):
    store = PageStore(8, NODE_PAGE_BYTES, clock=clock)
    with serve_node(store, service_cls=_PutWatcher) as node, node.client() as client:
        client.put_pages(GOOD, GOOD_PARENTS, pages(3))
        assert node.service.put_done.acquire(timeout=5)

        def broken_stream():
            yield wire.put_item(key(50), GOOD[2], pages(1)[0])
            raise RuntimeError("client-side failure while streaming")

        channel = raw_channel(node.address)
        try:
            with pytest.raises(grpc.RpcError):
                channel.stream_unary(f"/{SERVICE_NAME}/PutPages", None, None)(broken_stream(), timeout=5)
        finally:
            channel.close()
        assert node.service.put_done.acquire(timeout=5), "the PutPages handler never returned"
        assert_unharmed(node, client, set(GOOD))
