"""Peers the data plane must bound: one that stalls, trickles or leaves mid-request is dropped within its
timeout and holds no pin or bytes; connections and puts over their bounds, or sent as the node stops, are refused."""

from __future__ import annotations

import contextlib
import socket
import time

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, wait_for
from data_plane_helpers import (GOOD, GOOD_PARENTS, MAX_KEYS, assert_unharmed, closed_by_node, pages, put_head,
                                put_request, raw_connection, read_reply)
from base.log_limits import CountedEvent
from kvnode.wire import data_frames as dw
from kvnode.data_plane.server import DataPlaneServer
from store_helpers import key

pytestmark = pytest.mark.usefixtures("no_kvnode_errors_logged")  # a bad peer gets an info line, never an error


@pytest.mark.parametrize("sent", [0, 5, dw.REQUEST.size + 3], ids=["nothing", "short header", "short keys"])
def test_a_client_that_stops_sending_is_dropped_after_the_timeout(seeded, sent):
    # The node's data plane with a timeout of 0.5 s, not the fixture's 2 s: the test waits it out.
    plane = DataPlaneServer(seeded.store, "127.0.0.1", 0, max_keys=MAX_KEYS, max_connections=4, timeout_s=0.5)
    plane.start()
    seeded.service.data_port = plane.port
    try:
        request = dw.get_request(GOOD)
        with raw_connection(plane) as sock:
            sock.sendall(request[:sent])
            with seeded.client() as other:  # meanwhile the node serves others
                np.testing.assert_array_equal(other.get_pages(GOOD), pages(3))
            started = time.monotonic()
            assert closed_by_node(sock)
            assert time.monotonic() - started < plane.timeout_s + 3.0
        assert_unharmed(seeded, plane, set(GOOD))
    finally:
        plane.stop()


def test_a_client_that_disconnects_mid_header_is_dropped(seeded, plane):
    with raw_connection(plane) as sock:
        sock.sendall(dw.get_request(GOOD)[:7])
    assert wait_for(lambda: plane.num_connections() == 0, timeout_s=5.0)
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_client_that_disconnects_mid_reply_leaves_no_pin(make_node):
    page_bytes, n = 256 * 1024, 32  # an 8 MiB reply: more than the sockets buffer, so the node is mid-send
    node = make_node(capacity_pages=n, page_bytes=page_bytes, max_keys=n)
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=n, timeout_s=5.0).start()
    node.service.data_port = server.port
    try:
        keys = [key(i) for i in range(n)]
        with node.client(use_data_plane=False) as c:
            assert c.put_pages(keys, [b""] * n, np.zeros((n, page_bytes), np.uint8)).stored == n
        for _ in range(3):
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
                sock.settimeout(5.0)
                sock.connect(("127.0.0.1", server.port))
                sock.sendall(dw.get_request(keys))
                sock.recv(100)  # a little of the reply, then gone
                assert wait_for(lambda: node.store.num_pinned() == n)  # the node is sending from the pool
        assert wait_for(lambda: server.num_connections() == 0 and node.store.num_pinned() == 0, timeout_s=5.0)
        node.store.check_invariants()
        with node.client() as c:
            assert c.data_plane_address() is not None
            assert c.get_pages(keys).shape == (n, page_bytes)
    finally:
        server.stop()


def test_connections_over_the_bound_get_resource_exhausted(seeded, plane):
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(raw_connection(plane)) for _ in range(plane.max_connections)]
        assert wait_for(lambda: plane.num_connections() == plane.max_connections)
        with raw_connection(plane) as extra:
            code, message, _ = read_reply(extra)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 4" in message
        held[0].sendall(dw.get_request(GOOD[:1]))  # the held ones still serve
        assert read_reply(held[0])[0] == grpc.StatusCode.OK
    assert_unharmed(seeded, plane, set(GOOD))


def test_connections_over_the_bound_are_logged_as_one_line_an_interval_with_their_count(seeded, plane, caplog):
    """A flood of clients over the bound is an operator's one event, not a line per connection."""
    now = [0.0]
    plane._refusals = CountedEvent(clock=lambda: now[0])

    def refusal_lines():
        return [r.getMessage() for r in caplog.records if "since the last such line" in r.getMessage()]

    with contextlib.ExitStack() as stack:
        for _ in range(plane.max_connections):
            stack.enter_context(raw_connection(plane))
        assert wait_for(lambda: plane.num_connections() == plane.max_connections)
        for _ in range(20):
            with raw_connection(plane) as extra:
                assert read_reply(extra)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert wait_for(lambda: len(refusal_lines()) >= 1)
        assert len(refusal_lines()) == 1 and "refused 1 connection(s)" in refusal_lines()[0]
        now[0] += 11.0
        with raw_connection(plane) as extra:
            assert read_reply(extra)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert wait_for(lambda: len(refusal_lines()) == 2)
        assert "refused 20 connection(s)" in refusal_lines()[1] and "4 connections open" in refusal_lines()[1]
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_request_that_comes_as_the_node_stops_is_read_away_and_answered_unavailable(make_node):
    """Refused before its pages were read, a PUT larger than the sockets' buffers could not be
    sent whole: the node closed on it, and the sender met a broken pipe instead of the answer."""
    page_bytes, count = 1 << 20, 16
    node = make_node(capacity_pages=count, page_bytes=page_bytes)
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=count, timeout_s=5.0).start()
    keys = [key(60 + i) for i in range(count)]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            request = put_request(keys, [b""] * count, bytes(count * page_bytes), page_bytes)
            sock.sendall(request[:1])  # the node is reading this request's header now
            time.sleep(0.3)
            server._stopping.set()  # as drain() begins
            sock.sendall(request[1:])  # whole: the node read it away
            code, message, _ = read_reply(sock)
            assert code == grpc.StatusCode.UNAVAILABLE and "stopping" in message
            assert closed_by_node(sock)
        assert not set(keys) & set(node.store.keys())
    finally:
        server.stop()


def test_a_reader_that_trickles_is_dropped_within_the_timeout_and_leaves_no_pin(make_node):
    """Reading a few bytes at a time never lets a single send time out; the whole reply's
    deadline still ends it, so its pages are not pinned (unevictable) for long."""
    page_bytes, count = 1 << 20, 16
    node = make_node(capacity_pages=count, page_bytes=page_bytes)
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=count, timeout_s=0.5).start()
    keys = [key(i) for i in range(count)]
    try:
        parents, data = [b"", *keys[:-1]], np.zeros((count, page_bytes), np.uint8)
        with node.client(use_data_plane=False) as grpc_client:
            for first in range(0, count, MAX_KEYS):  # the gRPC service's key limit
                part = slice(first, first + MAX_KEYS)
                assert grpc_client.put_pages(keys[part], parents[part], data[part]).stored == MAX_KEYS
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(2.0)
        try:
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(dw.get_request(keys))
            started, pinned_seen, released_after = time.monotonic(), False, None
            while released_after is None and time.monotonic() - started < 5.0:  # 16 MiB at ~200 KB/s: 80 s
                pinned = node.store.num_pinned()
                pinned_seen |= pinned > 0
                if pinned_seen and pinned == 0:
                    released_after = time.monotonic() - started
                with contextlib.suppress(ConnectionResetError, socket.timeout):
                    sock.recv(1024)
                time.sleep(0.005)
        finally:
            sock.close()
        assert pinned_seen, "the reply never started"
        assert released_after is not None and released_after < 3.0, "the pages stayed pinned for the trickling reader"
        assert wait_for(lambda: server.num_connections() == 0, timeout_s=2.0)
        node.store.check_invariants()
    finally:
        server.stop()


def test_puts_beyond_the_bytes_in_flight_are_refused_and_store_nothing(make_node, caplog):
    """While one peer's put is still arriving (it holds its bytes reserved), another put that would
    exceed the bound is refused (NodeClient then stores over gRPC); alone, a put larger than the
    bound is taken."""
    node = make_node()
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=MAX_KEYS,
                             max_put_bytes_in_flight=2 * NODE_PAGE_BYTES).start()
    node.service.data_port = server.port
    try:
        with raw_connection(server) as stalled:
            stalled.sendall(put_head([key(50)], [b""]))  # its page never comes
            assert wait_for(lambda: server.put_bytes_in_flight() == NODE_PAGE_BYTES, timeout_s=5.0)
            with raw_connection(server) as second:
                second.sendall(put_head(GOOD[:2], GOOD_PARENTS[:2]))
                code, message, _ = read_reply(second)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in message
            assert node.store.keys() == []
            with node.client() as client:
                assert client.put_pages(GOOD[:2], GOOD_PARENTS[:2], pages(2)).stored == 2  # over gRPC
        assert wait_for(lambda: server.put_bytes_in_flight() == 0, timeout_s=5.0)  # the stalled peer left
        assert set(node.store.keys()) == set(GOOD[:2])
        with node.client() as client:
            assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).outcomes == (
                "already_present", "already_present", "stored")  # 3 pages > the bound, alone, on the data plane
        busy = [r for r in caplog.records if "data plane busy" in r.getMessage()]
        assert len(busy) == 1, "only the put that met the stalled one went over gRPC"
        node.store.check_invariants()
    finally:
        server.stop()


def test_a_put_that_trickles_is_dropped_within_the_timeout_and_frees_its_bytes_in_flight(make_node, caplog):
    """A byte every 0.3 s never lets one recv time out (timeout_s 0.5); the request's own deadline
    ends it, with an info line, and the bytes it reserved go back, so other puts are taken."""
    node = make_node()
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=MAX_KEYS, timeout_s=0.5,
                             max_put_bytes_in_flight=2 * NODE_PAGE_BYTES).start()
    try:
        with raw_connection(server) as trickler:
            trickler.sendall(put_head(GOOD[:2], GOOD_PARENTS[:2]))
            started, dropped_after = time.monotonic(), None
            while dropped_after is None and time.monotonic() - started < 4.0:
                time.sleep(0.3)
                try:
                    trickler.sendall(b"\0")
                except OSError:
                    dropped_after = time.monotonic() - started
                if server.put_bytes_in_flight() == 0 and server.num_connections() == 0:
                    dropped_after = time.monotonic() - started
            assert dropped_after is not None and dropped_after < 2.0, "the trickling put held its bytes in flight"
        with raw_connection(server) as other:
            other.sendall(put_head([key(60)], [b""], data=pages(1).tobytes()) + pages(1).tobytes())
            code, message, outcomes = read_reply(other)
        assert code == grpc.StatusCode.OK and len(outcomes) == 1, message
        assert any("within 0.5 s" in r.getMessage() for r in caplog.records if r.levelname == "INFO")
        node.store.check_invariants()
    finally:
        server.stop()
