"""The gateway's connections, in front of uvicorn's HTTP protocol: each must send a request's
headers within a time, and on an HTTPS port a plain HTTP request gets a 400 saying to use https://.

Request heads in time: uvicorn times nothing out before a connection's first request, nor a
request's headers arriving a byte at a time: such connections were held forever, and its
connection limit (the gateway's --max-streams * 2 + 16) let a few hundred of them refuse everyone
with 503. So a connection that has not sent a whole request head within `header_timeout_s` of
opening, or of its previous response's end, is closed. Between requests uvicorn's keep-alive timeout
(5 s) closes an idle one; a body is bounded by the app (gateway/bodies.py, 408).

HTTPS or plain HTTP: uvicorn given a certificate lets asyncio run TLS on every connection, and a
plain HTTP request fails the handshake with no answer (curl: "Empty reply from server"). Here the
guard reads the connection's first bytes: a TLS record (0x16, a handshake) hands the connection to
asyncio's TLS layer (its SSLProtocol, fed those bytes first: loop.start_tls cannot take bytes
read already, and uvloop reads before a new connection's protocol can pause it), anything else
is read as plain HTTP and answered 400 in OpenAI's error shape, then closed.

Between requests: the guard stays between the transport and uvicorn's protocol to see where
request heads end. Whether uvicorn is between requests is read from its protocol's `cycle` (its current
request, None before the first); a uvicorn without it gets the first request's bound alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
from asyncio import sslproto
from typing import Callable

from base.log_limits import CountedEvent
from gateway.errors import ApiError

log = logging.getLogger("gateway")

_TLS_HANDSHAKE = 0x16        # the first byte of a TLS record that opens a handshake
_HEAD_END = b"\r\n\r\n"
_PLAIN_HEAD_MAX = 64 * 1024  # what is read of a plain HTTP request before its 400


def guarded(inner: type[asyncio.Protocol], header_timeout_s: float,
            tls: Callable[[], ssl.SSLContext] | None = None) -> type:
    """A protocol class for uvicorn.Config(http=...): `inner` (uvicorn's) behind the guard; `tls()`
    the HTTPS context for each new connection (Credentials.https_context: a SIGHUP's reload reaches
    new connections)."""
    slow, plain = CountedEvent(), CountedEvent()

    class Guard(_Guard):
        def __init__(self, **kwargs):
            super().__init__(inner(**kwargs), kwargs.get("_loop") or asyncio.get_running_loop(),
                             header_timeout_s, tls, slow, plain)

    return Guard


class _Guard(asyncio.Protocol):
    def __init__(self, inner: asyncio.Protocol, loop: asyncio.AbstractEventLoop, header_timeout_s: float,
                 tls: Callable[[], ssl.SSLContext] | None, slow: CountedEvent, plain: CountedEvent):
        self.inner = inner
        self.loop = loop
        self.header_timeout_s = header_timeout_s
        self.tls = tls
        self._slow, self._plain = slow, plain
        self.raw: asyncio.Transport | None = None
        self.attached = False        # inner has had connection_made
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""              # the last bytes of a request head so far, to find its end across chunks
        self.closed = False

    # ---- asyncio.Protocol, for the raw connection, then (TLS) for the TLS layer over it ---------

    def connection_made(self, transport: asyncio.Transport) -> None:
        if self.raw is not None:   # the TLS layer's, once its handshake is done
            self._attach(transport)
            return
        self.raw = transport
        self._arm()
        if self.tls is None:
            self._attach(transport)

    def data_received(self, data: bytes) -> None:
        if not self.attached:   # HTTPS: the connection's first bytes tell TLS from plain HTTP
            self._https_or_plain(data)
            return
        self._watch(data)
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.attached else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        if self.attached:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.attached:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.attached:
            self.inner.resume_writing()

    # ---- request heads in time ------------------------------------------------------------

    def _arm(self) -> None:
        self.tail = b""
        self.timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _watch(self, data: bytes) -> None:
        if self.timer is None and _between_requests(self.inner):
            self._arm()   # a new request begins with these bytes
        if self.timer is not None:
            seen = self.tail + data
            if _HEAD_END in seen:
                self._disarm()
            else:
                self.tail = seen[-(len(_HEAD_END) - 1):]

    def _too_slow(self) -> None:
        self.timer = None
        if self.closed or self.raw.is_closing():
            return
        self._slow.happened()
        if count := self._slow.to_log():
            log.info("%d connection(s) closed since the last such line: no whole request head within %gs",
                     count, self.header_timeout_s)
        self.raw.abort()

    # ---- HTTPS or plain HTTP ------------------------------------------------------------

    def _https_or_plain(self, first: bytes) -> None:
        if first[0] == _TLS_HANDSHAKE:
            # The TLS layer takes the connection, these bytes first, and opens the guard (_attach)
            # once the handshake is done, as loop.start_tls would but for the bytes read already.
            layer = sslproto.SSLProtocol(self.loop, self, self.tls(), None, server_side=True,
                                         ssl_handshake_timeout=self.header_timeout_s)
            self.raw.set_protocol(layer)
            layer.connection_made(self.raw)
            _feed(layer, first)
            return
        self._plain.happened()
        if count := self._plain.to_log():
            log.info("%d plain HTTP request(s) on this HTTPS port answered 400 since the last such line", count)
        refusal = _PlainRefusal(self.raw)
        self.raw.set_protocol(refusal)
        refusal.data_received(first)

    def _attach(self, transport: asyncio.Transport) -> None:
        self.attached = True
        self.inner.connection_made(transport)


def _feed(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    view = memoryview(data)
    while view:
        buffer = protocol.get_buffer(len(view))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        protocol.buffer_updated(size)
        view = view[size:]


class _PlainRefusal(asyncio.Protocol):
    """A plain HTTP request on the HTTPS port: its head read, a 400 sent, the connection closed."""

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.head = b""

    def data_received(self, data: bytes) -> None:
        self.head += data
        if _HEAD_END in self.head or len(self.head) > _PLAIN_HEAD_MAX:
            self.transport.pause_reading()
            body = json.dumps(ApiError(400, f"this port serves HTTPS only: send the request to "
                                            f"{_https_url(self.head)}, not http://").body(),
                              separators=(",", ":")).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    def eof_received(self):
        return None


def _https_url(head: bytes) -> str:
    """https:// and the Host and path of a plain request's head, where they are plain enough to repeat."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    host = next((line[5:].strip() for line in lines[1:] if line[:5].lower() == b"host:"), b"")
    path = parts[1] if len(parts) == 3 and parts[1].startswith(b"/") else b"/"
    if not _PLAIN_HOST.fullmatch(host) or not _PLAIN_PATH.fullmatch(path):
        return "https://"
    return f"https://{host.decode()}{path.decode()}"


_PLAIN_HOST = re.compile(rb"[A-Za-z0-9.:\[\]-]{1,255}")
_PLAIN_PATH = re.compile(rb"/[A-Za-z0-9._~/%?=&+-]{0,200}")


class LimitedWarnings(logging.Filter):
    """uvicorn's line per odd request ("Invalid HTTP request received.") as one line per interval
    with their count, as the gateway's own (base/log_limits.py): a client cannot flood the log.
    Its traceback of a request that failed is left out: the app logged it, naming the request."""

    MAX_KINDS = 32

    def __init__(self):
        super().__init__()
        self.kinds: dict[str, CountedEvent] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Exception in ASGI application"):
            return False   # the app's own line said it, with the request (gateway/app.py)
        if record.levelno != logging.WARNING:
            return True
        message = record.getMessage()
        if message not in self.kinds and len(self.kinds) >= self.MAX_KINDS:
            return True
        event = self.kinds.setdefault(message, CountedEvent())
        event.happened()
        count = event.to_log()
        if count:
            record.msg, record.args = f"{count} time(s) since the last such line: {message}", ()
        return bool(count)


def _between_requests(inner: asyncio.Protocol) -> bool:
    """uvicorn's protocol has answered its last request and waits for the next (read from its `cycle`)."""
    cycle = getattr(inner, "cycle", False)
    return cycle is not False and cycle is not None and cycle.response_complete
