"""One connection of the kvnode's data plane server (kvnode/data_plane/server.py), on the node's side:
its blocking socket I/O with kernel timeouts, the answer to a refused request, and the
listeners' helpers (the abstract Unix socket, for clients on the node's host).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
import uuid

import grpc

from kvnode.wire import data_frames as dw
from kvnode.data_plane.recv_buffers import ReceiveBuffer
from kvnode.wire.tls_stream import TlsStream

log = logging.getLogger("kvnode")

_DRAIN_LIMIT_BYTES = 512 * 2**20
_DRAIN_TIMEOUT_S = 1.0
# A recv while more than this share of the request's deadline is left keeps the whole timeout_s, so a
# request may take up to 1.1 x timeout_s: most arrive in a few ms and spare two setsockopt calls.
_KEEP_FULL_TIMEOUT = 0.9


class Dropped(Exception):
    """The peer went away, stalled or cut a request short: close without an answer."""


class Idle(Dropped):
    """No request for timeout_s: a pooled client connection, closed quietly (the client reconnects)."""


class Connection:
    """One peer's socket and its PUT buffer; blocking I/O with kernel timeouts."""

    def __init__(self, conn: socket.socket, timeout_s: float, buffer: ReceiveBuffer):
        self.conn = conn
        self.timeout_s = timeout_s
        self.pending = 0  # bytes of the current request not yet read
        self.buffer = buffer
        self._small = bytearray(dw.REQUEST.size)
        self.deadline: float | None = None  # the request's bytes arrive by then (see receive)
        self._shortened = False  # the receive timeout is less than timeout_s
        dw.set_no_delay(conn)
        dw.set_kernel_timeouts(conn, timeout_s)

    def receive(self, size: int, first: bool = False, into_buffer: bool = False) -> memoryview | None:
        """Exactly `size` bytes; None when `first` and the peer closed before sending any.

        A request's bytes must all arrive within timeout_s of its first: a kernel timeout bounds
        one recv only, and a peer trickling a byte every timeout_s - e would hold its PUT's bytes
        in flight (16 such peers blocked every PUT) and its connection without end. Each recv after
        the first gets what is left as its receive timeout (a TlsStream, the deadline for its own
        socket calls); a peer over it is dropped."""
        view = self.buffer.view(size) if into_buffer else memoryview(
            self._small if size <= len(self._small) else bytearray(size))[:size]
        if first:
            self._end_request()
        got = 0
        while got < size:
            self._limit(got)
            try:
                n = self.conn.recv_into(view[got:])
            except (BlockingIOError, socket.timeout):
                if first and got == 0:
                    raise Idle("idle for too long") from None
                raise Dropped(self._stalled(got, size)) from None
            except OSError as exc:
                raise Dropped(f"connection broke: {exc}") from None
            if n == 0:
                if first and got == 0:
                    return None
                raise Dropped(f"disconnected after {got} of {size} bytes of a request")
            if self.deadline is None:
                self.deadline = time.monotonic() + self.timeout_s  # the request's first bytes
            got += n
        return view

    def _limit(self, got: int) -> None:
        """The next recv's kernel timeout: what is left of the request's deadline, or timeout_s
        between requests."""
        if self.deadline is None:
            if self._shortened:
                dw.set_kernel_timeouts(self.conn, self.timeout_s, send=False)
                self._shortened = False
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Dropped(self._stalled(got, None))
        if left < _KEEP_FULL_TIMEOUT * self.timeout_s:
            dw.set_kernel_timeouts(self.conn, left, send=False)
            self._shortened = True
        if isinstance(self.conn, TlsStream):  # which shortens the receive timeout itself
            self.conn.deadline, self._shortened = self.deadline, True

    def _stalled(self, got: int, size: int | None) -> str:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"did not send its request within {self.timeout_s:g} s"
        return f"stalled after {got} of {size} bytes"

    def _end_request(self) -> None:
        """The request was received (or the next is awaited): no deadline. Once the reply is sent the
        wait for the next request has the whole timeout_s again (GET_SLOTS' RELEASE has its own)."""
        self.deadline = None
        if isinstance(self.conn, TlsStream):
            self.conn.deadline = None

    def send_parts(self, parts: list, deadline: float) -> None:
        self._end_request()
        try:
            dw.send_parts(self.conn, parts, deadline)
        except (BlockingIOError, socket.timeout):
            raise Dropped("did not read the reply in time") from None
        except OSError as exc:
            raise Dropped(f"connection broke while sending: {exc}") from None
        dw.set_kernel_timeouts(self.conn, self.timeout_s)  # send_parts shortened the send timeout
        self._shortened = False

    def send_with_fd(self, data: bytes, fd: int) -> None:
        """`data` with `fd` as SCM_RIGHTS ancillary data (a plain Unix socket only)."""
        self.send(data, fd)

    def send(self, data, fd: int | None = None) -> None:
        self._end_request()
        try:
            sent = 0 if fd is None else socket.send_fds(self.conn, [data], [fd])
            if sent < len(data):
                self.conn.sendall(memoryview(data)[sent:])
        except (BlockingIOError, socket.timeout):
            raise Dropped("stopped reading the reply") from None
        except OSError as exc:
            raise Dropped(f"connection broke while sending: {exc}") from None


def refuse(conn: socket.socket, code: grpc.StatusCode, message: str, pending: int) -> None:
    """Answer `code`, then close. While the rest of the request may still be coming, first stop
    sending and read away up to `pending` bytes of it (bounded in bytes and time), so the answer is
    not lost to a reset."""
    try:
        conn.sendall(dw.error_reply(code, message))
        conn.shutdown(socket.SHUT_WR)
        if pending > 0:
            conn.settimeout(_DRAIN_TIMEOUT_S)
            sink = bytearray(min(pending, 1 << 20))
            left, deadline = min(pending, _DRAIN_LIMIT_BYTES), time.monotonic() + _DRAIN_TIMEOUT_S
            while left > 0 and time.monotonic() < deadline:
                n = conn.recv_into(sink, min(left, len(sink)))
                if n == 0:
                    break
                left -= n
    except OSError:
        pass  # the peer is gone: nothing more to tell it
    finally:
        conn.close()


def new_unix_name() -> str:
    """A random name for the abstract Unix socket: no local process can bind it before the node."""
    return "kvcache-data-" + uuid.uuid4().hex


def unix_listener() -> socket.socket | None:
    """A listening abstract Unix socket under a random name, or None where there is none."""
    if not hasattr(socket, "AF_UNIX"):
        return None
    name = new_unix_name()
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as exc:  # a sandbox that forbids unix sockets
        log.info("data plane: no unix socket beside TCP (%s)", exc)
        return None
    try:
        listener.bind(b"\0" + name.encode("ascii"))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            log.warning("data plane: the abstract unix socket name @%s is held by another process; serving on TCP "
                        "only (Info advertises no unix socket). `ss -xlp` names its holder", name)
        else:  # not Linux (no abstract names), or a sandbox that forbids them
            log.info("data plane: no unix socket beside TCP (%s)", exc)
        return None
    listener.settimeout(0.2)  # the accept loop wakes to see stop()
    return listener


def shutdown_all(connections) -> None:
    """Shut down every socket of `connections`, waking the threads serving them."""
    for conn in connections:
        try:
            conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
        except OSError:
            pass
