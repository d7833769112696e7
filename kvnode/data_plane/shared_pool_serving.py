"""The node's side of its shared pool (kvnode/wire/shared_pool.py): the data plane server's MAP_POOL and
GET_SLOTS requests (framed in kvnode/wire/data_frames.py), served by kvnode/data_plane/server.py on its
Unix socket: a peer maps the pool read-only and copies pages out by their slots, a copy at memory
speed instead of a socket's two. The reader's side: kvnode/client/shared_pool_reader.py.

Pages stay pinned until the peer says it copied them, or until `timeout_s` passes and the
connection is dropped, as a GET's reply must be sent within it.
"""

from __future__ import annotations

import os
import socket
import time

import grpc

from kvnode.wire import data_frames as dw
from kvnode.wire import shared_pool
from kvnode.data_plane.connection import Connection, Dropped
from kvnode.store.page_store import PageNotFound, PageStore


def not_shared_reason(pool: shared_pool.SharedPool | None, conn) -> str | None:
    """Why this peer may not read the shared pool `pool`; None when it may. Only where no more is
    revealed than the peer could read already: a plaintext node (under TLS the same host goes over
    TLS on the Unix socket, a member's certificate being the rule), and a peer process of the
    node's own user or root, which may read the pages over the socket anyway. The pool is sealed
    against writes by anyone but the node, so a reader cannot alter a page."""
    if pool is None:
        return ("this node does not share its page pool (it runs with TLS, --no-shared-pool or without a unix "
                "socket, or the platform has no memfd): fetch with GET")
    if getattr(conn, "family", None) != socket.AF_UNIX:
        return "the shared page pool is offered on the node's unix socket only: fetch with GET"
    uid, own = shared_pool.peer_uid(conn), os.geteuid()
    if uid is None or uid not in (own, 0):
        return f"the shared page pool is for processes of the node's user ({own}) only; yours is {uid}: fetch with GET"
    return None


def send_pool(connection: Connection, pool: shared_pool.SharedPool | None) -> None:
    """MAP_POOL: the pool's sealed descriptor, sent beside the reply."""
    refusal = not_shared_reason(pool, connection.conn)
    if refusal is not None:
        raise dw.FrameError(grpc.StatusCode.FAILED_PRECONDITION, refusal)
    connection.send_with_fd(dw.ok_reply(dw.POOL_REPLY.size) + dw.POOL_REPLY.pack(pool.pages, pool.page_bytes),
                            pool.fd)


def send_slots(connection: Connection, store: PageStore, pool: shared_pool.SharedPool | None, keys: list[bytes],
               timeout_s: float) -> int:
    """GET_SLOTS of `keys`: pin the pages, tell their slots (and send the bytes of those without one),
    unpin once the reader says it copied them (RELEASE); how many it copied by slot."""
    refusal = not_shared_reason(pool, connection.conn)
    if refusal is not None:
        raise dw.FrameError(grpc.StatusCode.FAILED_PRECONDITION, refusal)
    try:
        slots, views = store.pin_slots(keys)
    except PageNotFound as exc:
        raise dw.FrameError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
    try:
        try:
            checksums = store.checksums(keys)
        except PageNotFound as exc:  # pinned, yet dropped meanwhile (its slots wait for the unpin): as any missing page
            raise dw.FrameError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        table = b"".join(checksum + dw.SLOT.pack(dw.NO_SLOT if slot is None else slot)
                         for checksum, slot in zip(checksums, slots))
        unslotted = [view for slot, view in zip(slots, views) if slot is None]
        payload = len(table) + len(unslotted) * store.page_bytes
        connection.send_parts([dw.ok_reply(payload) + table, *unslotted], deadline=time.monotonic() + timeout_s)
        answer = connection.receive(len(dw.RELEASE))  # within timeout_s, or the peer is dropped
        if bytes(answer) != dw.RELEASE:
            raise Dropped(f"sent {bytes(answer)!r} instead of releasing the pages of a GET_SLOTS")
    finally:
        del views
        store.unpin_pages(keys)
    return len(keys) - len(unslotted)
