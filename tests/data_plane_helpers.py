"""What the data plane tests share: keys and pages, raw requests and their replies, and the check
that a bad peer left the node unharmed. Their fixtures (plane, seeded, no_kvnode_errors_logged) are
in conftest.py."""

from __future__ import annotations

import contextlib
import socket

import grpc
import numpy as np

from cluster_helpers import NODE_PAGE_BYTES, wait_for
from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import page_checksum
from store_helpers import key

MAX_KEYS = 8
GOOD = [key(i) for i in range(3)]
GOOD_PARENTS = [b"", GOOD[0], GOOD[1]]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@contextlib.contextmanager
def raw_connection(plane):
    """A plain TCP connection to the data plane, closed on the way out."""
    sock = socket.create_connection(("127.0.0.1", plane.port), timeout=5.0)
    try:
        yield sock
    finally:
        sock.close()


def pages(n: int, first: int = 1) -> np.ndarray:
    rng = np.random.default_rng(first)
    return rng.integers(0, 256, size=(n, NODE_PAGE_BYTES), dtype=np.uint8)


def assert_unharmed(node, plane, stored: set[bytes]) -> None:
    """Invariants hold, exactly `stored` is cached, nothing stays pinned, and a data plane round trip works."""
    assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=5.0)
    node.store.check_invariants()
    assert set(node.store.keys()) == stored
    with node.client() as client:
        assert client.data_plane_address() == f"127.0.0.1:{plane.port}"
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
        probe = key(1000)
        assert client.put_pages([probe], [b""], pages(1, 9)).stored == 1
        np.testing.assert_array_equal(client.get_pages([probe]), pages(1, 9))
    node.store.check_invariants()


def put_head(keys, parents, page_bytes: int = NODE_PAGE_BYTES, data: bytes = b"") -> bytes:
    """A PUT's head with each page's true checksum (zeros when its bytes are not given)."""
    rows = [data[i * page_bytes : (i + 1) * page_bytes] for i in range(len(keys))] if data else []
    sums = [page_checksum(k, row) for k, row in zip(keys, rows)] if rows else [bytes(16)] * len(keys)
    return dw.put_request_head(keys, parents, sums, page_bytes)


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def read_reply(sock: socket.socket) -> tuple[grpc.StatusCode, str, bytes]:
    code, message_bytes, payload = dw.parse_reply_header(read_exactly(sock, dw.REPLY.size))
    message = read_exactly(sock, message_bytes).decode("utf-8")
    return code, message, read_exactly(sock, payload)


def closed_by_node(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def expect_refusal(plane, request: bytes, code: grpc.StatusCode, *fragments: str) -> str:
    with raw_connection(plane) as sock:
        sock.sendall(request)
        got, message, payload = read_reply(sock)
        assert got == code, message
        assert payload == b""
        for fragment in fragments:
            assert fragment in message, message
        assert closed_by_node(sock)
        return message


def put_request(keys, parents, data: bytes, page_bytes: int = NODE_PAGE_BYTES) -> bytes:
    return put_head(keys, parents, page_bytes, data) + data
