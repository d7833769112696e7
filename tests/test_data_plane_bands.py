"""GET_BANDS, the data plane's banded GET (issue 19): the pages' bytes equal a plain GET's for
band sizes that divide the page and for a short last band, arrive band-major with a call after
each band, travel as well over TLS, a bad band size is refused by name, an altered page is
rejected once its last band landed, and a node that predates the op is served plain GETs."""

from __future__ import annotations

import socket
import threading

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES
from data_plane_helpers import GOOD, INVALID, assert_unharmed, pages, raw_connection
from base import security
from kvnode.wire import data_frames as dw
from kvnode.client import NodeError, PageRejected
from kvnode.client.data_client import DataPlaneClient
from kvnode.client.data_client_io import DataPlaneError
from kvnode.data_plane.server import DataPlaneServer
from test_node_checksums import flip_byte_in_pool

pytestmark = pytest.mark.usefixtures("no_kvnode_errors_logged")


def fetch_in_bands(client, keys, band_bytes):
    """(pages, bands landed in order, the prefix of every page seen intact at each landing)."""
    outs = [np.zeros(NODE_PAGE_BYTES, np.uint8) for _ in keys]
    expected = pages(3)[[GOOD.index(k) for k in keys]]
    landed, intact = [], []

    def on_band(band):
        end = min((band + 1) * band_bytes, NODE_PAGE_BYTES)
        landed.append(band)
        intact.append(all(np.array_equal(out[:end], row[:end]) for out, row in zip(outs, expected)))

    client.get_pages_in_bands(keys, outs, band_bytes, on_band, timeout=5)
    return np.stack(outs), landed, intact


@pytest.mark.parametrize("band_bytes", [NODE_PAGE_BYTES // 4, NODE_PAGE_BYTES // 16, 1000, 333, NODE_PAGE_BYTES, 1])
def test_banded_pages_equal_a_plain_get_with_a_call_after_each_band(seeded, plane, band_bytes):
    bands = -(-NODE_PAGE_BYTES // band_bytes)
    with seeded.client() as client:
        for keys in (GOOD, GOOD[2:] + GOOD[:1]):
            got, landed, intact = fetch_in_bands(client, keys, band_bytes)
            assert got.tobytes() == client.get_pages(keys).tobytes()
            assert landed == list(range(bands)) and all(intact)
        assert client.data_plane_address() is not None and client.use_data_plane
    assert_unharmed(seeded, plane, set(GOOD))


def test_the_reply_is_band_major_after_the_checksums(seeded, plane):
    band = 300  # 1024 = 300 + 300 + 300 + 124
    with raw_connection(plane) as sock:
        sock.sendall(dw.get_bands_request(GOOD, band))
        head = sock.recv(dw.REPLY.size, socket.MSG_WAITALL)
        code, message_bytes, payload = dw.parse_reply_header(head)
        assert (code, message_bytes, payload) == (grpc.StatusCode.OK, 0, 3 * (16 + NODE_PAGE_BYTES))
        body = sock.recv(payload, socket.MSG_WAITALL)
    assert body[:48] == b"".join(seeded.store.checksums(GOOD))
    rows = pages(3)
    expected = b"".join(rows[p, start:end].tobytes() for start, end in dw.band_bounds(NODE_PAGE_BYTES, band)
                        for p in range(3))
    assert body[48:] == expected


@pytest.mark.parametrize("band_bytes, fragment", [
    (0, "a band must hold 1 to 1024 bytes"),
    (NODE_PAGE_BYTES + 1, "a band must hold 1 to 1024 bytes"),
])
def test_a_bad_band_size_is_refused_by_name(seeded, plane, band_bytes, fragment):
    with raw_connection(plane) as sock:
        sock.sendall(dw.get_bands_request(GOOD, band_bytes))
        code, message_bytes, _ = dw.parse_reply_header(sock.recv(dw.REPLY.size, socket.MSG_WAITALL))
        message = sock.recv(message_bytes, socket.MSG_WAITALL).decode()
    assert code == INVALID and fragment in message
    with seeded.client() as client:
        with pytest.raises(ValueError, match=fragment):
            client.get_pages_in_bands(GOOD, [np.zeros(NODE_PAGE_BYTES, np.uint8)] * 3, band_bytes, lambda b: None)
    assert_unharmed(seeded, plane, set(GOOD))


def test_slices_are_bounded_per_request(seeded, plane, monkeypatch):
    monkeypatch.setattr(dw, "MAX_BAND_SLICES", 2000)   # 3 pages in 1,024 one-byte bands: 3,072 slices
    with raw_connection(plane) as sock:
        sock.sendall(dw.get_bands_request(GOOD, 1))
        code, message_bytes, _ = dw.parse_reply_header(sock.recv(dw.REPLY.size, socket.MSG_WAITALL))
        message = sock.recv(message_bytes, socket.MSG_WAITALL).decode()
    assert code == INVALID and "3072 slices; at most 2000 a request: ask for fewer pages or larger bands" in message
    assert_unharmed(seeded, plane, set(GOOD))


def test_bands_are_bounded_per_page():
    with pytest.raises(dw.FrameError, match=f"at most {dw.MAX_BANDS} are sent: ask for bands of at least 4 bytes"):
        dw.band_bounds(4096, 3)
    assert len(dw.band_bounds(4096, 4)) == dw.MAX_BANDS


def test_an_altered_page_is_rejected_once_its_bands_landed(seeded, plane):
    flip_byte_in_pool(seeded, GOOD[1], offset=NODE_PAGE_BYTES - 5)  # in its last band
    landed = []
    with seeded.client() as client:
        with pytest.raises(PageRejected) as raised:
            client.get_pages_in_bands(GOOD, [np.zeros(NODE_PAGE_BYTES, np.uint8) for _ in GOOD], 256, landed.append)
    assert raised.value.index == 1 and raised.value.key == GOOD[1]
    assert landed == [0, 1, 2, 3], "every band lands before the pages are checked"


def test_a_reply_cut_after_a_band_fails_after_that_band_landed():
    listener = socket.create_server(("127.0.0.1", 0))
    rows = pages(3)

    def serve_one_band():
        conn, _ = listener.accept()
        with conn:
            conn.recv(dw.REQUEST.size + 3 * 16, socket.MSG_WAITALL)
            conn.sendall(dw.ok_reply(3 * (16 + NODE_PAGE_BYTES)) + bytes(48) + rows[:, :512].tobytes())

    server = threading.Thread(target=serve_one_band)
    server.start()
    client = DataPlaneClient("127.0.0.1", listener.getsockname()[1])
    landed = []
    try:
        with pytest.raises(DataPlaneError) as raised:
            client.get_bands(GOOD, [memoryview(np.zeros(NODE_PAGE_BYTES, np.uint8)) for _ in GOOD],
                             memoryview(bytearray(48)), 512, landed.append, 5)
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE and "closed after 0 of 1536 bytes" in str(raised.value)
        assert landed == [0]
    finally:
        client.close()
        server.join(5)
        listener.close()


def test_through_the_node_client_a_failure_after_a_band_is_a_node_error(seeded, plane, monkeypatch):
    def one_band_then_cut(self, keys, outs, checksums, band_bytes, landed, timeout_s):
        landed(0)
        raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, "connection closed after 0 of 512 bytes")

    monkeypatch.setattr(DataPlaneClient, "get_bands", one_band_then_cut)
    landed = []
    with seeded.client() as client:
        with pytest.raises(NodeError) as raised:
            client.get_pages_in_bands(GOOD, [np.zeros(NODE_PAGE_BYTES, np.uint8) for _ in GOOD], 512, landed.append)
    assert not isinstance(raised.value, PageRejected) and raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert landed == [0], "nothing is fetched again once a band was handed over"


def test_a_node_that_predates_the_op_is_served_plain_gets(seeded, plane, monkeypatch, caplog):
    monkeypatch.setattr(dw, "OPS", {dw.OP_GET: "GET", dw.OP_PUT: "PUT"})  # the server of the previous version
    with seeded.client() as client:
        for _ in range(2):
            got, landed, intact = fetch_in_bands(client, GOOD, 256)
            assert got.tobytes() == pages(3).tobytes() and landed == [0, 1, 2, 3] and all(intact)
    said = [r.getMessage() for r in caplog.records if "predates banded GETs" in r.getMessage()]
    assert len(said) == 1


def test_over_grpc_every_band_lands_at_the_end(seeded, plane):
    with seeded.client(use_data_plane=False) as client:
        got, landed, intact = fetch_in_bands(client, GOOD, 512)
        assert got.tobytes() == pages(3).tobytes() and landed == [0, 1] and all(intact)
        flip_byte_in_pool(seeded, GOOD[2])
        outs, landed = [np.zeros(NODE_PAGE_BYTES, np.uint8) for _ in GOOD], []
        with pytest.raises(PageRejected) as raised:
            client.get_pages_in_bands(GOOD, outs, 512, landed.append)
    assert raised.value.index == 2 and landed == []
    assert np.stack(outs[:2]).tobytes() == pages(3)[:2].tobytes(), "the pages before it are intact, as over the data plane"


def test_banded_pages_over_tls(seeded, certs):
    def member(role):
        return security.Credentials(certs / "ca.pem", certs / f"{role}.pem", certs / f"{role}.key")

    with DataPlaneServer(seeded.store, "127.0.0.1", 0, credentials=member("node")) as server:
        client = DataPlaneClient("127.0.0.1", server.port, member("worker").client_context())
        try:
            for band in (256, 1000):
                outs = [np.zeros(NODE_PAGE_BYTES, np.uint8) for _ in GOOD]
                sums, landed = bytearray(48), []
                client.get_bands(GOOD, [memoryview(o) for o in outs], memoryview(sums), band, landed.append, 5)
                assert np.stack(outs).tobytes() == pages(3).tobytes()
                assert bytes(sums) == b"".join(seeded.store.checksums(GOOD))
                assert landed == list(range(-(-NODE_PAGE_BYTES // band)))
        finally:
            client.close()
