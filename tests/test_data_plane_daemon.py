"""`kvcache node` as a real process with its data plane: Info advertises it, NodeClient uses
it and gets the bytes gRPC gives, --no-data-plane turns it off, a taken --data-port is one
clear error line, and a peer holding a connection open does not keep the node from stopping."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, node_process, read_log, run_kvcache
from kvnode.wire import data_frames as dw
from kvnode.client import NodeClient
from store_helpers import key

ARGS = ("--capacity", "64KiB", "--page-bytes", str(NODE_PAGE_BYTES))


def test_the_node_serves_its_data_plane_and_it_equals_grpc(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon:
        with NodeClient(daemon.address) as fast, NodeClient(daemon.address, use_data_plane=False) as slow:
            port = fast.info().data_port
            assert port > 0 and port != int(daemon.address.rsplit(":", 1)[1])
            assert fast.data_plane_address() == f"127.0.0.1:{port}"
            keys = [key(1), key(2), key(3)]
            data = np.random.default_rng(0).integers(0, 256, size=(3, NODE_PAGE_BYTES), dtype=np.uint8)
            assert fast.put_pages(keys, [b"", keys[0], keys[1]], data).stored == 3
            assert fast.get_pages(keys).tobytes() == slow.get_pages(keys).tobytes() == data.tobytes()
            stats = slow.stats()
            assert (stats["stored_pages"], stats["get_pages"]) == (3, 6)
        log = read_log(tmp_path)
        assert f"data plane (GET/PUT of pages over plain TCP) on 127.0.0.1:{port}" in log
        assert log.count("listening on") == 1  # the line launchers parse is unchanged and alone


def test_no_data_plane_keeps_pages_on_grpc(tmp_path):
    with node_process(tmp_path, *ARGS, "--no-data-plane") as daemon, NodeClient(daemon.address) as client:
        assert client.info().data_port == 0
        assert client.data_plane_address() is None
        assert client.put_pages([key(1)], [b""], [bytes(NODE_PAGE_BYTES)]).stored == 1
        assert client.get_pages([key(1)]).tobytes() == bytes(NODE_PAGE_BYTES)
    assert "data plane off" in read_log(tmp_path)


def test_a_chosen_data_port_is_used(tmp_path):
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with node_process(tmp_path, *ARGS, "--data-port", str(port)) as daemon, NodeClient(daemon.address) as client:
        assert client.info().data_port == port


def test_a_taken_data_port_is_one_clear_error_line():
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        result = run_kvcache(["node", "--port", "0", *ARGS, "--data-port", str(port)])
    finally:
        taken.close()
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcache node: error:"), result.stderr
    assert f"cannot listen on 127.0.0.1:{port} for the data plane" in lines[0]
    assert "listening" not in result.stdout


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_a_data_port_out_of_range_is_one_clear_error_line(port):
    result = run_kvcache(["node", "--port", "0", *ARGS, "--data-port", port])
    assert result.returncode == 2
    assert result.stderr.strip() == f"kvcache node: error: --data-port must be between 0 and 65535, got {port}"


def test_a_busy_data_plane_sends_clients_to_grpc_for_that_call(tmp_path):
    """--data-max-connections 1 and a peer holding that one: NodeClient still stores and fetches,
    over gRPC, and the node logs the refusal."""
    with node_process(tmp_path, *ARGS, "--data-max-connections", "1") as daemon:
        with NodeClient(daemon.address) as client:
            port = client.info().data_port
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                keys = [key(1), key(2)]
                data = np.random.default_rng(1).integers(0, 256, size=(2, NODE_PAGE_BYTES), dtype=np.uint8)
                assert client.put_pages(keys, [b"", keys[0]], data).stored == 2
                assert client.get_pages(keys).tobytes() == data.tobytes()
            assert client.data_plane_address() == f"127.0.0.1:{port}", "the data plane stays in use afterwards"
    log = read_log(tmp_path)
    assert "data plane refused 1 connection(s)" in log and "Traceback" not in log


def test_data_max_connections_below_one_is_one_clear_error_line():
    result = run_kvcache(["node", "--port", "0", *ARGS, "--data-max-connections", "0"])
    assert result.returncode == 2
    assert result.stderr.strip() == "kvcache node: error: --data-max-connections must be at least 1, got 0"


def test_a_peer_holding_a_data_connection_does_not_keep_the_node_from_stopping(tmp_path):
    with node_process(tmp_path, *ARGS, "--grace", "0.5") as daemon:
        with NodeClient(daemon.address) as client:
            port = client.info().data_port
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(dw.get_request([key(1)])[:5])  # half a header, then silence
            time.sleep(0.2)
            started = time.monotonic()
            os.kill(daemon.pid, signal.SIGTERM)
            daemon.process.wait(timeout=10)
            assert time.monotonic() - started < 5.0
        assert daemon.process.returncode == 0, read_log(tmp_path)
    assert "Traceback" not in read_log(tmp_path)
