"""The HTTP server behind `--metrics-port`: prometheus_client's WSGI app, bounded, and on TLS
when the daemon is. A secure daemon (--tls-*) serves its metrics over HTTPS and wants mutual TLS
like its other ports: a scraper presents a `kvcache-monitor` certificate of the cluster's CA
(`kvcache certs` writes monitor.pem; Prometheus gives it as tls_config's cert_file and key_file).
Each connection takes the daemon's current certificate, so a SIGHUP reload applies to the next
scrape. A plaintext daemon serves plain HTTP to anyone, as its other ports do.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from base import addresses, security

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
TIMEOUT_S = 5.0
SCRAPER_ROLE = "monitor"
_PEER_ROLE = "kvcache.peer_role"


class MetricsServer:
    """Prometheus text at /metrics on host:port (0 picks a free port), on threads of its own."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 credentials: security.Credentials | None = None,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S):
        if not 0 <= port <= 65535:
            raise ValueError(f"--metrics-port must be between 0 and 65535, got {port}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        try:
            self._httpd = _Server(host, port, credentials, max_connections, timeout_s)
        except OSError as exc:
            raise OSError(f"cannot listen on {addresses.host_port(host, port)} for metrics: "
                          f"{exc.strerror or exc}") from None
        self._httpd.set_app(_only_scrapers(make_wsgi_app(registry)))
        self.host, self.port = host, self._httpd.server_port
        scheme = "https" if credentials is not None else "http"
        self.url = f"{scheme}://{addresses.host_port(host, self.port)}/metrics"
        self._thread: threading.Thread | None = None

    def start(self) -> "MetricsServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.5,), name="metrics-http",
                                        daemon=True)
        self._thread.start()
        log.info("metrics on %s%s", self.url,
                 f" (mutual TLS: scrapers present a kvcache-{SCRAPER_ROLE} certificate)"
                 if self._httpd.credentials is not None else "")
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, close every open connection, and wait for the threads (bounded)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout_s)
        self._httpd.server_close()
        self._httpd.close_connections(timeout_s)

    def num_connections(self) -> int:
        return self._httpd.num_connections()


class _Handler(WSGIRequestHandler):
    peer_role: str | None = None

    def setup(self) -> None:
        self.timeout = self.server.timeout_s  # each read and write (StreamRequestHandler sets it)
        if self.server.credentials is not None:
            self.request.settimeout(self.timeout)
            # On the connection's thread, never the accepting one: a peer that stalls in the handshake
            # holds only its own slot (and is the first to go). No client certificate: ssl.SSLError,
            # handled quietly.
            self.request.do_handshake()
            self.peer_role = security.socket_role(self.request)
        super().setup()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            self.server.answering(self.request)
        return parsed

    def get_environ(self) -> dict:
        environ = super().get_environ()
        environ[_PEER_ROLE] = self.peer_role
        return environ

    def log_message(self, format, *args) -> None:
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 64  # the listen backlog: a burst waits there, not in SYN retries (socketserver's is 5)

    def __init__(self, host: str, port: int, credentials, max_connections: int, timeout_s: float):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.credentials, self.max_connections, self.timeout_s = credentials, max_connections, timeout_s
        self._lock = threading.Lock()
        # At most max_connections at once, one thread each. A connection is "reading" from its accept
        # until its request line and headers arrived (TLS handshake included), then "answering"; one
        # more closes the one reading longest, so a flood of idle or slow peers cannot keep a scrape
        # out (see process_request). Each connection carries one request (wsgiref closes it after).
        self._reading: dict[socket.socket, float] = {}   # connection -> accepted at, oldest first
        self._answering: set[socket.socket] = set()
        super().__init__((host.strip("[]"), port), _Handler)

    def get_request(self):
        conn, address = super().get_request()
        conn.settimeout(self.timeout_s)
        if self.credentials is not None:  # no I/O here: the handshake is the connection thread's (_Handler.setup)
            conn = self.credentials.server_context().wrap_socket(conn, server_side=True,
                                                                 do_handshake_on_connect=False)
        return conn, address

    def process_request(self, request, client_address) -> None:
        with self._lock:
            if len(self._reading) + len(self._answering) >= self.max_connections:
                if not self._reading:  # every slot answers a scrape: this one waits for none
                    _close(request)
                    return
                oldest = next(iter(self._reading))
                del self._reading[oldest]
                _cut(oldest)  # its thread wakes, fails its read and ends
            self._reading[request] = time.monotonic()
        super().process_request(request, client_address)

    def answering(self, request) -> None:
        with self._lock:
            if self._reading.pop(request, None) is not None:
                self._answering.add(request)

    def shutdown_request(self, request) -> None:
        with self._lock:
            self._reading.pop(request, None)
            self._answering.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        # A peer that sent no TLS, the wrong certificate, garbage or nothing: its own failure,
        # not the daemon's; logging each would let a flood fill the log.
        log.debug("metrics connection from %s dropped", client_address, exc_info=True)

    def num_connections(self) -> int:
        with self._lock:
            return len(self._reading) + len(self._answering)

    def close_connections(self, timeout_s: float) -> None:
        with self._lock:
            open_ = [*self._reading, *self._answering]
        for conn in open_:
            _cut(conn)
        deadline = time.monotonic() + timeout_s
        while self.num_connections() and time.monotonic() < deadline:
            time.sleep(0.01)


def _cut(conn: socket.socket) -> None:
    """Wake whatever thread blocks on `conn`; the plain socket's shutdown, so an SSL object in
    use by that thread is left alone."""
    try:
        socket.socket.shutdown(conn, socket.SHUT_RDWR)
    except OSError:
        pass


def _close(conn: socket.socket) -> None:
    _cut(conn)
    conn.close()


def _only_scrapers(app):
    """The WSGI app, answering 403 to a TLS peer whose certificate is not a scraper's, naming the
    role it needs (a handshake without any client certificate fails before this)."""

    def guarded(environ, start_response):
        role = environ.get(_PEER_ROLE)
        if role is None or role == SCRAPER_ROLE:
            return app(environ, start_response)
        body = (f"metrics are for kvcache-{SCRAPER_ROLE} certificates: the caller's certificate is "
                f"{'for ' + role if role else 'not a kvcache certificate'}; give the scraper monitor.pem "
                f"and monitor.key from `kvcache certs`\n").encode()
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]

    return guarded
