"""Memory the data plane holds between requests (kvnode/data_plane/recv_buffers.py): a connection keeps a
small PUT buffer for reuse, drops a large one after its request, and all connections together
keep at most a bound; a closed connection gives its buffer back."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from cluster_helpers import NODE_PAGE_BYTES, wait_for
from data_plane_helpers import pages, put_head, raw_connection
from kvnode.wire import data_frames as dw
from kvnode.data_plane.server import DataPlaneServer
from kvnode.data_plane.recv_buffers import BufferBudget, ReceiveBuffer
from kvnode.store.page_store import PutOutcome
from store_helpers import key

pytestmark = pytest.mark.usefixtures("no_kvnode_errors_logged")

PER_CONNECTION, TOTAL = 2 * NODE_PAGE_BYTES, 3 * NODE_PAGE_BYTES


@pytest.fixture
def small_plane(make_node):
    node = make_node(capacity_pages=64, max_keys=16)
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=16, timeout_s=5.0,
                             keep_buffer_bytes=PER_CONNECTION, max_kept_buffer_bytes=TOTAL).start()
    try:
        yield server
    finally:
        server.stop()


def put(sock, first: int, n: int) -> None:
    """PUT n root pages over a raw connection and check they were stored."""
    keys = [key(first + i) for i in range(n)]
    data = pages(n, first).tobytes()
    sock.sendall(put_head(keys, [b""] * n, data=data) + data)
    head = b""
    while len(head) < dw.REPLY.size:
        head += sock.recv(dw.REPLY.size - len(head))
    code, _, payload = dw.parse_reply_header(head)
    assert code == grpc.StatusCode.OK and payload == n
    assert sock.recv(n) == bytes([PutOutcome.STORED] * n)


def test_a_large_put_buffer_is_not_kept_and_the_total_kept_is_bounded(small_plane):
    with contextlib.ExitStack() as stack:
        a, b, c = (stack.enter_context(raw_connection(small_plane)) for _ in range(3))
        put(a, 100, 1)
        assert small_plane.kept_buffer_bytes() == NODE_PAGE_BYTES  # page-sized: kept for reuse
        put(a, 110, 8)
        assert small_plane.kept_buffer_bytes() == NODE_PAGE_BYTES  # 8 pages: served, then dropped
        put(a, 120, 1)
        put(b, 200, 2)
        assert small_plane.kept_buffer_bytes() == 3 * NODE_PAGE_BYTES  # a's page and b's two
        put(c, 300, 1)
        assert small_plane.kept_buffer_bytes() == TOTAL  # c's would pass the total: not kept
        for n in range(5):  # every connection keeps serving either way
            put((a, b, c)[n % 3], 400 + 10 * n, 1 + n % 3)
        assert small_plane.kept_buffer_bytes() <= TOTAL
        a.close()
        assert wait_for(lambda: small_plane.kept_buffer_bytes() <= TOTAL - NODE_PAGE_BYTES, timeout_s=5.0)
    assert wait_for(lambda: small_plane.kept_buffer_bytes() == 0, timeout_s=5.0)


def test_a_receive_buffer_reuses_its_kept_memory():
    budget = BufferBudget(keep_per_connection=100, keep_total=150)
    first, second = ReceiveBuffer(budget), ReceiveBuffer(budget)
    view = first.view(80)
    view[:3] = b"abc"
    assert bytes(first.view(50)[:3]) == b"abc"  # the same memory, reused
    assert budget.kept_bytes() == 80
    second.view(100)
    assert (second.kept_bytes(), budget.kept_bytes()) == (0, 80)  # 180 would pass the total
    second.view(60)
    assert budget.kept_bytes() == 140
    first.view(101)  # over the per-connection bound: served, the kept 80 stays
    assert first.kept_bytes() == 80
    first.close()
    second.close()
    assert budget.kept_bytes() == 0
