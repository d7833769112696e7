"""NodeClient over the data plane: pages equal those through gRPC byte for byte, errors keep
the node's status, pooled connections survive the node closing them, an unreachable data
plane falls back to gRPC, and a fetch's batches share one round trip, each checked against its
checksums before it lands."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, wait_for
from data_plane_helpers import GOOD, GOOD_PARENTS, INVALID, MAX_KEYS, assert_unharmed, pages, raw_connection
from kvnode.client import node_client
from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import page_checksum
from kvnode.client import NodeError, PageRejected
from kvnode.client.data_client import DataPlaneClient
from kvnode.data_plane.server import DataPlaneServer
from store_helpers import key
from test_node_checksums import flip_byte_in_pool

pytestmark = pytest.mark.usefixtures("no_kvnode_errors_logged")  # a bad peer gets an info line, never an error


# ---- through NodeClient -------------------------------------------------------------


def test_with_every_data_connection_taken_calls_go_over_grpc(seeded, plane, caplog):
    with contextlib.ExitStack() as stack:
        for _ in range(plane.max_connections):
            stack.enter_context(raw_connection(plane))
        assert wait_for(lambda: plane.num_connections() == plane.max_connections)
        with seeded.client() as c:
            for _ in range(2):
                assert c.get_pages(GOOD).tobytes() == pages(3).tobytes()
            other = [key(30), key(31)]
            assert c.put_pages(other, [b"", other[0]], pages(2, 9)).stored == 2
            assert c.data_plane_address() == f"127.0.0.1:{plane.port}", "still the data plane's client"
    busy = [r.getMessage() for r in caplog.records if "data plane busy" in r.getMessage()]
    assert len(busy) == 1 and "go over gRPC" in busy[0]
    with seeded.client(use_data_plane=False) as slow:
        assert slow.get_pages(other).tobytes() == pages(2, 9).tobytes()


def test_pages_through_the_data_plane_equal_pages_through_grpc(node, plane):
    data = pages(3, 4)
    with node.client() as fast, node.client(use_data_plane=False) as slow:
        assert fast.data_plane_address() == f"127.0.0.1:{plane.port}"
        assert slow.data_plane_address() is None
        assert fast.put_pages(GOOD, GOOD_PARENTS, data).outcomes == ("stored",) * 3
        assert slow.put_pages(GOOD, GOOD_PARENTS, data).outcomes == ("already_present",) * 3
        other = [key(20), key(21)]
        assert slow.put_pages(other, [b"", other[0]], pages(2, 6)).stored == 2
        for keys, expected in ((GOOD, data), (other, pages(2, 6)), (GOOD[1:] + other[:1], np.vstack([data[1:], pages(2, 6)[:1]]))):
            via_plane, via_grpc = fast.get_pages(keys), slow.get_pages(keys)
            assert via_plane.tobytes() == via_grpc.tobytes() == expected.tobytes()
        out = np.empty((3, NODE_PAGE_BYTES), np.uint8)
        assert fast.get_pages(GOOD, out=out) is out and out.tobytes() == data.tobytes()
        stats = fast.stats()
    assert stats["puts"] == 8 and stats["stored_pages"] == 5
    assert stats["get_pages"] == 2 * (3 + 2 + 3) + 3 and stats["bytes_out"] == stats["get_pages"] * NODE_PAGE_BYTES
    node.store.check_invariants()


def test_client_errors_keep_the_nodes_status(seeded, plane):
    with seeded.client() as client:
        missing = key(77)
        with pytest.raises(NodeError) as raised:
            client.get_pages([GOOD[0], missing])
        assert raised.value.code == grpc.StatusCode.NOT_FOUND and missing.hex() in raised.value.details
        with pytest.raises(NodeError) as raised:
            client.get_pages([key(100 + i) for i in range(MAX_KEYS + 1)])
        assert raised.value.code == INVALID and f"at most {MAX_KEYS}" in raised.value.details
        with pytest.raises(NodeError) as raised:
            client.put_pages([key(10)], [b""], [bytes(NODE_PAGE_BYTES + 1)])
        assert raised.value.code == INVALID and f"pages of {NODE_PAGE_BYTES} bytes" in raised.value.details
        with pytest.raises(NodeError) as raised:
            client.get_pages([b"short"])
        assert raised.value.code == INVALID and "16 bytes" in raised.value.details
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))  # after errors, on a new connection
        assert client.get_pages([]).shape == (0, NODE_PAGE_BYTES)  # nothing asked, nothing sent
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_node_that_does_not_answer_is_deadline_exceeded(seeded, plane):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (in the kernel) and never answers
    try:
        seeded.service.data_port = silent.getsockname()[1]
        with seeded.client() as client:
            started = time.monotonic()
            with pytest.raises(NodeError) as raised:
                client.get_pages(GOOD, timeout=0.3)
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 2.0
    finally:
        silent.close()


def test_an_unreachable_data_plane_falls_back_to_grpc_with_one_log_line(seeded, plane, caplog):
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    seeded.service.data_port = closed_port
    with caplog.at_level(logging.WARNING, logger="kvnode.client"), seeded.client() as client:
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
        assert client.put_pages([key(10)], [b""], pages(1, 3)).stored == 1
        np.testing.assert_array_equal(client.get_pages([key(10)]), pages(1, 3))
        assert client.data_plane_address() is None
    lines = [r.getMessage() for r in caplog.records if "data plane" in r.getMessage()]
    assert len(lines) == 1 and "using gRPC" in lines[0] and str(closed_port) in lines[0]
    seeded.store.check_invariants()


def test_a_data_plane_never_reached_is_tried_again_later_and_used_once_it_answers(seeded, plane, monkeypatch, caplog):
    """A node met while it restarted, say: its Info named a data port nobody listened on. Given
    up for good, the client stayed on gRPC for its whole life."""
    monkeypatch.setattr(node_client, "DATA_PLANE_RETRY_S", 0.3)
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    seeded.service.data_port = closed_port
    with caplog.at_level(logging.WARNING, logger="kvnode.client"), seeded.client() as client:
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))  # over gRPC
        assert client.data_plane_address() is None
        seeded.service.data_port = plane.port  # back, on the port its new Info gives
        time.sleep(0.4)
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
        assert client.data_plane_address() == f"127.0.0.1:{plane.port}"
    lines = [r.getMessage() for r in caplog.records if "data plane" in r.getMessage()]
    assert len(lines) == 1 and "trying it again in 0.3s" in lines[0]


def test_a_data_plane_that_goes_away_after_serving_is_unavailable_not_a_silent_fallback(seeded, plane):
    with seeded.client() as client:
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
        plane.stop()
        with pytest.raises(NodeError) as raised:
            client.get_pages(GOOD)
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_pooled_connection_the_node_closed_while_idle_is_replaced_transparently(make_node):
    node = make_node()
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=MAX_KEYS, timeout_s=0.3).start()
    node.service.data_port = server.port
    try:
        with node.client() as client:
            assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
            assert wait_for(lambda: server.num_connections() == 0, timeout_s=5.0)  # the node closed it
            np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
            assert client.data_plane_address() is not None
    finally:
        server.stop()


def test_one_client_serves_several_threads_at_once(seeded, plane):
    errors, rounds = [], 20

    def fetch(client):
        try:
            for _ in range(rounds):
                assert client.get_pages(GOOD).tobytes() == pages(3).tobytes()
        except Exception as exc:  # reported below
            errors.append(exc)

    with seeded.client() as client:
        threads = [threading.Thread(target=fetch, args=(client,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert seeded.store.stats.get_pages >= 4 * rounds * 3
    assert_unharmed(seeded, plane, set(GOOD))


def test_when_every_pooled_connection_went_stale_the_call_still_succeeds(make_node):
    """After an idle spell the node has closed all of a client's pooled connections, not one:
    the retry must open a new connection, not take the next stale one."""
    node = make_node()
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=MAX_KEYS, timeout_s=0.3).start()
    try:
        with node.client(use_data_plane=False) as grpc_client:
            assert grpc_client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        plane_client = DataPlaneClient("127.0.0.1", server.port)
        deadline = time.monotonic() + 5.0
        opened = [plane_client.take_connection(deadline)[0] for _ in range(3)]  # as three threads' calls would leave them
        for sock in opened:
            plane_client.give_back(sock)
        assert wait_for(lambda: server.num_connections() == 0, timeout_s=5.0)  # the node closed all three
        out = np.empty((3, NODE_PAGE_BYTES), dtype=np.uint8)
        plane_client.get_into(GOOD, memoryview(out).cast("B"), memoryview(bytearray(3 * 16)), timeout_s=5.0)
        np.testing.assert_array_equal(out, pages(3))
        plane_client.close()
    finally:
        server.stop()


def test_a_grpc_fallback_gets_only_what_is_left_of_the_calls_timeout(seeded, plane, monkeypatch):
    """A connect that fails slowly (a host that drops packets) used up part of the timeout: the
    gRPC fallback gets the rest, and none at all when nothing is left."""
    from kvnode.client.data_client_io import DataPlaneError

    def slow_connect_failure(*args):
        time.sleep(0.4)
        raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, "connect timed out", connect_failed=True)

    monkeypatch.setattr(DataPlaneClient, "get_into", slow_connect_failure)
    monkeypatch.setattr(DataPlaneClient, "put", slow_connect_failure)
    for call in ("get", "put"):
        with seeded.client() as client:
            stub = "_get_pages" if call == "get" else "_put_pages"
            given = []
            grpc_call = getattr(client, stub)

            def recorded(request, timeout):
                given.append(timeout)
                return grpc_call(request, timeout=timeout)

            setattr(client, stub, recorded)
            if call == "get":
                np.testing.assert_array_equal(client.get_pages(GOOD, timeout=1.0), pages(3))
            else:
                assert client.put_pages([key(40)], [b""], pages(1, 5), timeout=1.0).stored == 1
            assert len(given) == 1 and 0 < given[0] <= 0.6, given
        with seeded.client() as client:
            setattr(client, stub, lambda request, timeout: pytest.fail("gRPC called with no time left"))
            with pytest.raises(NodeError) as raised:
                if call == "get":
                    client.get_pages(GOOD, timeout=0.3)
                else:
                    client.put_pages([key(41)], [b""], pages(1, 6), timeout=0.3)
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_new_connection_reset_before_any_reply_falls_back_to_grpc_for_that_call(seeded, plane, caplog):
    """A node at its connection limit answers RESOURCE_EXHAUSTED and closes; when it closes before
    reading the request, the kernel resets the connection and the answer is lost. The call then
    goes over gRPC (a node that is down would fail there too) instead of failing."""
    resetter = socket.create_server(("127.0.0.1", 0))
    resetter.settimeout(5.0)
    resets = []

    def accept_and_reset():
        for _ in range(4):  # bounded: one per data plane try below
            try:
                conn, _ = resetter.accept()
            except OSError:
                return
            conn.settimeout(5.0)
            conn.recv(1, socket.MSG_PEEK)  # the request has arrived, unread
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # unread data: the kernel sends a reset
            resets.append(1)

    thread = threading.Thread(target=accept_and_reset, daemon=True)
    thread.start()
    try:
        seeded.service.data_port = resetter.getsockname()[1]
        with caplog.at_level(logging.INFO, logger="kvnode.client"), seeded.client() as client:
            np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
            assert client.put_pages([key(50)], [b""], pages(1, 7)).stored == 1
            assert client.data_plane_address() == f"127.0.0.1:{resetter.getsockname()[1]}", "tried again next call"
        assert len(resets) == 2
        lines = [r.getMessage() for r in caplog.records if "go over gRPC" in r.getMessage()]
        assert len(lines) == 1
        seeded.store.check_invariants()
    finally:
        resetter.shutdown(socket.SHUT_RDWR)  # wakes the accept() waiting for a third try that does not come
        resetter.close()
        thread.join(10.0)


# ---- several batches in one round trip ------------------------------------------------


def batches_into(client, batches, timeout=5.0):
    """get_pages_in_batches into fresh arrays; (the arrays, the order batches landed in)."""
    outs = [np.empty((len(keys), NODE_PAGE_BYTES), np.uint8) for keys in batches]
    landed = []
    client.get_pages_in_batches(batches, lambda i: outs[i], landed.append, timeout=timeout)
    return outs, landed


@pytest.mark.parametrize("use_data_plane", [True, False])
def test_batches_land_in_order_with_the_pages_get_pages_gives(seeded, plane, use_data_plane):
    batches = [GOOD[:2], GOOD[2:], GOOD[1:]]
    with seeded.client(use_data_plane=use_data_plane) as client:
        outs, landed = batches_into(client, batches)
        assert landed == [0, 1, 2]
        for keys, out in zip(batches, outs):
            assert out.tobytes() == client.get_pages(keys).tobytes()
        assert (client.data_plane_address() is not None) == use_data_plane


def test_a_missing_page_fails_its_batch_and_the_batches_before_it_stay(seeded, plane):
    outs = [np.zeros((1, NODE_PAGE_BYTES), np.uint8) for _ in range(3)]
    landed = []
    with seeded.client() as client:
        with pytest.raises(NodeError) as failed:
            client.get_pages_in_batches([GOOD[:1], [key(99)], GOOD[1:2]], lambda i: outs[i], landed.append,
                                        timeout=5.0)
        assert failed.value.code == grpc.StatusCode.NOT_FOUND
        assert landed == [0] and outs[0].tobytes() == pages(1).tobytes()
        assert client.get_pages(GOOD).tobytes() == pages(3).tobytes()  # the client goes on
    assert_unharmed(seeded, plane, set(GOOD))


@pytest.mark.parametrize("use_data_plane", [True, False], ids=["data plane", "gRPC"])
def test_an_altered_page_stops_the_batches_at_it_numbered_from_the_first_batch(seeded, plane, use_data_plane):
    flip_byte_in_pool(seeded, GOOD[2])
    batches = [GOOD[:1], GOOD[1:], GOOD[:1]]  # the altered page is the second of batch 1, page 2 of the fetch
    outs = [np.zeros((len(keys), NODE_PAGE_BYTES), np.uint8) for keys in batches]
    landed = []
    with seeded.client(use_data_plane=use_data_plane) as client:
        with pytest.raises(PageRejected) as rejected:
            client.get_pages_in_batches(batches, lambda i: outs[i], landed.append, timeout=5.0)
        assert (rejected.value.index, rejected.value.key) == (2, GOOD[2])
        assert landed == [0]  # checked before it lands: its batch never does, nor those after it
        assert outs[0].tobytes() == pages(1).tobytes()
        assert outs[1][0].tobytes() == pages(3)[1].tobytes()  # the page before it in its batch is intact
        assert not outs[2].any()  # nothing read after the rejection
        for _ in range(2):  # the replies left unread went with their connection: none is read as the next's
            assert client.get_pages(GOOD[:2]).tobytes() == pages(2).tobytes()
            outs, landed = batches_into(client, [GOOD[:1], GOOD[1:2]])
            assert landed == [0, 1] and np.vstack(outs).tobytes() == pages(2).tobytes()
        assert (client.data_plane_address() is not None) == use_data_plane
    assert wait_for(lambda: seeded.store.num_pinned() == 0, timeout_s=5.0)


class RepliesOnceAllAsked:
    """A data plane that reads GET requests until it has `count` of them, then answers them all
    (each page's checksum, then the pages, as version 2 does): a client that waited for each reply
    before asking the next would wait forever."""

    def __init__(self, count: int, page: bytes):
        self.count, self.page = count, page
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.asked: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(5.0)
            with conn.makefile("rb") as stream:
                for _ in range(self.count):
                    header = dw.parse_request_header(stream.read(dw.REQUEST.size))
                    assert header.version == dw.VERSION, "clients speak the current version"
                    block = stream.read(header.count * header.key_bytes)
                    self.asked.append([block[i : i + header.key_bytes] for i in range(0, len(block), header.key_bytes)])
            for keys in self.asked:
                sums = b"".join(page_checksum(k, self.page) for k in keys)
                conn.sendall(dw.ok_reply(len(sums) + len(keys) * len(self.page)) + sums + self.page * len(keys))

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=5.0)


def test_every_batch_is_asked_before_the_first_reply_is_read():
    page = bytes(range(256)) * 4
    server = RepliesOnceAllAsked(3, page)
    try:
        plane = DataPlaneClient("127.0.0.1", server.port)
        batches = [[key(i) for i in range(n)] for n in (2, 1, 3)]
        outs = [memoryview(bytearray(len(keys) * len(page))) for keys in batches]
        sums = [memoryview(bytearray(len(keys) * 16)) for keys in batches]
        landed = []
        plane.get_batches(batches, lambda i: (outs[i], sums[i]), landed.append, timeout_s=5.0)
        assert server.asked == batches and landed == [0, 1, 2]
        assert [bytes(out) for out in outs] == [page * 2, page, page * 3]
        assert [bytes(s) for s in sums] == [b"".join(page_checksum(k, page) for k in keys) for keys in batches]
        plane.close()
    finally:
        server.close()
