"""The metrics port's HTTP server (base/metrics_server.py) on real loopback sockets: bounded
connections and threads, a flood of idle or half-sent connections does not keep a scrape out,
a silent peer is dropped, and stop closes everything it opened."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from metrics_helpers import scrape, tls_context
from base import security
from base.metrics_server import MetricsServer

CAP = 4


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("kvcache_test_scrapes", "a counter to find in the scrape", registry=registry).inc(3)
    return registry


@pytest.fixture(params=["plaintext", "tls"])
def server(request, registry, certs):
    credentials = None
    if request.param == "tls":
        credentials = security.Credentials(certs / "ca.pem", certs / "node.pem", certs / "node.key")
    server = MetricsServer(registry, "127.0.0.1", 0, credentials, max_connections=CAP, timeout_s=30.0).start()
    server.context = tls_context(certs / "ca.pem", certs / "monitor.pem", certs / "monitor.key") if credentials else None
    yield server
    server.stop()


def metrics_threads() -> int:
    """Connection threads of metrics servers (socketserver names them after their target)."""
    return sum(1 for t in threading.enumerate() if "process_request_thread" in t.name)


def test_a_flood_of_idle_and_half_sent_connections_holds_at_most_the_cap_and_a_scrape_still_succeeds(server):
    threads_before = metrics_threads()
    with contextlib.ExitStack() as stack:
        for i in range(5 * CAP):
            conn = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            if i % 2:
                conn.sendall(b"GET /metr")  # a request line that never ends
        time.sleep(0.3)  # the server has accepted what it will (timeout_s is 30 s: nothing timed out)
        assert server.num_connections() <= CAP
        assert metrics_threads() - threads_before <= CAP
        for _ in range(3):
            assert scrape(server.url, context=server.context).value("kvcache_test_scrapes_total") == 3
        assert server.num_connections() <= CAP
        assert metrics_threads() - threads_before <= CAP


def test_a_peer_that_sends_nothing_is_dropped_after_the_read_timeout(registry):
    server = MetricsServer(registry, "127.0.0.1", 0, max_connections=CAP, timeout_s=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            assert conn.recv(1) == b""  # closed by the server (the 10 s of the client's own timeout not reached)
        assert scrape(server.url).value("kvcache_test_scrapes_total") == 3
    finally:
        server.stop()


def test_stop_closes_open_connections_and_the_port(registry):
    server = MetricsServer(registry, "127.0.0.1", 0, max_connections=CAP, timeout_s=30.0).start()
    threads_before = metrics_threads()
    conns = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(CAP)]
    try:
        assert wait_until(lambda: server.num_connections() == CAP)
        server.stop(timeout_s=5.0)
        assert server.num_connections() == 0
        for conn in conns:
            assert conn.recv(1) == b""
        assert not any(t.name == "metrics-http" for t in threading.enumerate())
        assert wait_until(lambda: metrics_threads() <= threads_before)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    finally:
        for conn in conns:
            conn.close()


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
