"""The data plane's same-host path (kvnode/data_plane/server.py, its abstract Unix socket) with real node processes: Info
advertises an abstract Unix socket, a client on the node's loopback address uses it and gets
the bytes TCP and gRPC give, tokens computed from pages it brought equal the cold ones, it
shares TCP's connection bound, and a socket that does not answer, a host that is not loopback
or `--no-data-unix` leave the client on TCP. A socket that is only busy sends one connection over
TCP, a node restarted under a new name is found again through Info, and a name held by another
process leaves the node serving on TCP alone."""

from __future__ import annotations

import errno
import sys
import socket
import uuid

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, free_port, node_process, read_log, wait_for
from kvcache.launch import Daemon
from kvnode.client import data_client
from kvnode.wire import data_frames as dw
from kvnode.client import NodeClient
from kvnode.client.data_client import DataPlaneClient
from kvnode.client.data_client_io import DataPlaneError
from store_helpers import key
from worker.engine.engine import Engine
from worker.model import load_model
from worker.remote.tier import Placement, RemoteTier

ARGS = ("--capacity", "64KiB", "--page-bytes", str(NODE_PAGE_BYTES))


def stored(client: NodeClient, n: int = 3) -> tuple[list[bytes], np.ndarray]:
    keys = [key(i) for i in range(1, n + 1)]
    data = np.random.default_rng(n).integers(0, 256, size=(n, NODE_PAGE_BYTES), dtype=np.uint8)
    assert client.put_pages(keys, [b"", *keys[:-1]], data).stored == n
    return keys, data


def test_a_client_on_the_nodes_host_uses_its_unix_socket_and_gets_the_same_bytes(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon:
        with NodeClient(daemon.address, shared_memory=False) as unix, \
                NodeClient(daemon.address, unix_socket=False) as tcp, \
                NodeClient(daemon.address, use_data_plane=False) as grpc_client:
            name = unix.info().data_unix
            assert name.startswith("kvcache-data-")
            keys, data = stored(unix)
            assert unix.data_plane_transport() == "unix" and tcp.data_plane_transport() == "tcp"
            assert unix.get_pages(keys).tobytes() == tcp.get_pages(keys).tobytes() == \
                grpc_client.get_pages(keys).tobytes() == data.tobytes()
            assert unix.data_plane_transport() == "unix", "fell back to TCP"
        assert f"abstract unix socket @{name}" in read_log(tmp_path)


def test_no_data_unix_keeps_the_data_plane_on_tcp(tmp_path):
    with node_process(tmp_path, *ARGS, "--no-data-unix") as daemon, NodeClient(daemon.address) as client:
        assert client.info().data_unix == ""
        keys, data = stored(client)
        assert client.get_pages(keys).tobytes() == data.tobytes()
        assert client.data_plane_transport() == "tcp"


def test_a_unix_socket_that_does_not_answer_leaves_the_client_on_tcp(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon, NodeClient(daemon.address) as client:
        keys, data = stored(client)
        port = client.info().data_port
        plane = DataPlaneClient("127.0.0.1", port, unix_name="kvcache-data-nobody-listens-here")
        assert plane.transport == "unix"
        out, sums = bytearray(3 * NODE_PAGE_BYTES), bytearray(3 * 16)
        plane.get_into(keys, memoryview(out), memoryview(sums), timeout_s=5)
        assert bytes(out) == data.tobytes() and plane.transport == "tcp" and plane.unix_gone
        plane.close()


def test_a_host_that_is_not_loopback_never_tries_the_unix_socket():
    assert DataPlaneClient("10.1.2.3", 7000, unix_name="kvcache-data-x").transport == "tcp"
    assert DataPlaneClient("::1", 7000, unix_name="kvcache-data-x").transport == "unix"
    assert DataPlaneClient("localhost", 7000, unix_name="kvcache-data-x").transport == "unix"


def test_unix_and_tcp_connections_share_the_nodes_connection_bound(tmp_path):
    with node_process(tmp_path, *ARGS, "--data-max-connections", "1") as daemon, \
            NodeClient(daemon.address, use_data_plane=False) as client:
        keys, data = stored(client, 1)
        info = client.info()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
            held.settimeout(5)
            held.connect(b"\0" + info.data_unix.encode())
            held.sendall(dw.get_request(keys))  # answered: the connection is served, and stays open
            reply = b""
            while len(reply) < dw.REPLY.size + 16 + NODE_PAGE_BYTES:
                reply += held.recv(1 << 20)
            assert reply[dw.REPLY.size + 16 :] == data.tobytes()
            with socket.create_connection(("127.0.0.1", info.data_port), timeout=5) as other:
                other.sendall(dw.get_request(keys))
                header = other.recv(dw.REPLY.size)
                assert dw.parse_reply_header(header)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("node_args,transport,in_place", [(("--no-shared-pool",), "unix", False),
                                                          ((), "shared memory", False), ((), "shared memory", True)],
                         ids=["unix socket", "shared pool", "read in place"])
def test_tokens_from_pages_fetched_on_the_same_host_equal_the_cold_ones(tmp_path, node_args, transport, in_place):
    model = load_model("tiny")
    prompt = "You are a helpful assistant. Answer briefly, and cite what you read. " * 2 + "What is a page?"

    def engine():
        return Engine(model, kv_dtype="float16", num_blocks=64, page_tokens=16, seed=0)

    cold = engine().generate([prompt], max_new_tokens=12, ignore_eos=True)[0]
    writer, reader = engine(), engine()
    page_bytes = writer.kv_pool[0].nbytes   # the pool is float16, as on the wire
    with Daemon("node", ["--port", "0", "--page-bytes", str(page_bytes), "--capacity", "4MiB", *node_args],
                log_path=tmp_path / "node.log") as daemon:
        placement = Placement([daemon.address])
        tiers = [RemoteTier(writer.kv_pool, "float16"), RemoteTier(reader.kv_pool, "float16", read_in_place=in_place)]
        try:
            writer.attach_remote_tier(tiers[0])
            reader.attach_remote_tier(tiers[1])
            writer.generate([prompt], max_new_tokens=2, tier_context=placement)
            assert tiers[0].flush(timeout_s=10.0) and tiers[0].stats.pages_written >= 8
            with tiers[1].nodes.use([daemon.address]) as nodes:  # the reader meets the node, maps its pool
                assert tiers[1].lookup([bytes(16)], placement) == 0
                if in_place:  # first contact maps it into the reader's block arena too (InPlaceReader.prepare)
                    assert wait_for(lambda: tiers[1].in_place.attached(daemon.address), timeout_s=20.0)
                else:
                    nodes[0].client.map_shared_pool(timeout=10)
            warm = reader.generate([prompt], max_new_tokens=12, ignore_eos=True,
                                   tier_context=Placement([daemon.address]))[0]
            with tiers[1].nodes.use([daemon.address]) as nodes:
                assert nodes[0].client.data_plane_transport() == transport
                window = tiers[1].in_place._window(nodes[0]) if in_place else None
                pinned = window.pins if window is not None else 0
        finally:
            for tier in tiers:
                tier.close()
        fetched = tiers[1].stats.pages_in_place if in_place else tiers[1].stats.pages_fetched
        assert fetched >= 8 and tiers[1].stats.pages_rejected == 0
        assert tiers[1].stats.pages_fetched == 0 if in_place else tiers[1].stats.pages_fetched >= 8
        assert pinned == 0 and not reader.scheduler.in_place.num_reading(), "the pages read in place were not given back"
        assert warm.usage.cached_tokens_remote >= 8 * 16
        assert warm.token_ids == cold.token_ids


def test_a_busy_unix_socket_sends_only_that_connection_over_tcp(tmp_path):
    """A full backlog makes a non-blocking AF_UNIX connect fail with EAGAIN at once: that connection
    goes over TCP and the next one tries the unix socket again."""
    name = "kvcache-data-test-" + uuid.uuid4().hex
    with node_process(tmp_path, *ARGS) as daemon, NodeClient(daemon.address) as client, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
        keys, data = stored(client)
        held.bind(b"\0" + name.encode())
        held.listen(0)
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.connect(b"\0" + name.encode())  # the backlog is full now
        # No shared pool: its mapping would take a connection of `held`'s backlog too.
        plane = DataPlaneClient("127.0.0.1", client.info().data_port, unix_name=name, shared_memory=False)
        plane.close()  # no pool: every call opens a connection
        out, sums = bytearray(3 * NODE_PAGE_BYTES), bytearray(3 * 16)
        plane.get_into(keys, memoryview(out), memoryview(sums), timeout_s=5)
        assert bytes(out) == data.tobytes()
        assert plane.transport == "unix" and not plane.unix_gone, "a busy socket is not a gone one"
        held.accept()[0].close()
        filler.close()  # room in the backlog again: the next call's connection lands here
        with pytest.raises(DataPlaneError):
            plane.get_into(keys, memoryview(out), memoryview(sums), timeout_s=0.5)
        conn, _ = held.accept()
        with conn:
            conn.settimeout(5)
            assert conn.recv(dw.REQUEST.size + 1)[: dw.REQUEST.size] == dw.get_request(keys)[: dw.REQUEST.size]


def test_a_process_that_may_not_make_unix_sockets_uses_tcp(tmp_path, monkeypatch):
    real_socket = socket.socket

    def sandboxed(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_UNIX:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_socket(family, *args, **kwargs)

    with node_process(tmp_path, *ARGS) as daemon, NodeClient(daemon.address) as client:
        keys, data = stored(client)
        monkeypatch.setattr(data_client.socket, "socket", sandboxed)
        plane = DataPlaneClient("127.0.0.1", client.info().data_port, unix_name=client.info().data_unix)
        out, sums = bytearray(3 * NODE_PAGE_BYTES), bytearray(3 * 16)
        plane.get_into(keys, memoryview(out), memoryview(sums), timeout_s=5)
        assert bytes(out) == data.tobytes() and plane.transport == "tcp" and not plane.unix_gone
        plane.close()


def test_a_node_restarted_under_a_new_name_is_found_again_through_info(tmp_path):
    """Same ports, new process: the old name has nobody listening, that call goes over TCP, and the
    next reads Info again and uses the node's new unix socket."""
    ports = ("--port", str(free_port()), "--data-port", str(free_port()))
    with node_process(tmp_path, *ARGS, *ports) as daemon:
        client = NodeClient(daemon.address, shared_memory=False)
        keys, data = stored(client)
        old = client.info().data_unix
        assert client.get_pages(keys).tobytes() == data.tobytes() and client.data_plane_transport() == "unix"
    try:
        with node_process(tmp_path, *ARGS, *ports):
            keys, data = stored(client)  # the old name is refused: this put goes over TCP
            assert client._data.transport == "tcp"
            assert client.data_plane_transport() == "unix", "the client did not learn the new name"
            assert client._data.unix_name not in ("", old)
            assert client.get_pages(keys).tobytes() == data.tobytes() and client.data_plane_transport() == "unix"
    finally:
        client.close()


# Runs `kvcache node` in this process's place (the pid stays the daemon's) with the unix socket
# name fixed, so a test can hold that name first.
_FIXED_NAME = """
import runpy, sys
from kvnode.data_plane import connection as data_plane_connection
name = sys.argv.pop(1)
data_plane_connection.new_unix_name = lambda: name
sys.argv = ["kvcache", *sys.argv[4:]]
runpy.run_module("kvcache.cli", run_name="__main__", alter_sys=True)
"""


def test_a_name_held_by_another_process_leaves_the_node_on_tcp(tmp_path):
    name = "kvcache-data-test-" + uuid.uuid4().hex
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
        squatter.bind(b"\0" + name.encode())
        squatter.listen(1)
        with Daemon("node", ["--host", "127.0.0.1", "--port", "0", *ARGS], log_path=tmp_path / "node.log",
                    prefix=[sys.executable, "-c", _FIXED_NAME, name]) as daemon, \
                NodeClient(daemon.address) as client:
            assert client.info().data_unix == "", "Info advertises a socket the node does not hold"
            keys, data = stored(client)
            assert client.get_pages(keys).tobytes() == data.tobytes()
            assert client.data_plane_transport() == "tcp"
        log = read_log(tmp_path)
        assert log.count("held by another process") == 1 and f"@{name}" in log
        assert "abstract unix socket @" not in log
