"""The remote tier's write-back: copies of full pages, and requests to drop altered ones, on
their way to the kvnodes placed for them.

The tier (worker/remote/tier.py) owns one `WriteBack` and hands it what to send (`queue_page`,
`queue_drop`); it sends through the tier's node table and counts into the tier's stats. Each
batch goes through the tier's `_send` (a subclass may wrap it: worker/observe.py). One background
thread with a bounded queue: queueing never blocks the engine's thread, and what cannot be queued
or sent is counted and dropped. The thread waits for first contacts up to `lookup_timeout_s` a
batch, and sends a batch to each node parents first, in requests within its key limit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvnode.client import NodeError, page_checksum
from worker.remote.fetch import transfer_timeout
from worker.remote.nodes import NodeTable

log = logging.getLogger("worker.remote")  # its messages are the tier's

# How often the sender thread has the tier's reader of pages in place unmap its windows onto gone
# nodes' pools (InPlaceReader.sweep).
_SWEEP_EVERY_S = 5.0


@dataclass
class _Drop:
    """A write-back queue entry that asks `address` to drop an altered page (see _send_drops)."""

    address: str
    key: bytes


class WriteBack:
    """The sender thread of a RemoteTier and its bounded queue of `max_pages` entries."""

    def __init__(self, nodes: NodeTable, wire_dtype: np.dtype, page_bytes: int, max_pages: int,
                 lookup_timeout_s: float, count: Callable[[str, int], None],
                 send: Callable[[list], None] | None = None, sweep: Callable[[], None] | None = None):
        self.nodes = nodes
        self.wire_dtype = wire_dtype
        self.page_bytes = page_bytes
        self.lookup_timeout_s = lookup_timeout_s
        self._count = count
        self._send_batch = send or self.send  # the tier's `_send`, which ends in `send`
        self._sweep = sweep
        self.outbox: queue.Queue = queue.Queue(maxsize=max_pages)
        self._stopping = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="kv-writeback", daemon=True)
        self._sender.start()

    def queue_page(self, addresses: Sequence[str], key: bytes, parent: bytes, block: np.ndarray) -> None:
        """Queue a copy of `block` for every node of `addresses`; never blocks (a full queue drops it)."""
        if not any(self.nodes.may_be_usable(a) for a in addresses):
            self._count("pages_dropped", len(addresses))
            return
        # A plain copy (the block may be reused); the sender casts a float32 one to the wire dtype,
        # because NumPy's float32 -> float16 cast (milliseconds a page) would delay the token.
        data = block.copy()
        try:
            self.outbox.put_nowait((tuple(addresses), key, parent, data))
        except queue.Full:
            self._count("pages_dropped", 1)

    def queue_drop(self, address: str, key: bytes) -> None:
        """Ask `address` to drop page `key`, before any page queued after (see _send_drops)."""
        try:
            self.outbox.put_nowait(_Drop(address, key))
        except queue.Full:
            pass  # the next reader that meets the page reports it again

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued page was sent or dropped (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.outbox.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.outbox.unfinished_tasks

    def close(self) -> None:
        self._stopping.set()
        self._sender.join(timeout=5.0)

    def _send_loop(self) -> None:
        swept = time.monotonic()
        while not self._stopping.is_set():
            if self._sweep is not None and time.monotonic() - swept > _SWEEP_EVERY_S:
                swept = time.monotonic()
                try:
                    self._sweep()  # windows of gone nodes (pages_in_place.py)
                except Exception:
                    log.exception("unmapping the windows of gone kvnodes failed")
            try:
                first = self.outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < 64:
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._send_drops([item for item in batch if isinstance(item, _Drop)])
                self._send_batch([item for item in batch if not isinstance(item, _Drop)])
            except Exception as exc:  # a bug of ours must not end write-back for the life of the process
                log.exception("write-back of %d pages failed: %r; dropping them", len(batch), exc)
                self._count("pages_dropped", len(batch))
            finally:
                for _ in batch:
                    self.outbox.task_done()

    def _send_drops(self, drops: list[_Drop]) -> None:
        """Drops of pages that failed their checksum (RemoteTier._reject) go through the same queue, and
        before the batch's puts, so a page computed in place of a dropped one is stored after the drop."""
        for drop in drops:
            with self.nodes.use([drop.address]) as nodes:
                if not nodes or not self.nodes.ready(nodes[0], time.monotonic() + self.lookup_timeout_s):
                    continue
                try:
                    nodes[0].client.drop_pages([drop.key], timeout=self.lookup_timeout_s)
                except NodeError as exc:
                    log.info("kvnode %s: could not have it drop page %s: %s", drop.address, drop.key.hex(), exc)
                    continue
                self._count("drops_reported", 1)

    def send(self, batch: list) -> None:
        """Put a batch of queued pages, (addresses, key, parent, page) each, to their nodes."""
        by_node: dict[str, list] = {}
        for addresses, key, parent, data in batch:
            wire = data.astype(self.wire_dtype, copy=False)
            checksum = page_checksum(key, wire)  # once per page, after the cast, for every placed node
            for address in addresses:
                by_node.setdefault(address, []).append((key, parent, wire, checksum))
        self.nodes.contact(list(by_node))  # first contacts at once, then one wait for all of them
        until = time.monotonic() + self.lookup_timeout_s
        for address, items in by_node.items():
            self._write(address, items, until)

    def _write(self, address: str, items: list, contact_until: float) -> None:
        with self.nodes.use([address]) as nodes:
            if not nodes or not self.nodes.ready(nodes[0], contact_until):
                self._count("pages_dropped", len(items))
                return
            node = nodes[0]
            for start in range(0, len(items), node.max_keys):  # parents first: in order, each within the limit
                part = items[start : start + node.max_keys]
                keys, parents, pages, checksums = zip(*part)
                try:
                    result = node.client.put_pages(keys, parents, pages,
                                                   timeout=transfer_timeout(len(part), self.page_bytes),
                                                   checksums=checksums)
                except NodeError as exc:
                    self._count("pages_dropped", len(items) - start)
                    self.nodes.failed(node, exc)
                    return
                self.nodes.succeeded(node)
                self._count("pages_written", result.stored + result.already_present)
                self._count("pages_refused", result.refused)
