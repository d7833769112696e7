"""One request's I/O on a data plane connection, for the client side (data_client.py):
send it, read its reply's header (an OK reply's payload length, or the node's status and message,
raised as DataPlaneError), receive the payload straight into the caller's buffers. Sockets are
blocking with kernel timeouts, and the deadline is checked after every recv.
"""

from __future__ import annotations

import socket
import time

import grpc

from kvnode.wire import data_frames as dw

_MAX_MESSAGE_BYTES = 64 << 10  # of a node's error message read


class DataPlaneError(Exception):
    """`code` is a grpc.StatusCode; `connect_failed` says no connection could be opened at all;
    `closed_unanswered` that a new connection was closed (or reset) before any byte of a reply,
    which is how a refusal of a node at its connection limit can arrive: its answer is lost when
    it closes before reading our request (the kernel then resets the connection)."""

    def __init__(self, code: grpc.StatusCode, details: str, connect_failed: bool = False,
                 closed_unanswered: bool = False):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.connect_failed = connect_failed
        self.closed_unanswered = closed_unanswered


class NothingReceived(DataPlaneError):
    """The peer closed (or reset) the connection before the first byte of a reply."""


class StaleConnection(Exception):
    """A reused connection the node had closed while idle (data_client.py): send again on a new one."""


def send_request(sock: socket.socket, parts: list, deadline: float, reused: bool, address: str) -> None:
    """Send a request's `parts` by `deadline`; a node that refused and closed early raises its answer."""
    try:
        dw.send_parts(sock, parts, deadline)
    except (BlockingIOError, socket.timeout):
        raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "sending the request timed out") from None
    except OSError as exc:
        # The node may have refused early and closed: its answer says why, if it arrived.
        reply_header(sock, deadline, reused, address, broken=exc)


def reply_header(sock: socket.socket, deadline: float, reused: bool, address: str,
                 broken: OSError | None = None) -> int:
    """The payload length of an OK reply; raises the node's status otherwise."""
    header = memoryview(bytearray(dw.REPLY.size))
    try:
        receive(sock, header, deadline, first=True)
    except NothingReceived as exc:
        if reused:
            raise StaleConnection() from None  # an idle connection the node had closed
        raise DataPlaneError(grpc.StatusCode.UNAVAILABLE,
                             f"connection to {address} closed before a reply: {broken or exc}",
                             closed_unanswered=True) from None
    if broken is not None and dw.parse_reply_header(header)[0] == grpc.StatusCode.OK:
        raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection broke while sending: {broken}")
    return payload_or_status(sock, header, deadline)


def payload_or_status(sock: socket.socket, header, deadline: float) -> int:
    """An OK reply header's payload length; else the node's status and message, raised."""
    code, message_bytes, payload = dw.parse_reply_header(header)
    if code == grpc.StatusCode.OK:
        return payload
    message = memoryview(bytearray(min(message_bytes, _MAX_MESSAGE_BYTES)))
    try:
        receive(sock, message, deadline)
        details = bytes(message).decode("utf-8", errors="replace")
    except DataPlaneError:
        details = "(the node's message was cut off)"
    raise DataPlaneError(code, details)


def receive(sock: socket.socket, view: memoryview, deadline: float, first: bool = False) -> None:
    """Fill `view` from `sock`; NothingReceived when `first` and the peer closed before any byte."""
    got, size = 0, view.nbytes
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, socket.timeout):
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out after {got} of {size} bytes") from None
        except OSError as exc:
            if first and got == 0:
                raise NothingReceived(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection broke after {got} of {size} bytes: {exc}") from None
        if n == 0:
            if first and got == 0:
                raise NothingReceived(grpc.StatusCode.UNAVAILABLE, "closed by the node")
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection closed after {got} of {size} bytes")
        got += n
        if got < size and time.monotonic() > deadline:
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed after {got} of {size} bytes")


def receive_scattered(sock, views: list[memoryview], deadline: float) -> None:
    """Fill `views` in order from `sock`: a plain socket scatters each recv over many of them
    (recvmsg_into), so a band of many pages costs a few calls, not one a page."""
    if not hasattr(sock, "recvmsg_into"):  # a TlsStream decrypts into one buffer at a time
        for view in views:
            receive(sock, view, deadline)
        return
    first, total = 0, sum(view.nbytes for view in views)
    views, got = list(views), 0
    while first < len(views):
        try:
            n = sock.recvmsg_into(views[first : first + dw.IOV_BATCH])[0]
        except (BlockingIOError, socket.timeout):
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out after {got} of {total} bytes") from None
        except OSError as exc:
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE,
                                 f"connection broke after {got} of {total} bytes: {exc}") from None
        if n == 0:
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection closed after {got} of {total} bytes")
        got += n
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
        if first < len(views) and time.monotonic() > deadline:
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed after {got} of {total} bytes")

