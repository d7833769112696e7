"""Pages pinned in the node's shared pool for a caller that reads them in place
(NodeClient.pin_pages): GET_SLOTS (kvnode/wire/data_frames.py) without the copy and without the
release, which is the caller's to send once it is done with the pages (PinnedPages.release).
The reader's side of the pool: shared_pool_reader.py; the node's: kvnode/data_plane/shared_pool_serving.py.

Why: a worker that reads fetched pages straight out of the node's pool for one engine step copies
each page once (into its own blocks), not twice (out of the pool, then into its blocks). It maps
the pool itself (NodeClient.shared_pool_file) and reads the slots PinnedPages names.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Sequence

import grpc

from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import first_mismatch, first_mismatch_in_two
from kvnode.client.data_client_io import DataPlaneError, StaleConnection, send_request
from kvnode.client.shared_pool_reader import receive_slot_table, table_checksum
from kvnode.client.types import NodeError, NodeInfo, PageRejected, check_keys

if TYPE_CHECKING:
    from kvnode.client.data_client import DataPlaneClient

# GET_SLOTS requests a pin_pages may hold, each of at most the node's per-request key limit. The node
# answers a connection's next request only after the release, so each pinned request holds a
# connection of its own; all are sent before the first table is read, so the node serves them side
# by side. More keys than that: None, nothing sent.
MAX_REQUESTS = 4

log = logging.getLogger("kvnode.client")


class PinnedPages:
    """Pages pinned by the node in its shared pool: page i of the request is `slots[i]` of the
    pool's mapping of `generation` (NodeClient.shared_pool_file), `page_bytes` long, unchanged
    until release(). Safe to release from any thread.

    Release soon: the node keeps the pins only while it waits for the release, within its data
    plane timeout (60 s by default); past that it drops the connection and the pins, and the slots
    may be reused for other pages while the caller still reads them. A pinned page is also RAM the
    node's eviction cannot take back."""

    def __init__(self, slots: list[int], generation: int, page_bytes: int, held: list, give_back):
        self.slots = slots
        self.generation = generation
        self.page_bytes = page_bytes
        self._lock = threading.Lock()
        # Collected unreleased: the connections are closed (the node unpins as they go), not leaked.
        self._finalizer = weakref.finalize(self, _close_all, held)
        self._give_back = give_back
        self._check: tuple | None = None  # (keys, the mapped pool, checksums) with check=False (see first_altered)

    def first_altered(self) -> int | None:
        """Index of the first page whose bytes in the pool do not match its checksum, None when all
        do; only meaningful while pinned. Every page is checked when pin_pages was asked to (the
        default), and this answers None then. The check reads the node's bytes, not a copy's, so
        pages checked need no second check while pinned (the pool is sealed against writes by
        anyone but the node, which does not write a pinned slot). A caller that would rather check
        them while it already computes with them (the worker, which throws that work away if they
        fail) asks check=False and calls this itself, before release."""
        if self._check is None:
            return None
        if self.released:
            raise RuntimeError("pages checked after their release may have been reused: check them before")
        keys, pool, checksums = self._check
        return first_mismatch(keys, [pool[slot] for slot in self.slots], checksums)

    def release(self) -> None:
        """Tell the node the pages may go (RELEASE on each connection, then back to the idle pool;
        a connection that cannot take it is closed, which unpins them as well). Idempotent; never raises."""
        with self._lock:
            taken = self._finalizer.detach()  # None once released (or collected)
        if taken is None:
            return
        _, _, (socks,), _ = taken  # (self, _close_all, args, kwargs)
        for sock in socks:
            try:
                sock.sendall(dw.RELEASE)
            except Exception:  # the node unpins as the connection goes
                _close_all([sock])
                continue
            try:
                self._give_back(sock)
            except Exception:
                _close_all([sock])

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        return (f"PinnedPages({len(self.slots)} pages, generation {self.generation}, "
                f"{'released' if self.released else 'pinned'})")


def _close_all(socks: list) -> None:
    for sock in socks:
        try:
            sock.close()
        except Exception:
            pass


def pin_pages(address: str, known_info: Callable[[], NodeInfo], data_plane: Callable[[], DataPlaneClient | None],
              keys: Sequence[bytes], timeout: float, check: bool = True) -> PinnedPages | None:
    """NodeClient.pin_pages for the node at `address`, given what it uses of that NodeClient: its
    Info and its data plane (None: gRPC only), asked for as the call needs them."""
    keys = [bytes(key) for key in keys]
    check_keys(address, keys)
    info = known_info()
    plane = data_plane()
    if plane is None:
        return None
    if plane.pool_state == "unasked":
        plane.start_mapping()  # for the next call: this one does not wait for it
    deadline = time.monotonic() + timeout
    try:
        taken = _take_pins(plane, keys, max(1, info.max_keys_per_request), deadline)
    except DataPlaneError as exc:
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED or exc.closed_unanswered:
            return None  # busy: the caller fetches as usual
        raise NodeError(address, exc.code, exc.details) from None
    if taken is None:
        return None
    pinned, pool, checksums = taken
    if not check:  # the caller calls first_altered() (see PinnedPages.first_altered)
        pinned._check = (keys, pool, checksums)
        return pinned
    try:
        index = first_mismatch_in_two(keys, [pool[slot] for slot in pinned.slots], checksums)
    except BaseException:
        pinned.release()
        raise
    if index is not None:
        pinned.release()
        raise PageRejected(address, index, keys[index])
    return pinned


def _take_pins(plane, keys: list[bytes], max_keys: int, deadline: float):
    """(PinnedPages, the mapped pool, the checksums) for `keys`; or None, with nothing left pinned,
    whenever the pages cannot be read in place and a normal fetch should be made instead: no
    mapping (yet, or refused), a connection that is not the Unix socket's, a page the node has in
    no slot (on disk only; that connection is closed, its unread bytes never read), or more keys
    than MAX_REQUESTS allows. DataPlaneError for anything else, every connection it opened closed."""
    pool, generation = plane.shared_pool.mapping()
    batches = [keys[i : i + max_keys] for i in range(0, len(keys), max_keys)]
    if pool is None or len(batches) > MAX_REQUESTS:
        return None
    held: list = []  # [socket, reused] per batch, in order
    slots: list[int] = []
    checksums: list[bytes] = []
    unslotted: list[int] = []  # batches with a page in no slot
    try:
        for batch in batches:
            sent = _send(plane, batch, deadline, fresh=False)
            if sent is None:
                return _give_up(plane, held, ())
            held.append(sent)
        for number, batch in enumerate(batches):
            try:
                table, payload, batch_slots = _table(plane, held[number], batch, deadline)
            except StaleConnection:  # an idle connection the node had closed: once more, on a new one
                held[number][0].close()
                plane.drop_idle()
                held[number] = _send(plane, batch, deadline, fresh=True)
                if held[number] is None:
                    return _give_up(plane, held, range(number))
                table, payload, batch_slots = _table(plane, held[number], batch, deadline)
            checksums += [bytes(table_checksum(table, i)) for i in range(len(batch))]
            slots += batch_slots
            if dw.NO_SLOT in batch_slots:
                unslotted.append(number)
            elif payload != table.nbytes or any(slot >= len(pool) for slot in batch_slots):
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers a GET_SLOTS of {len(batch)} pages with "
                                     f"{payload} bytes, naming slots {sorted(set(batch_slots))} of a pool of "
                                     f"{len(pool)}: not one this client reads")
    except BaseException:
        _close_all([sock for sock, _ in filter(None, held)])
        raise
    if unslotted:
        return _give_up(plane, held, [number for number in range(len(held)) if number not in unslotted])
    return PinnedPages(slots, generation, pool.shape[1], [sock for sock, _ in held], plane.give_back), pool, checksums


def _send(plane, batch: list[bytes], deadline: float, fresh: bool) -> list | None:
    """[connection, reused] with a GET_SLOTS of `batch` sent on it; None (the connection given back)
    when it is not one that reads the shared pool (a Unix one). A stale pooled one is retried once."""
    for attempt in range(2):
        sock, reused = plane.take_connection(deadline, fresh=fresh or attempt > 0)
        if plane.shared_pool.pool_for(sock) is None:
            plane.give_back(sock)
            return None
        try:
            dw.set_kernel_timeouts(sock, max(0.001, deadline - time.monotonic()))
            send_request(sock, [dw.get_request(batch, dw.OP_GET_SLOTS)], deadline, reused, plane.address)
            return [sock, reused]
        except StaleConnection:
            sock.close()
            plane.drop_idle()
        except BaseException:
            sock.close()
            raise
    raise AssertionError("a retried GET_SLOTS asked for another retry")


def _table(plane, held: list, batch: list[bytes], deadline: float) -> tuple[memoryview, int, list[int]]:
    """The GET_SLOTS reply's table, its whole payload's length and the slots; the pages stay pinned."""
    sock, reused = held
    answer = receive_slot_table(sock, len(batch), deadline, reused, plane.address)
    held[1] = False  # answered: no longer a stale one to retry
    return answer


def _give_up(plane, held: list, answered) -> None:
    """None for pin_pages (see _take_pins): the pins of the connections numbered in `answered` (their
    replies read in full) released and those given back; the others closed (a reply not read in full
    must not meet the next request), which unpins theirs."""
    answered = set(answered)
    _close_all([entry[0] for number, entry in enumerate(held) if entry is not None and number not in answered])
    PinnedPages([], 0, 0, [held[number][0] for number in sorted(answered)], plane.give_back).release()
    return None
