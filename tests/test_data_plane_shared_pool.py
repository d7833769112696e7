"""The shared pool (kvnode/wire/shared_pool.py, shared_pool_serving.py): a client on the node's host
maps the node's pool read-only and copies pinned pages out of it. The bytes equal every other
path's, pins last exactly until the client releases them (or goes away, or stalls), the mapping
cannot be written, a page on disk only still arrives, an altered page is still refused, and the
pool is never offered with TLS, over TCP, to another user or with --no-shared-pool."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, free_port, node_process, read_log, serve_node, wait_for
from data_plane_helpers import GOOD, GOOD_PARENTS, pages
from kvnode.wire import data_frames as dw
from kvnode.wire import shared_pool
from kvnode.client import NodeClient, PageRejected
from kvnode.client.data_client import DataPlaneClient
from kvnode.data_plane.server import DataPlaneServer
from kvnode.disk.tier import DiskTier
from kvnode.store.page_store import PageStore
from store_helpers import key
from test_node_checksums import flip_byte_in_pool
from worker.remote.tier import Placement, RemoteTier

pytestmark = pytest.mark.skipif(not shared_pool.supported(), reason="the shared pool needs Linux (memfd, SO_PEERCRED)")
ARGS = ("--capacity", "64KiB", "--page-bytes", str(NODE_PAGE_BYTES))


@contextlib.contextmanager
def shared_node(store: PageStore | None = None, timeout_s: float = 2.0, **server_kwargs):
    """An in-process node whose pool is shared, its data plane on TCP and a unix socket, both in Info."""
    store = store or PageStore(16, NODE_PAGE_BYTES, shared_pool=True)
    with serve_node(store) as node:
        server = DataPlaneServer(store, "127.0.0.1", 0, max_keys=8, max_connections=4, timeout_s=timeout_s,
                                 unix=True, **server_kwargs).start()
        node.service.data_port, node.service.data_unix = server.port, server.unix_name
        try:
            yield node, server
        finally:
            server.stop()


def unix_connection(server: DataPlaneServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(b"\0" + server.unix_name.encode())
    return sock


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"closed after {len(data)} of {size} bytes"
        data += chunk
    return data


def test_a_client_on_the_nodes_host_copies_pages_out_of_the_shared_pool(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon, NodeClient(daemon.address) as client, \
            NodeClient(daemon.address, shared_memory=False) as unix, \
            NodeClient(daemon.address, use_data_plane=False) as grpc_client:
        keys = [key(i) for i in range(1, 4)]
        data = pages(3)
        assert client.put_pages(keys, [b"", *keys[:-1]], data).stored == 3
        assert client.map_shared_pool(timeout=10)
        assert client.data_plane_transport() == "shared memory" and unix.data_plane_transport() == "unix"
        pool_reader, copied = client._data.shared_pool, []  # counts the fetches copied out of the pool, not a fallback
        copy_pages = pool_reader.copy_pages
        pool_reader.copy_pages = lambda sock, pool, keys, *rest: copied.append(len(keys)) or copy_pages(sock, pool, keys, *rest)
        assert client.get_pages(keys).tobytes() == unix.get_pages(keys).tobytes() == \
            grpc_client.get_pages(keys).tobytes() == data.tobytes()
        landed = []
        client.get_pages_in_batches([keys[:1], keys[1:]], lambda i: np.empty((len([keys[:1], keys[1:]][i]),
                                                                              NODE_PAGE_BYTES), dtype=np.uint8),
                                    landed.append)
        for reader in (client, unix, grpc_client):  # pages bound for scattered memory: one array a page
            scattered = [np.zeros(NODE_PAGE_BYTES, dtype=np.uint8) for _ in keys]
            reader.get_pages_in_batches([keys[:2], keys[2:]], lambda i: scattered[:2] if i == 0 else scattered[2:],
                                        lambda i: None)
            assert np.array_equal(np.stack(scattered), data)
        outs = [np.zeros(NODE_PAGE_BYTES, dtype=np.uint8) for _ in keys]
        bands = []
        client.get_pages_in_bands(keys, outs, NODE_PAGE_BYTES // 4, bands.append)
        assert landed == [0, 1] and bands == [0, 1, 2, 3] and np.array_equal(np.stack(outs), data)
        assert client.data_plane_transport() == "shared memory", "fell back to the socket"
        assert copied == [3, 1, 2, 2, 1, 3], "the fetches did not all come out of the shared pool"
        assert client.stats()["get_pages"] >= 3 * 8
    assert "Traceback" not in read_log(tmp_path)


def test_pins_last_until_the_release_and_no_longer():
    with shared_node(timeout_s=1.0) as (node, server):
        with node.client(use_data_plane=False) as grpc_client:
            assert grpc_client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        with unix_connection(server) as sock:
            sock.sendall(dw.get_request(GOOD, dw.OP_GET_SLOTS))
            code, _, payload = dw.parse_reply_header(receive_exactly(sock, dw.REPLY.size))
            assert code == grpc.StatusCode.OK and payload == 3 * (16 + dw.SLOT.size)
            body = receive_exactly(sock, payload)
            slots = [dw.SLOT.unpack_from(body, i * 24 + 16)[0] for i in range(3)]
            assert [body[i * 24 : i * 24 + 16] for i in range(3)] == node.store.checksums(GOOD)
            assert node.store.num_pinned() == 3
            np.testing.assert_array_equal(node.store._pool[slots], pages(3))
            time.sleep(0.3)
            assert node.store.num_pinned() == 3, "unpinned before the release"
            sock.sendall(dw.RELEASE)
            assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
            sock.sendall(dw.get_request(GOOD[:1], dw.OP_GET_SLOTS))  # the connection goes on serving
            assert dw.parse_reply_header(receive_exactly(sock, dw.REPLY.size))[0] == grpc.StatusCode.OK
            receive_exactly(sock, 24)
            assert node.store.num_pinned() == 1
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0), "a closed reader kept its pins"
        with unix_connection(server) as sock:  # a reader that never releases: dropped after timeout_s
            sock.sendall(dw.get_request(GOOD, dw.OP_GET_SLOTS))
            receive_exactly(sock, dw.REPLY.size + 3 * 24)
            started = time.monotonic()
            assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=5.0)
            assert 0.5 < time.monotonic() - started < 4.0
            assert sock.recv(1) == b"", "the node kept the stalled connection"
        with unix_connection(server) as sock:  # anything but the release byte: dropped, unpinned
            sock.sendall(dw.get_request(GOOD, dw.OP_GET_SLOTS))
            receive_exactly(sock, dw.REPLY.size + 3 * 24)
            sock.sendall(b"X")
            assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
        node.store.check_invariants()


def test_the_mapping_a_reader_gets_cannot_be_written():
    with shared_node() as (node, server), unix_connection(server) as sock:
        sock.sendall(dw.request_header(dw.OP_MAP_POOL, 0))
        data, fds, _, _ = socket.recv_fds(sock, dw.REPLY.size + dw.POOL_REPLY.size, 1)
        try:
            assert len(fds) == 1 and dw.parse_reply_header(data[: dw.REPLY.size])[0] == grpc.StatusCode.OK
            assert dw.POOL_REPLY.unpack_from(data, dw.REPLY.size) == (16, NODE_PAGE_BYTES)
            with pytest.raises(PermissionError):
                mmap.mmap(fds[0], 16 * NODE_PAGE_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            reopened = os.open(f"/proc/self/fd/{fds[0]}", os.O_RDWR)  # another descriptor of the same memory
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(reopened, 16 * NODE_PAGE_BYTES, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(PermissionError):
                    os.pwrite(reopened, b"poison", 0)
                with pytest.raises(PermissionError):
                    os.ftruncate(reopened, NODE_PAGE_BYTES)  # a shrunk pool would kill its readers (SIGBUS)
            finally:
                os.close(reopened)
            pool = shared_pool.map_read_only(fds[0], 16, NODE_PAGE_BYTES)
        finally:
            for fd in fds:
                os.close(fd)
        assert not pool.flags.writeable
        node.store._pool[3, :4] = [1, 2, 3, 4]  # the reader sees the node's pool itself
        assert pool[3, :4].tolist() == [1, 2, 3, 4]


def test_a_page_altered_in_the_shared_pool_is_refused():
    with shared_node() as (node, server):
        with node.client() as client:
            assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
            assert client.map_shared_pool(timeout=5)
            flip_byte_in_pool(node, GOOD[1])
            out = np.zeros((3, NODE_PAGE_BYTES), dtype=np.uint8)
            with pytest.raises(PageRejected) as rejected:
                client.get_pages(GOOD, out=out)
            assert (rejected.value.index, rejected.value.key) == (1, GOOD[1])
            np.testing.assert_array_equal(out[0], pages(3)[0])
            assert client.data_plane_transport() == "shared memory"
        assert wait_for(lambda: node.store.num_pinned() == 0, timeout_s=2.0)
        assert server.pages_by_slot == 3, "the pages were not copied out of the shared pool"


def test_pages_on_disk_without_a_ram_slot_come_over_the_socket(tmp_path):
    """RAM holds 2 copies; a fetch of 4 pages on disk only promotes the first 2 (pinned), and the
    node has no slot for the other 2: they come by GET on the same connection."""
    store = PageStore(2, NODE_PAGE_BYTES, disk=DiskTier(tmp_path, 8, NODE_PAGE_BYTES), shared_pool=True)
    keys = [key(i) for i in range(1, 7)]
    data = pages(6)
    for parent, k, row in zip([b"", *keys[:-1]], keys, data):
        store.put(k, parent, row.tobytes())
    store.flush()
    with shared_node(store) as (node, server):
        plane = DataPlaneClient("127.0.0.1", server.port, unix_name=server.unix_name)
        try:
            assert plane.map_pool(5.0) and plane.transport == "shared memory"
            out, sums = bytearray(4 * NODE_PAGE_BYTES), bytearray(4 * 16)
            plane.get_into(keys[:4], memoryview(out), memoryview(sums), timeout_s=5)
        finally:
            plane.close()
        assert bytes(out) == data[:4].tobytes()
        assert bytes(sums) == b"".join(store.checksums(keys[:4]))
        assert wait_for(lambda: server.pages_by_slot == 2, timeout_s=2.0), \
            "two pages by slot, the two without a RAM slot after the table"
        assert store.stats.promotions >= 2
        assert wait_for(lambda: store.num_pinned() == 0, timeout_s=2.0)
        store.check_invariants()


def test_no_shared_pool_over_tcp_with_no_shared_pool_or_without_a_shared_store():
    with shared_node() as (node, server):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(dw.request_header(dw.OP_MAP_POOL, 0))
            code, size, _ = dw.parse_reply_header(receive_exactly(sock, dw.REPLY.size))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "unix socket only" in receive_exactly(sock, size).decode()
    for store, kwargs in ((PageStore(16, NODE_PAGE_BYTES, shared_pool=True), {"share_pool": False}),
                          (PageStore(16, NODE_PAGE_BYTES), {})):
        with shared_node(store, **kwargs) as (node, server), node.client() as client:
            assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
            assert not client.map_shared_pool(timeout=5)
            np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
            assert client.data_plane_transport() == "unix"


def test_a_tls_client_never_asks_for_the_pool():
    plane = DataPlaneClient("127.0.0.1", 1, tls=object(), unix_name="kvcache-data-x")
    assert plane.pool_state == "refused" and not plane.map_pool(0.1)


def test_a_process_of_another_user_is_refused_the_pool(monkeypatch):
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        assert shared_pool.peer_uid(left) == os.geteuid()  # what the node asks the kernel
    monkeypatch.setattr(shared_pool, "peer_uid", lambda sock: os.geteuid() + 12345)
    with shared_node() as (node, server), unix_connection(server) as sock:
        sock.sendall(dw.request_header(dw.OP_MAP_POOL, 0))
        data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        assert fds == []
        assert dw.parse_reply_header(data[: dw.REPLY.size])[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert "node's user" in data[dw.REPLY.size :].decode()


def test_a_worker_maps_the_pool_at_first_contact_before_any_fetch(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon:
        tier = RemoteTier(np.zeros((4, NODE_PAGE_BYTES // 2), dtype=np.float16), "float16")
        try:
            assert tier.lookup([key(1)], Placement([daemon.address])) == 0  # the first contact
            with tier.nodes.use([daemon.address]) as nodes:
                client = nodes[0].client
                assert wait_for(lambda: client._data is not None and client._data.pool_state == "mapped",
                                timeout_s=10.0)
                assert client.data_plane_transport() == "shared memory"
            assert tier.stats.pages_fetched == 0
        finally:
            tier.close()


def test_a_stale_pooled_connection_is_retried_and_asks_for_its_memory_once():
    """The node closes an idle connection after its timeout; the next fetch retries on a new one,
    and the caller's out_for is asked once per batch all the same."""
    with shared_node(timeout_s=0.5) as (node, server), node.client() as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        assert client.map_shared_pool(timeout=5)
        client.get_pages(GOOD)
        assert wait_for(lambda: server.num_connections() == 0, timeout_s=5.0)  # the node closed the idle pooled one
        asked, out = [], np.zeros((3, NODE_PAGE_BYTES), dtype=np.uint8)
        client.get_pages_in_batches([GOOD], lambda i: asked.append(i) or out, lambda i: None)
        assert asked == [0] and np.array_equal(out, pages(3))
        assert client.data_plane_transport() == "shared memory"
        assert wait_for(lambda: server.pages_by_slot == 6, timeout_s=2.0)


def test_a_tls_node_never_offers_the_pool():
    store = PageStore(4, NODE_PAGE_BYTES, shared_pool=True)
    with DataPlaneServer(store, "127.0.0.1", 0, unix=True, credentials=object()) as server:
        assert store.shared_pool is not None and server.shared_pool is None


def test_a_client_maps_no_pool_from_a_peer_of_another_user(monkeypatch, caplog):
    with shared_node() as (node, server), node.client() as client:
        monkeypatch.setattr(shared_pool, "peer_uid", lambda sock: os.geteuid() + 12345)
        with caplog.at_level("INFO", logger="kvnode.client"):
            assert not client.map_shared_pool(timeout=5)
        assert "runs as user" in caplog.text
        monkeypatch.undo()
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
        assert client.data_plane_transport() == "unix" and server.pages_by_slot == 0


def test_an_unsealed_or_short_descriptor_is_not_mapped():
    fd = os.memfd_create("not-a-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4 * NODE_PAGE_BYTES)
        with pytest.raises(ValueError, match="not sealed"):
            shared_pool.map_read_only(fd, 4, NODE_PAGE_BYTES)
    finally:
        os.close(fd)
    pool = shared_pool.SharedPool(4, NODE_PAGE_BYTES)
    with pytest.raises(ValueError, match="holds"):
        shared_pool.map_read_only(pool.fd, 8, NODE_PAGE_BYTES)
    with pytest.raises(ValueError, match="not one to map"):
        shared_pool.map_read_only(pool.fd, 0, NODE_PAGE_BYTES)


def test_a_node_stopped_and_restarted_is_read_out_of_its_new_pool(tmp_path):
    """The old pool's mapping goes with the old socket name; the restarted node's pool is mapped
    anew, and its pages (not the dead node's) are what the client gets."""
    ports = ("--port", str(free_port()), "--data-port", str(free_port()))
    client = NodeClient(f"127.0.0.1:{ports[1]}")
    try:
        with node_process(tmp_path, *ARGS, *ports):
            keys = [key(i) for i in range(1, 4)]
            assert client.put_pages(keys, [b"", *keys[:-1]], pages(3)).stored == 3
            assert client.map_shared_pool(timeout=10) and np.array_equal(client.get_pages(keys), pages(3))
            old = client._data
        with node_process(tmp_path, *ARGS, *ports):
            newer = pages(3, first=7)
            assert client.put_pages(keys, [b"", *keys[:-1]], newer).stored == 3  # the old name is gone: TCP
            assert old.pool_state == "refused" and old.transport == "tcp", "the dead node's pool is still mapped"
            assert client.map_shared_pool(timeout=10), "the restarted node's pool was not mapped"
            assert np.array_equal(client.get_pages(keys), newer)
            assert client.data_plane_transport() == "shared memory" and client._data is not old
    finally:
        client.close()


@pytest.mark.usefixtures("no_kvnode_errors_logged")
def test_a_page_dropped_while_pinned_for_get_slots_is_not_found_and_leaves_no_pin():
    """A reader's report may drop a page between GET_SLOTS' pin and its checksums (it leaves
    the index at once, its slots waiting for the unpin): NOT_FOUND as for any missing page, its pins released, no traceback."""
    store = PageStore(16, NODE_PAGE_BYTES, shared_pool=True)
    parent, child = key(70), key(71)
    store.put(parent, b"", bytes(NODE_PAGE_BYTES), checksum=bytes(16))  # a checksum its bytes fail
    store.put(child, parent, bytes(NODE_PAGE_BYTES))
    pin = store.pin_slots

    def pin_then_report(keys):
        pinned = pin(keys)
        assert store.drop_reported(parent) == 2  # the parent and the child being read
        return pinned

    store.pin_slots = pin_then_report
    with shared_node(store) as (node, server), unix_connection(server) as sock:
        sock.sendall(dw.get_request([child], dw.OP_GET_SLOTS))
        code, message_bytes, _ = dw.parse_reply_header(receive_exactly(sock, dw.REPLY.size))
        assert code == grpc.StatusCode.NOT_FOUND and child.hex() in receive_exactly(sock, message_bytes).decode()
        assert wait_for(lambda: store.num_pinned() == 0 and server.num_connections() == 0, timeout_s=5.0)
        store.check_invariants()
