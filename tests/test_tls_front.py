"""A coordinator's TLS front (base/tls_front.py), in-process before a plain gRPC server: a client
certificate is asked for, checked and named to the handlers, but not required; bytes go through
whole both ways, large messages and long streams too; records of closed connections go; new
handshakes take re-read files; a silent connection is dropped after the handshake's bound."""

from __future__ import annotations

import logging
import shutil
import socket
from concurrent import futures

import grpc
import pytest

from base import security, tls_front
from base.tls_front import TlsFront, listen
from cluster_helpers import wait_for
from kvcache.certs import make_certs

MIB = 1 << 20
OPTIONS = [("grpc.max_send_message_length", 16 * MIB), ("grpc.max_receive_message_length", 16 * MIB)]


class _Handlers(grpc.GenericRpcHandler):
    def __init__(self):
        self.front: TlsFront | None = None

    def service(self, details):
        if details.method == "/t/Role":
            return grpc.unary_unary_rpc_method_handler(lambda request, context: self.front.peer_role(context).encode())
        if details.method == "/t/Echo":
            return grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        if details.method == "/t/Stream":
            def stream(request, context):
                count, size = int.from_bytes(request[:4], "big"), int.from_bytes(request[4:], "big")
                for i in range(count):
                    yield bytes([i % 256]) * size
            return grpc.unary_stream_rpc_method_handler(stream)
        return None


def start_front(files) -> tuple[TlsFront, grpc.Server]:
    handlers = _Handlers()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers((handlers,))
    inner = server.add_insecure_port("127.0.0.1:0")
    server.start()
    credentials = security.Credentials(files / "ca.pem", files / "coordinator.pem", files / "coordinator.key")
    front = TlsFront(credentials, listen("127.0.0.1", 0), inner, logging.getLogger("test-front"))
    handlers.front = front
    try:
        front.start()
    except BaseException:
        server.stop(0)
        raise
    return front, server


@pytest.fixture
def front(certs):
    started, server = start_front(certs)
    try:
        yield started
    finally:
        server.stop(0).wait(5)
        started.stop()


def channel(front: TlsFront, files, role: str | None = None) -> grpc.Channel:
    ca = (files / "ca.pem").read_bytes()
    pair = ((files / f"{role}.key").read_bytes(), (files / f"{role}.pem").read_bytes()) if role else (None, None)
    return grpc.secure_channel(f"127.0.0.1:{front.port}", grpc.ssl_channel_credentials(ca, *pair), options=OPTIONS)


def role_seen(front: TlsFront, files, role: str | None) -> str:
    with channel(front, files, role) as ch:
        return ch.unary_unary("/t/Role")(b"", timeout=5).decode()


def test_a_certificate_is_asked_for_checked_and_named_but_not_required(front, certs, tmp_path):
    assert role_seen(front, certs, None) == security.NO_CERTIFICATE
    assert role_seen(front, certs, "client") == "client"
    assert role_seen(front, certs, "worker") == "worker"
    make_certs(tmp_path / "other")
    foreign = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), (tmp_path / "other" / "worker.key").read_bytes(),
                                           (tmp_path / "other" / "worker.pem").read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{front.port}", foreign) as ch, pytest.raises(grpc.RpcError) as refused:
        ch.unary_unary("/t/Role")(b"", timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_for(lambda: not front._roles, timeout_s=5), "a closed connection's record stays"


def test_large_messages_and_long_streams_pass_whole_both_ways(front, certs):
    payload = bytes(range(256)) * (6 * MIB // 256)
    with channel(front, certs, "client") as ch:
        assert ch.unary_unary("/t/Echo")(payload, timeout=30) == payload
        chunks = list(ch.unary_stream("/t/Stream")((300).to_bytes(4, "big") + (64 * 1024).to_bytes(4, "big"),
                                                   timeout=30))
    assert len(chunks) == 300 and all(chunk == bytes([i % 256]) * 65536 for i, chunk in enumerate(chunks))


def test_new_handshakes_take_the_files_re_read(certs, tmp_path):
    old, new, live = certs, tmp_path / "new", tmp_path / "live"
    make_certs(new)
    shutil.copytree(old, live)
    started, server = start_front(live)
    try:
        assert role_seen(started, old, "worker") == "worker"
        for name in ("ca.pem", "coordinator.pem", "coordinator.key"):
            shutil.copy(new / name, live / name)
        started.credentials.load()  # what SIGHUP does
        assert role_seen(started, new, "worker") == "worker"
        with pytest.raises(grpc.RpcError):
            role_seen(started, old, "worker")
    finally:
        server.stop(0).wait(5)
        started.stop()


def test_a_silent_or_plaintext_connection_is_dropped_with_one_line(front, monkeypatch, caplog):
    monkeypatch.setattr(tls_front, "HANDSHAKE_TIMEOUT_S", 0.5)
    with caplog.at_level(logging.INFO, logger="test-front"):
        with socket.create_connection(("127.0.0.1", front.port), timeout=5) as silent:
            assert silent.recv(1) == b""  # closed by the front within its bound, not by our timeout
        with socket.create_connection(("127.0.0.1", front.port), timeout=5) as plain:
            plain.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            try:
                assert plain.recv(1) in (b"", b"\x15")  # closed, or a TLS alert first
            except ConnectionResetError:
                pass
    lines = [r.getMessage() for r in caplog.records if "TLS handshake(s)" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("refused 1 TLS handshake(s) since the last such line"), lines
