"""SIGTERM drains a real `kvcache node`: a data plane transfer and a gRPC call running when the
signal arrives finish, nothing new is taken meanwhile, and the process exits 0 within
--drain-timeout with one line saying what it drained; a transfer that outlasts the timeout is cut."""

from __future__ import annotations

import contextlib
import os
import signal
import socket

import grpc
import numpy as np
import pytest

from cluster_helpers import node_process, raw_channel, read_log, run_kvcache, wait_for
from kvnode.wire import data_frames as dw
from kvnode.wire import grpc_frames as wire
from kvnode.client import NodeClient
from kvnode.service import SERVICE_NAME
from protos import kvcache_pb2 as pb
from store_helpers import key

PAGE_BYTES = 1 << 20
PAGES = 16  # a 16 MiB reply: more than loopback's socket buffers hold, so its send is still running
ARGS = ("--capacity", "20MiB", "--page-bytes", str(PAGE_BYTES), "--max-message-bytes", "2MiB")


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


@contextlib.contextmanager
def slow_reader(port: int):
    """A data plane connection with a small receive buffer, so the node's send waits for our reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.settimeout(20)
    try:
        sock.connect(("127.0.0.1", port))
        yield sock
    finally:
        sock.close()


def stored_pages(client: NodeClient) -> tuple[list[bytes], bytes]:
    keys = [key(i) for i in range(PAGES)]
    data = np.random.default_rng(7).integers(0, 256, size=(PAGES, PAGE_BYTES), dtype=np.uint8)
    assert client.put_pages(keys, [b""] + keys[:-1], data).stored == PAGES
    return keys, data.tobytes()


def start_get(sock: socket.socket, keys: list[bytes]) -> None:
    """Send a GET of `keys` and read its reply header only: the node is now mid-transfer."""
    sock.sendall(dw.get_request(keys))
    code, message_bytes, payload = dw.parse_reply_header(read_exactly(sock, dw.REPLY.size))
    assert (code, message_bytes, payload) == (grpc.StatusCode.OK, 0, len(keys) * (16 + PAGE_BYTES))  # checksums, pages


def not_taken(port: int, keys: list[bytes]) -> bool:
    """A new data plane request is refused: no connection, closed unanswered, or UNAVAILABLE
    (a connection the node accepted just before its drain began)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as late:
            late.sendall(dw.get_request(keys))
            code, _, _ = dw.parse_reply_header(read_exactly(late, dw.REPLY.size))
            return code == grpc.StatusCode.UNAVAILABLE
    except OSError:
        return True


def test_running_transfers_finish_after_sigterm_and_the_node_exits_0(tmp_path):
    with node_process(tmp_path, *ARGS, "--drain-timeout", "20") as daemon:
        with NodeClient(daemon.address) as client:
            keys, expected = stored_pages(client)
            port = client.info().data_port
        channel = raw_channel(daemon.address)
        put = channel.stream_unary(f"/{SERVICE_NAME}/PutPages", None, pb.PutReply.FromString)
        sent_first, send_last = [], []

        def put_stream():  # a gRPC call running across the signal: its last item comes after it
            yield wire.put_item(key(100), keys[-1], bytes(PAGE_BYTES // 2))
            sent_first.append(True)
            assert wait_for(lambda: send_last, timeout_s=15)
            yield wire.put_item(b"", b"", bytes(PAGE_BYTES // 2), last=True)

        try:
            with slow_reader(port) as sock:
                start_get(sock, keys)
                future = put.future(put_stream(), timeout=20)
                assert wait_for(lambda: sent_first, timeout_s=10)
                os.kill(daemon.pid, signal.SIGTERM)
                assert wait_for(lambda: "stopping: draining" in read_log(tmp_path), timeout_s=10), read_log(tmp_path)

                # Nothing new is taken while draining: no new connection, no new call.
                assert not_taken(port, keys[:1])
                with pytest.raises(grpc.RpcError):
                    channel.unary_unary(f"/{SERVICE_NAME}/Info", pb.InfoRequest.SerializeToString,
                                        pb.NodeInfo.FromString)(pb.InfoRequest(), timeout=5)

                assert read_exactly(sock, PAGES * (16 + PAGE_BYTES))[PAGES * 16 :] == expected  # the GET completes
                send_last.append(True)
                assert list(future.result(timeout=15).outcomes) == [pb.PutReply.STORED]  # so does the put
            daemon.process.wait(timeout=25)  # within the drain timeout, and then some to exit
        finally:
            send_last.append(True)
            channel.close()
        assert daemon.process.returncode == 0, read_log(tmp_path)
    log = read_log(tmp_path)
    assert "1 data plane transfers finished, 0 cut; 1 gRPC calls were running, 0 still at the end" in log, log
    assert "Traceback" not in log


def test_a_transfer_that_outlasts_the_drain_timeout_is_cut(tmp_path):
    with node_process(tmp_path, *ARGS, "--drain-timeout", "1") as daemon:
        with NodeClient(daemon.address) as client:
            keys, _ = stored_pages(client)
            port = client.info().data_port
        with slow_reader(port) as sock:
            start_get(sock, keys)
            os.kill(daemon.pid, signal.SIGTERM)  # and never read the rest
            daemon.process.wait(timeout=15)
        assert daemon.process.returncode == 0, read_log(tmp_path)
    log = read_log(tmp_path)
    assert "0 data plane transfers finished, 1 cut" in log, log
    assert "Traceback" not in log


def test_a_negative_drain_timeout_is_one_clear_error_line():
    result = run_kvcache(["node", "--port", "0", "--capacity", "64KiB", "--page-bytes", "1024",
                          "--drain-timeout", "-1"])
    assert result.returncode == 2
    assert result.stderr.strip() == "kvcache node: error: --drain-timeout must not be negative, got -1.0"
