"""What the data plane tests share: keys and pages, a raw connection, and the check that a bad
peer left the node unharmed. Their fixtures (plane, seeded, no_kvnode_errors_logged) are in
conftest.py."""

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
