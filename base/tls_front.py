"""A coordinator's port under TLS: the handshake in Python, the calls in gRPC behind it, so a client
certificate is asked for but not required.

A coordinator serves members, whose certificates say who they are, and clients, which need only the
cluster's CA and a token. grpcio's Python server either requires a client certificate or never asks
for one (base/security.py), and one that never asks cannot tell a member from a stranger; Python's
ssl can ask and check one without requiring it (CERT_OPTIONAL: a certificate, when given, must be
the CA's). So a coordinator with --tls-* listens here: the front runs the handshake (ALPN h2, as
gRPC's own TLS) and relays the bytes both ways to the coordinator's gRPC server on a loopback port
of its own, plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading

from base import security, serving
from base.log_limits import CountedEvent

HANDSHAKE_TIMEOUT_S = 10.0
START_TIMEOUT_S = 10.0


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to (as gRPC binds), all on one port
    (port 0: the first one's); OSError saying why when none can be bound."""
    where = serving.host_port(host, port)
    reason = serving._why_unbindable(host.strip("[]"), port)
    if reason:
        raise OSError(f"cannot listen on {where}: {reason}")
    found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    families = {family for family, *_ in found}
    sockets: list[socket.socket] = []
    for family, kind, _, _, address in dict.fromkeys((f, k, p, c, a) for f, k, p, c, a in found):
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP.
        sock = socket.socket(family, kind, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and socket.AF_INET in families:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if sockets:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            if sockets:
                continue  # as gRPC: the port serves if any address of the host could be bound
            raise OSError(f"cannot listen on {where}: is the port taken?") from None
        sockets.append(sock)
    return sockets


class TlsFront:
    """TLS on `sockets` (from listen()) for the plaintext gRPC server on 127.0.0.1:`inner_port`.

    One asyncio loop on a thread of its own carries every connection, with backpressure both ways
    (a side whose peer's send buffer is full stops reading). A coordinator's traffic is small
    (prompts, token events, heartbeats): pages never pass through it."""

    def __init__(self, credentials: security.Credentials, sockets: list[socket.socket], inner_port: int,
                 logger: logging.Logger):
        self.credentials = credentials
        self.port = sockets[0].getsockname()[1]
        self._sockets = sockets
        self._inner = ("127.0.0.1", inner_port)
        self._log = logger
        self._roles: dict[str, str] = {}  # the inner connection's peer address -> its caller's role (peer_role)
        self._lock = threading.Lock()
        self._refused = CountedEvent()
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[_Outer] = set()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tls-front", daemon=True)

    # ---- what the coordinator calls -------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._failed is not None:
            raise OSError(f"the TLS port did not start: {self._failed or 'no answer'}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the port and every connection (after the gRPC server stopped, so calls ended)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)

    def peer_role(self, context) -> str:
        """The role in the certificate of the call's client (security.NO_CERTIFICATE for none, "" for
        a certificate not of a kvcache role).

        The front connects to the gRPC port from a loopback port it binds first and records that
        port with the role (_accept), found again here by the call's peer address. A connection to
        the inner port the front did not make (another local process) has no record and counts as
        one without a certificate: what anyone who reaches the public port can be. A record goes
        when its connection closes."""
        with self._lock:
            return self._roles.get(context.peer(), security.NO_CERTIFICATE)

    # ---- the loop's thread ------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            for sock in self._sockets:
                self._servers.append(self._loop.run_until_complete(
                    self._loop.create_server(lambda: _Outer(self), sock=sock)))
        except BaseException as exc:  # noqa: BLE001 - said by start()
            self._failed = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            for server in self._servers:
                server.close()
            for connection in list(self._connections):
                connection.close()
            pending = asyncio.all_tasks(self._loop)  # handshakes under way
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, asyncio.sleep(0), return_exceptions=True))
            self._loop.close()

    async def _accept(self, outer: "_Outer") -> None:
        """The handshake, with the credentials' current context (re-read on SIGHUP: new connections
        use it) and at most HANDSHAKE_TIMEOUT_S; then the connection to the gRPC port, its role
        recorded. A failed handshake (a plaintext client, a certificate of another CA) closes the
        connection, said in one log line per interval with the count (_refusal)."""
        plain = outer.transport
        peer = plain.get_extra_info("peername")
        try:
            tls = await self._loop.start_tls(plain, outer, self.credentials.front_context(), server_side=True,
                                             ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except asyncio.CancelledError:
            plain.close()
            raise
        except Exception as exc:  # noqa: BLE001 - a peer's failed handshake, whatever it raised
            plain.close()
            self._connections.discard(outer)
            self._refusal(peer, exc)
            return
        outer.transport = tls  # what the gRPC server sends goes here from now (its settings come at once)
        role = _role_of_cert(tls.get_extra_info("peercert"))
        inner = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        inner.setblocking(False)
        try:
            inner.bind(("127.0.0.1", 0))
            key = f"ipv4:127.0.0.1:{inner.getsockname()[1]}"
            with self._lock:
                self._roles[key] = role
            outer.key = key
            await self._loop.sock_connect(inner, self._inner)
            await self._loop.create_connection(lambda: _Inner(outer), sock=inner)
        except OSError as exc:
            inner.close()
            tls.close()
            self._forget(outer)
            self._log.warning("could not reach this coordinator's own gRPC port %s:%d (%s); the connection from "
                              "%s is dropped", *self._inner, exc.strerror or exc, _where(peer))
            return
        outer.attach()

    def _forget(self, outer: "_Outer") -> None:
        if outer.key is not None:
            with self._lock:
                self._roles.pop(outer.key, None)

    def _refusal(self, peer, exc: Exception) -> None:
        self._refused.happened()
        count = self._refused.to_log()
        if count:
            self._log.info("refused %d TLS handshake(s) since the last such line, the last from %s: %s", count,
                           _where(peer), _handshake_reason(exc))


class _Outer(asyncio.Protocol):
    """The client's connection: plain TCP until the handshake, then TLS (asyncio's start_tls)."""

    def __init__(self, front: TlsFront):
        self.front = front
        self.transport: asyncio.BaseTransport | None = None
        self.inner: asyncio.Transport | None = None
        self.key: str | None = None
        self._pending: list[bytes] = []
        self._attached = False
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.front._connections.add(self)
        transport.pause_reading()  # start_tls reads the handshake itself
        self.front._loop.create_task(self.front._accept(self))

    def attach(self) -> None:
        """The inner connection is up: what came before it goes first, then the rest as it comes."""
        if self.closed:
            self.inner.close()
            return
        self._attached = True
        for data in self._pending:
            self.inner.write(data)
        self._pending.clear()

    def data_received(self, data: bytes) -> None:
        if self._attached:
            self.inner.write(data)
        else:
            self._pending.append(data)  # the inner connection is not up yet

    def eof_received(self):
        return None  # close: gRPC ends its streams in HTTP/2, not with a half-closed socket

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_reading()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_reading()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.front._connections.discard(self)
        if self.inner is not None:
            self.inner.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if self.inner is not None:
            self.inner.close()


class _Inner(asyncio.Protocol):
    """The front's connection to the coordinator's gRPC port, for one client connection."""

    def __init__(self, outer: _Outer):
        self.outer = outer

    def connection_made(self, transport) -> None:
        self.outer.inner = transport

    def data_received(self, data: bytes) -> None:
        self.outer.transport.write(data)

    def eof_received(self):
        return None

    def pause_writing(self) -> None:
        self.outer.transport.pause_reading()

    def resume_writing(self) -> None:
        self.outer.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        self.outer.front._forget(self.outer)
        self.outer.transport.close()


def _role_of_cert(cert: dict | None) -> str:
    if not cert:
        return security.NO_CERTIFICATE
    subject = dict(item for entry in cert.get("subject", ()) for item in entry)
    return security.role_of_common_name(subject.get("commonName", ""))


def _where(peer) -> str:
    return serving.host_port(peer[0], peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else "?"


def _handshake_reason(exc: Exception) -> str:
    text = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    if "WRONG_VERSION_NUMBER" in text.upper() or "HTTP_REQUEST" in text.upper():
        return "not TLS (a plaintext client?)"
    if "CERTIFICATE" in text.upper():
        return f"its certificate was refused ({text})"
    return text
