"""The kvnode's data plane (kvnode/data_plane/server.py) at the byte level: raw requests are answered as
framed, and bad input gets its status and leaves the node unharmed. NodeClient: test_data_plane_client.py."""

from __future__ import annotations

import socket

import grpc
import pytest

from cluster_helpers import NODE_PAGE_BYTES, wait_for
from data_plane_helpers import (GOOD, INVALID, MAX_KEYS, assert_unharmed, closed_by_node, expect_refusal, pages,
                                put_head, put_request, raw_connection, read_reply)
from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import page_checksum
from kvnode.data_plane.server import DataPlaneServer
from store_helpers import key

pytestmark = pytest.mark.usefixtures("no_kvnode_errors_logged")  # a bad peer gets an info line, never an error


# ---- raw requests -------------------------------------------------------------------


def test_a_raw_get_answers_ok_then_the_checksums_then_the_pages_back_to_back(seeded, plane):
    sums = b"".join(page_checksum(k, row) for k, row in zip(GOOD[1:], pages(3)[1:]))
    with raw_connection(plane) as sock:
        for _ in range(2):  # one connection, several requests
            sock.sendall(dw.get_request(GOOD[1:]))
            code, message, payload = read_reply(sock)
            assert (code, message) == (grpc.StatusCode.OK, "")
            assert payload == sums + pages(3)[1:].tobytes()


def test_a_version_1_peer_gets_pages_alone_and_its_puts_get_checksums_from_the_node(seeded, plane):
    with raw_connection(plane) as sock:
        sock.sendall(dw.request_header(dw.OP_GET, 2, version=1) + b"".join(GOOD[1:]))
        code, _, payload = read_reply(sock)
        assert code == grpc.StatusCode.OK and payload == pages(3)[1:].tobytes()
        data = pages(1, 5).tobytes()
        entry = key(10) + dw.PARENT_LEN.pack(16) + GOOD[2]
        sock.sendall(dw.request_header(dw.OP_PUT, 1, page_bytes=NODE_PAGE_BYTES, version=1) + entry + data)
        code, _, outcomes = read_reply(sock)
    assert code == grpc.StatusCode.OK and list(outcomes) == [1]
    assert seeded.store.checksums([key(10)]) == [page_checksum(key(10), data)]
    assert_unharmed(seeded, plane, {*GOOD, key(10)})


def test_a_put_keeps_each_pages_checksum_as_sent(seeded, plane):
    data = pages(2, 5).tobytes()
    with raw_connection(plane) as sock:
        sock.sendall(put_request([key(10), key(11)], [GOOD[2], key(10)], data))
        code, _, outcomes = read_reply(sock)
    assert code == grpc.StatusCode.OK and list(outcomes) == [1, 1]
    assert seeded.store.checksums([key(10), key(11)]) == [
        page_checksum(key(10), data[:NODE_PAGE_BYTES]), page_checksum(key(11), data[NODE_PAGE_BYTES:])]


def test_a_raw_put_answers_one_outcome_per_page(seeded, plane):
    new = [key(10), key(11), key(12)]
    request = put_request([GOOD[0], new[0], new[1], new[2]], [b"", GOOD[2], key(99), b""],
                          pages(4, 5).tobytes())
    with raw_connection(plane) as sock:
        sock.sendall(request)
        code, _, outcomes = read_reply(sock)
    assert code == grpc.StatusCode.OK
    assert list(outcomes) == [2, 1, 3, 1]  # already present, stored, refused: no parent, stored
    assert_unharmed(seeded, plane, {*GOOD, new[0], new[2]})


# ---- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes, fragment",
    [
        (dw.request_header(dw.OP_GET, 1, magic=b"GET ") + GOOD[0], "magic"),
        (dw.request_header(dw.OP_GET, 1, version=9) + GOOD[0], "version 9"),
        (dw.request_header(9, 1) + GOOD[0], "unknown data plane op 9"),
        (dw.request_header(dw.OP_GET, 1, key_bytes=15) + GOOD[0][:15], "keys must be 16 bytes"),
        (dw.request_header(dw.OP_PUT, 1, key_bytes=32, page_bytes=NODE_PAGE_BYTES), "keys must be 16 bytes"),
        (dw.request_header(dw.OP_GET, MAX_KEYS + 1) + GOOD[0] * (MAX_KEYS + 1), f"at most {MAX_KEYS}"),
        (dw.request_header(dw.OP_GET, 0), "at least one key"),
        (dw.request_header(dw.OP_PUT, 0, page_bytes=NODE_PAGE_BYTES), "at least one key"),
    ],
    ids=["magic", "version", "op", "short key", "long key", "too many keys", "no keys", "empty put"],
)
def test_a_bad_header_is_invalid_argument_and_changes_nothing(seeded, plane, request_bytes, fragment):
    expect_refusal(plane, request_bytes, INVALID, fragment)
    assert_unharmed(seeded, plane, set(GOOD))


def test_an_unknown_key_is_not_found_naming_it_and_nothing_is_sent(seeded, plane):
    missing = key(77)
    sent_before = seeded.store.stats.get_pages
    expect_refusal(plane, dw.get_request([GOOD[0], missing]), grpc.StatusCode.NOT_FOUND, missing.hex(), "not cached")
    assert seeded.store.stats.get_pages == sent_before
    assert_unharmed(seeded, plane, set(GOOD))


@pytest.mark.parametrize("page_bytes", [NODE_PAGE_BYTES - 1, NODE_PAGE_BYTES * 2])
def test_a_put_of_the_wrong_page_size_stores_nothing(seeded, plane, page_bytes):
    request = put_request([key(10)], [b""], bytes(page_bytes), page_bytes=page_bytes)
    expect_refusal(plane, request, INVALID, f"pages of {page_bytes} bytes", f"stores pages of {NODE_PAGE_BYTES}")
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_put_with_a_bad_parent_stores_none_of_its_pages(seeded, plane):
    head = bytearray(put_head([key(10), key(11)], [b"", key(10)]))
    head[dw.REQUEST.size + dw.put_entry_bytes(16) + 16] = 7  # second page's parent_len
    expect_refusal(plane, bytes(head) + pages(2).tobytes(), INVALID, "parent key must be 16 bytes")
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_put_of_a_page_naming_itself_stores_none_of_its_pages(seeded, plane):
    request = put_request([key(10), key(11)], [b"", key(11)], pages(2).tobytes())
    expect_refusal(plane, request, INVALID, "names itself as its parent", "nothing stored")
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_truncated_put_stores_nothing(seeded, plane):
    request = put_request([key(10), key(11)], [b"", key(10)], pages(2).tobytes())
    with raw_connection(plane) as sock:
        sock.sendall(request[: len(request) - NODE_PAGE_BYTES // 2])
        sock.shutdown(socket.SHUT_WR)
        assert closed_by_node(sock)  # dropped without an answer: the request never completed
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_page_dropped_while_pinned_for_a_get_is_not_found_and_leaves_no_pin(make_node):
    """A reader's report may drop a page between the GET's pin and its checksums (the page leaves
    the index at once, its slots waiting for the unpin): NOT_FOUND as for any missing page, not a traceback."""
    node = make_node()
    store, parent, child = node.store, key(70), key(71)
    store.put(parent, b"", bytes(NODE_PAGE_BYTES), checksum=bytes(16))  # a checksum its bytes fail
    store.put(child, parent, bytes(NODE_PAGE_BYTES))
    pin = store.pin_pages

    def pin_then_report(keys):
        views = pin(keys)
        assert store.drop_reported(parent) == 2  # the parent and the child being sent
        return views

    store.pin_pages = pin_then_report
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=MAX_KEYS, timeout_s=5.0).start()
    try:
        expect_refusal(server, dw.get_request([child]), grpc.StatusCode.NOT_FOUND, child.hex())
        assert wait_for(lambda: store.num_pinned() == 0 and server.num_connections() == 0, timeout_s=5.0)
        store.check_invariants()
    finally:
        server.stop()
