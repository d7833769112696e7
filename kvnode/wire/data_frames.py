"""Framing of the kvnode's data plane, shared by its server (kvnode/data_plane/server.py) and
NodeClient: GET, PUT, GET_BANDS and LOOKUP of whole pages over a plain stream socket, and the
shared pool's MAP_POOL and GET_SLOTS on the Unix socket. It exists because grpcio moves page bytes
far slower than a socket does (docs/architecture.md, "The data plane").

A request is one header (REQUEST), then its keys, then what its op adds:
     GET, GET_SLOTS  count x key
     GET_BANDS       count x key; the header's page_bytes field is the band size
     LOOKUP          count x key, then lease_ms (LEASE)
     PUT             count x (key, parent_len, parent or zeros, checksum), then the pages back to back
Keys come before pages so the server validates them before it receives a byte of data. A reply is
one header (REPLY), then its payload, or its message when refused. A connection carries any number
of requests, one at a time; under TLS the same frames go through a TlsStream (tls_stream.py).
"""

from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Sequence

import grpc

from base.pages import KEY_BYTES
from kvnode.wire.checksum import CHECKSUM_BYTES

MAGIC = b"KVDP"
VERSION = 2
# Version 2 added the pages' checksums (checksum.py). The server still takes version 1: a v1 PUT's
# pages get their checksums computed by the node, a v1 GET is answered with the pages alone.
VERSIONS = (1, 2)  # spoken by the server; clients speak VERSION
OP_GET, OP_PUT, OP_GET_BANDS, OP_MAP_POOL, OP_GET_SLOTS, OP_LOOKUP = 1, 2, 3, 4, 5, 6
OPS = {OP_GET: "GET", OP_PUT: "PUT", OP_GET_BANDS: "GET_BANDS", OP_MAP_POOL: "MAP_POOL", OP_GET_SLOTS: "GET_SLOTS",
       OP_LOOKUP: "LOOKUP"}
MAX_BANDS = 1024  # bands a page may be cut into by one GET_BANDS
MAX_BAND_SLICES = 16_384  # pages x bands of one GET_BANDS: each slice is a buffer to send (a TLS record)

REQUEST = struct.Struct("!4sBBBxIQ")  # magic, version, op, key_bytes, count, page_bytes
# A reply's status is a grpc.StatusCode value (0 = OK). OK to a GET: the pages' checksums, then their
# bytes, in request order; to a PUT: one PutOutcome byte per page. Not OK: the message, then the
# server closes the connection (the rest of the request is not read as a request).
REPLY = struct.Struct("!BxxxIQ")  # status, message bytes, payload bytes
PARENT_LEN = struct.Struct("!B")
# The shared pool (shared_pool.py), on the Unix socket only. MAP_POOL (count 0) is answered with
# POOL_REPLY and the pool's read-only descriptor as SCM_RIGHTS, or FAILED_PRECONDITION where the
# node does not share its pool with this peer. GET_SLOTS pins the pages and answers (checksum, SLOT)
# each, then the bytes of the NO_SLOT pages; the node unpins them only at the reader's RELEASE, and
# drops a reader that sends anything else, or nothing within its timeout, with its pins.
POOL_REPLY = struct.Struct("!QQ")  # MAP_POOL: pages, page_bytes
SLOT = struct.Struct("!Q")  # GET_SLOTS: a page's slot in the shared pool, after its checksum
NO_SLOT = 2**64 - 1  # in no slot of the pool (on disk only, no RAM slot to be had): its bytes follow
RELEASE = b"R"  # GET_SLOTS: the reader copied the pages; the node may unpin them
LEASE = struct.Struct("!Q")  # LOOKUP: lease_ms, after the keys
HITS = struct.Struct("!Q")  # LOOKUP: an OK reply's payload, the hits

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class FrameError(ValueError):
    """A request that cannot be served; `code` is the grpc.StatusCode it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RequestHeader:
    op: int
    key_bytes: int
    count: int
    page_bytes: int
    version: int = VERSION

    @property
    def checksums(self) -> bool:
        """Whether its pages' checksums travel with it (version 2 on)."""
        return self.version >= 2


# ---- requests ---------------------------------------------------------------------


def request_header(op: int, count: int, key_bytes: int = KEY_BYTES, page_bytes: int = 0,
                   magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return REQUEST.pack(magic, version, op, key_bytes, count, page_bytes)


def get_request(keys: Sequence[bytes], op: int = OP_GET) -> bytes:
    """A whole GET (or GET_SLOTS) request: header and keys (every key as long as the first)."""
    key_bytes = len(keys[0]) if keys else KEY_BYTES
    return request_header(op, len(keys), key_bytes) + b"".join(keys)


def get_bands_request(keys: Sequence[bytes], band_bytes: int) -> bytes:
    """A whole GET_BANDS request: header carrying the band size, then the keys. Its reply is a GET's,
    but band-major: band 0 of every page in request order, then band 1, and so on (the last band
    of a page shorter when the size does not divide it). A page laid out layer-major, one band per
    layer, lets the reader use layer l while the later layers are on the way."""
    key_bytes = len(keys[0]) if keys else KEY_BYTES
    return request_header(OP_GET_BANDS, len(keys), key_bytes, band_bytes) + b"".join(keys)


def lookup_request(keys: Sequence[bytes], lease_ms: int) -> bytes:
    """A whole LOOKUP request: header, keys, then lease_ms; an OK reply's payload is HITS.

    gRPC's Lookup without its per-call cost, refused with Lookup's codes. A refused lease is
    RESOURCE_EXHAUSTED, as a connection over the node's bound is, so the client then asks gRPC's
    Lookup, which refuses the one alike and serves the other. Sent again after a stale connection,
    it leases the same pages again."""
    key_bytes = len(keys[0]) if keys else KEY_BYTES
    return request_header(OP_LOOKUP, len(keys), key_bytes) + b"".join(keys) + LEASE.pack(lease_ms)


def band_bounds(page_bytes: int, band_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of each band of a page, the last one shorter when band_bytes does not divide
    the page; FrameError(INVALID_ARGUMENT) for a band size that is not positive, exceeds the page
    or cuts it into more than MAX_BANDS bands."""
    if not 0 < band_bytes <= page_bytes:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"bands of {band_bytes} bytes: a band must hold 1 to {page_bytes} bytes (the page's size)")
    bands = -(-page_bytes // band_bytes)
    if bands > MAX_BANDS:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"bands of {band_bytes} bytes cut a page of {page_bytes} bytes into {bands} bands; at most "
                         f"{MAX_BANDS} are sent: ask for bands of at least {-(-page_bytes // MAX_BANDS)} bytes")
    return [(start, min(start + band_bytes, page_bytes)) for start in range(0, page_bytes, band_bytes)]


def caller_band_bounds(page_bytes: int, band_bytes: int) -> list[tuple[int, int]]:
    """band_bounds for a caller's own arguments: ValueError, not the wire's FrameError."""
    try:
        return band_bounds(page_bytes, band_bytes)
    except FrameError as exc:
        raise ValueError(str(exc)) from None


def is_unknown_op(code: grpc.StatusCode, details: str) -> bool:
    """Whether a refusal is a node's that predates an op: it answers INVALID_ARGUMENT "unknown data
    plane op N" and closes the connection, and the client falls back (plain GETs for GET_BANDS,
    gRPC for LOOKUP)."""
    return code == grpc.StatusCode.INVALID_ARGUMENT and "unknown data plane op" in details


def put_request_head(keys: Sequence[bytes], parents: Sequence[bytes], checksums: Sequence[bytes],
                     page_bytes: int) -> bytes:
    """A PUT request up to its pages: header, then (key, parent_len, parent, checksum) per page."""
    key_bytes = len(keys[0]) if keys else KEY_BYTES
    parts = [request_header(OP_PUT, len(keys), key_bytes, page_bytes)]
    for key, parent, checksum in zip(keys, parents, checksums):
        parts += [key, PARENT_LEN.pack(len(parent)), parent or bytes(key_bytes), checksum]
    return b"".join(parts)


def parse_request_header(buf) -> RequestHeader:
    """The header's fields, or FrameError(INVALID_ARGUMENT) saying what is wrong with it."""
    magic, version, op, key_bytes, count, page_bytes = REQUEST.unpack(buf)
    if magic != MAGIC:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"not a kvnode data plane request (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version not in VERSIONS:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"data plane version {version} is not spoken here (this node speaks "
                         f"{' and '.join(map(str, VERSIONS))})")
    if op not in OPS:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"unknown data plane op {op} (GET is 1, PUT is 2, GET_BANDS is 3, MAP_POOL is 4, "
                         f"GET_SLOTS is 5, LOOKUP is 6)")
    return RequestHeader(op, key_bytes, count, page_bytes, version)


def request_bytes(header: RequestHeader) -> int:
    """What the peer will still send after this header (the server drains it after a refusal)."""
    if header.op in (OP_GET, OP_GET_BANDS, OP_GET_SLOTS):
        return header.count * header.key_bytes
    if header.op == OP_LOOKUP:
        return header.count * header.key_bytes + LEASE.size
    return header.count * (put_entry_bytes(header.key_bytes, header.checksums) + header.page_bytes)


def put_entry_bytes(key_bytes: int, checksums: bool = True) -> int:
    return key_bytes + PARENT_LEN.size + key_bytes + (CHECKSUM_BYTES if checksums else 0)


def parse_put_entries(buf, count: int, key_bytes: int, checksums: bool = True) -> list[tuple[bytes, bytes, bytes | None]]:
    """(key, parent, checksum) per page from a PUT's key block; a root's parent is b"", the
    checksum None in a version 1 request."""
    view = memoryview(buf)
    size = put_entry_bytes(key_bytes, checksums)
    entries = []
    for i in range(count):
        entry = view[i * size : (i + 1) * size]
        key = bytes(entry[:key_bytes])
        parent_len = entry[key_bytes]
        if parent_len not in (0, key_bytes):
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"page {key.hex()}: parent key must be {key_bytes} bytes or empty, got {parent_len}")
        checksum = bytes(entry[2 * key_bytes + 1 :]) if checksums else None
        entries.append((key, bytes(entry[key_bytes + 1 : key_bytes + 1 + parent_len]), checksum))
    return entries


# ---- replies ----------------------------------------------------------------------


def ok_reply(payload_bytes: int) -> bytes:
    return REPLY.pack(0, 0, payload_bytes)


def error_reply(code: grpc.StatusCode, message: str) -> bytes:
    text = message.encode("utf-8")
    return REPLY.pack(code.value[0], len(text), 0) + text


def parse_reply_header(buf) -> tuple[grpc.StatusCode, int, int]:
    """(status, message bytes, payload bytes); an unknown status reads as UNKNOWN."""
    value, message_bytes, payload_bytes = REPLY.unpack(buf)
    return STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), message_bytes, payload_bytes


# ---- sockets ----------------------------------------------------------------------


MIN_KERNEL_TIMEOUT_S = 0.001  # a shorter one could round to 0 microseconds, which is no timeout at all


def set_kernel_timeouts(sock: socket.socket, timeout_s: float, receive: bool = True, send: bool = True) -> None:
    """SO_RCVTIMEO (unless not `receive`) and SO_SNDTIMEO (unless not `send`) on a blocking socket:
    a stalled recv or send raises BlockingIOError after timeout_s (at least MIN_KERNEL_TIMEOUT_S:
    the kernel reads 0 as none), with no poll before each call. A TlsStream sets them on its
    socket (kvnode/wire/tls_stream.py)."""
    timeout_s = max(timeout_s, MIN_KERNEL_TIMEOUT_S)
    seconds = int(timeout_s)
    value = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    if receive:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    if send:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def set_no_delay(sock) -> None:
    """TCP_NODELAY on a TCP socket (under a TlsStream too); a Unix socket has no Nagle to turn off."""
    raw = getattr(sock, "sock", sock)
    if raw.family in (socket.AF_INET, socket.AF_INET6):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


IOV_BATCH = 512  # buffers per sendmsg or recvmsg_into, under the kernel's IOV_MAX (1024)


def send_within(sock: socket.socket, buffers: list, deadline: float) -> int:
    """One sendmsg of `buffers` that returns by `deadline` (socket.timeout after it), with what it
    sent: non-blocking, and a poll for room while the socket's buffer is full. A kernel send timeout
    bounds a TCP send call as a whole, but a Unix socket's only for each buffer it waits for: a
    reader trickling 1.6 MB/s kept one send of 8 MiB under SO_SNDTIMEO 0.3 s going for 5.1 s."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the send's deadline passed")
        try:
            return sock.sendmsg(buffers, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            room = select.poll()
            room.register(sock, select.POLLOUT)
            room.poll(max(1, int(left * 1000)))


def send_parts(sock: socket.socket, parts: list, deadline: float | None = None) -> None:
    """Send the buffers back to back with as few syscalls as sendmsg allows (no joining copy).

    With a `deadline` (time.monotonic()), the whole send must end by then (socket.timeout
    otherwise): a kernel send timeout alone bounds each call, and a peer reading a trickle
    could stretch the send without end. Over TCP each call gets what is left as its kernel send
    timeout (which bounds the call as a whole; it leaves the socket's send timeout changed);
    a Unix socket's calls are send_within's; a TlsStream, which loops over partial sends of each
    call, keeps the deadline inside that loop (kvnode/wire/tls_stream.py).
    """
    parts = [memoryview(p).cast("B") for p in parts]
    first = 0  # parts before it are sent (an index, not pop(0): a banded GET has many parts)
    tls = deadline is not None and hasattr(sock, "deadline")
    unix = deadline is not None and getattr(sock, "family", None) == socket.AF_UNIX
    if tls:
        sock.deadline = deadline
    try:
        while first < len(parts):
            batch = parts[first : first + IOV_BATCH]
            if unix:
                sent = send_within(sock, batch, deadline)
            else:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise socket.timeout("the send's deadline passed")
                    set_kernel_timeouts(sock, left, receive=False)
                sent = sock.sendmsg(batch)  # a TlsStream's sends the first part whole
            while first < len(parts) and sent >= parts[first].nbytes:
                sent -= parts[first].nbytes
                first += 1
            if sent:
                parts[first] = parts[first][sent:]
    finally:
        if tls:
            sock.deadline = None
