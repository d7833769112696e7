"""`kvcache node` as a real process: the printed address, a client round trip, a clean stop
on SIGTERM or Ctrl-C, and one clear error line for bad arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, node_process, raw_channel, read_log, run_kvcache
from kvcache import cli
from kvnode.wire import grpc_frames as wire
from kvnode.client import NodeClient
from kvnode.service import SERVICE_NAME
from store_helpers import key


def test_node_prints_its_address_and_serves_a_round_trip(node_proc, tmp_path):
    host, port = node_proc.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    pages = np.random.default_rng(0).integers(0, 256, size=(2, NODE_PAGE_BYTES), dtype=np.uint8)
    with NodeClient(node_proc.address) as client:
        info = client.info()
        assert (info.page_bytes, info.capacity_pages) == (NODE_PAGE_BYTES, 64 * 1024 // NODE_PAGE_BYTES)
        assert client.put_pages([key(1), key(2)], [b"", key(1)], pages).stored == 2
        assert client.lookup([key(1), key(2)], lease_ms=100) == 2
        np.testing.assert_array_equal(client.get_pages([key(1), key(2)]), pages)
    assert node_proc.alive()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_node_cleanly_and_quickly(tmp_path, signum):
    with node_process(tmp_path, "--capacity", "64KiB", "--page-bytes", "1024") as daemon:
        with NodeClient(daemon.address) as client:
            assert client.info().capacity_pages == 64
        started = time.monotonic()
        os.kill(daemon.pid, signum)
        daemon.process.wait(timeout=10)
        elapsed = time.monotonic() - started
        assert daemon.process.returncode == 0, read_log(tmp_path)
    assert elapsed < 5.0
    log = read_log(tmp_path)
    assert "stopping" in log and "stopped" in log
    assert "Traceback" not in log


def test_a_page_larger_than_the_message_limit_round_trips_through_a_real_node(tmp_path):
    page_bytes = 20_000
    with node_process(tmp_path, "--capacity", "100KB", "--page-bytes", str(page_bytes),
                      "--max-message-bytes", "8KiB") as daemon, NodeClient(daemon.address) as client:
        assert client.info().max_message_bytes == 8192
        pages = np.random.default_rng(1).integers(0, 256, size=(3, page_bytes), dtype=np.uint8)
        keys = [key(1), key(2), key(3)]
        assert client.put_pages(keys, [b"", keys[0], keys[1]], pages).stored == 3
        np.testing.assert_array_equal(client.get_pages(keys), pages)


def assert_one_clear_error(result, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvcache node: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "listening" not in result.stdout


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--capacity", "1000", "--page-bytes", "1024"], ["--capacity 1000 holds no page of 1024 bytes"]),
        (["--capacity", "lots"], ["cannot read size 'lots'"]),
        (["--max-message-bytes", "100"], ["max_message_bytes must exceed"]),
        (["--host", "192.0.2.1"], ["cannot listen on 192.0.2.1:0"]),  # an address of no local interface
    ],
)
def test_bad_arguments_exit_with_one_clear_error_line(args, fragments):
    result = run_kvcache(["node", "--port", "0", *args])
    assert_one_clear_error(result, *fragments)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--capacity", "0"], ["holds no page"]),
        (["--capacity", "12XB"], ["cannot read size '12XB'"]),
        (["--max-message-bytes", "big"], ["cannot read size 'big'"]),
        (["--page-bytes", "0"], ["--page-bytes must be positive"]),
        (["--max-keys", "0"], ["--max-keys must be positive"]),
        (["--eviction", "lru"], ["--eviction lru evicts pages whose children are cached", "prefix-arc"]),
        (["--eviction", "mru"], ["--eviction mru is unknown: choose one of prefix-lru, prefix-arc"]),
    ],
)
def test_more_bad_arguments_in_process(capsys, args, fragments):
    """The same checks without a process each: they fail before anything is allocated or bound."""
    code = cli.main(["node", "--port", "0", "--capacity", "64KiB", *args])
    captured = capsys.readouterr()
    assert_one_clear_error(subprocess.CompletedProcess([], code, captured.out, captured.err), *fragments)


@pytest.mark.parametrize("policy", ["prefix-arc", "prefix-s3fifo", "prefix-lfu"])
def test_the_node_runs_the_eviction_policy_it_is_given(tmp_path, policy):
    with node_process(tmp_path, "--capacity", "8KiB", "--page-bytes", "1024", "--eviction", policy) as daemon:
        pages = np.zeros((2, 1024), dtype=np.uint8)
        with NodeClient(daemon.address) as client:
            for n in range(6):  # 12 pages in a pool of 8: leaves go, and no page without its parent stays
                assert client.put_pages([key(2 * n), key(2 * n + 1)], [b"", key(2 * n)], pages).stored == 2
            assert client.lookup([key(10), key(11)]) == 2
            assert client.stats()["evictions"] == 4
    assert f"eviction {policy}; leases at most 4 pages at once" in read_log(tmp_path)


def test_a_taken_port_exits_with_one_clear_error_line(node_proc):
    port = node_proc.address.rsplit(":", 1)[1]
    result = run_kvcache(["node", "--host", "127.0.0.1", "--port", port, "--capacity", "64KiB", "--page-bytes", "1024"])
    assert_one_clear_error(result, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert node_proc.alive()
    with NodeClient(node_proc.address) as client:
        assert client.info().page_bytes == 1024  # the first node still owns its port


def test_an_argument_that_is_not_a_number_is_refused_by_the_parser():
    result = run_kvcache(["node", "--port", "fifty"])
    assert result.returncode == 2
    assert "--port" in result.stderr and "Traceback" not in result.stderr


def test_a_node_with_a_put_stream_left_open_stops_within_its_grace(tmp_path):
    """A client that starts a PutPages stream and never ends it cannot keep the node from stopping."""
    release = threading.Event()

    def open_stream():
        yield wire.put_item(key(1), b"", bytes(NODE_PAGE_BYTES // 2))
        release.wait(timeout=15)  # bounded: the test sets it in its finally

    with node_process(tmp_path, "--capacity", "64KiB", "--page-bytes", "1024", "--grace", "0.5") as daemon:
        channel = raw_channel(daemon.address)
        try:
            future = channel.stream_unary(f"/{SERVICE_NAME}/PutPages", None, None).future(open_stream(), timeout=15)
            with NodeClient(daemon.address) as client:
                client.info()  # the node is up and the stream's first item is on its way
            time.sleep(0.2)
            started = time.monotonic()
            os.kill(daemon.pid, signal.SIGTERM)
            daemon.process.wait(timeout=10)
            assert daemon.process.returncode == 0, read_log(tmp_path)
            assert time.monotonic() - started < 5.0
            with pytest.raises(grpc.RpcError):
                future.result(timeout=5)
        finally:
            release.set()
            channel.close()


def test_a_node_that_refused_garbage_still_stops_cleanly(tmp_path):
    """grpcio's threaded server could leave a call on an unparsable stream message unfinished,
    and then never stop; the node parses tolerantly, answers, and stops."""
    with node_process(tmp_path, "--capacity", "64KiB", "--page-bytes", "1024", "--grace", "0.5") as daemon:
        channel = raw_channel(daemon.address)
        try:
            put = channel.stream_unary(f"/{SERVICE_NAME}/PutPages", None, None)
            for messages in ([b"\xff"], [b"\x0a\x10" + key(1), b"\xff\xff"]):
                with pytest.raises(grpc.RpcError) as raised:
                    put(iter(messages), timeout=5)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            channel.close()
        started = time.monotonic()
        os.kill(daemon.pid, signal.SIGTERM)
        daemon.process.wait(timeout=10)
        assert daemon.process.returncode == 0
        assert time.monotonic() - started < 5.0
