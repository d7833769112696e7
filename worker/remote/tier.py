"""The remote tier: kvnodes named by each request's placement, behind the engine's hook.

A kvnode never makes a request fail: every call has a short deadline, a node that fails is skipped
for a while (longer each time in a row: worker/remote/nodes.py), and whatever cannot be fetched is
computed. Lookups and fills run on the KV connector's threads (worker/connector/connector.py), off
the engine's. The tier chooses the nodes and counts what happened; a PageFetcher (fetch.py)
receives fetched pages into the pool, and a WriteBack (writeback.py) sends full pages on one
background thread with a bounded queue, what cannot be sent being counted and dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
import numpy as np

from kvnode.client import NodeError, PageRejected
from worker.kv.block_arena import arena_of
from worker.connector.connector import Tier
from worker.kv.pages_in_place import InPlaceReader, PagesInPlace
from worker.kv.quant import page_sizes, storage_dtype
from worker.remote.fetch import PageFetcher, transfer_timeout
from worker.remote.nodes import Node, NodeTable
from worker.remote.writeback import WriteBack

log = logging.getLogger("worker.remote")


@dataclass
class Placement:
    """The kvnodes a request's pages live on, primary first; `source` is the one that answered the lookup."""

    addresses: list[str]
    source: str | None = None
    source_hits: int = 0
    trace: object = None  # the request's trace context, parent of its tier spans (worker/observe.py)


@dataclass
class TierStats:
    lookups: int = 0
    pages_fetched: int = 0
    bytes_fetched: int = 0
    fill_ms: float = 0.0  # wall time inside fill(): lookups of replicas, transfer, writing into the pool
    fetch_failures: int = 0
    node_failures: int = 0
    pages_written: int = 0
    pages_refused: int = 0
    pages_dropped: int = 0
    pages_rejected: int = 0  # fetched pages whose bytes did not match their checksums (see RemoteTier._reject)
    drops_reported: int = 0  # DropPages calls a node answered
    pages_in_place: int = 0  # fetched pages read where they lay in a same-host node's pool (fill_in_place)
    fetches_not_found: int = 0  # fetches the node answered NOT_FOUND, its pages gone since the lookup


class RemoteTier(Tier):
    """Fetches pages into the engine's pool and writes full pages back.

    `pool` is the engine's block array [blocks, layers, 2, kv_heads, page_tokens, head_dim], in
    `kv_dtype` or float32; on the wire a page is that block in `kv_dtype` (float16 halves the bytes).
    An int8 or int4 pool is the pages' bytes (worker/kv/quant.py), sent and received as they are.
    """

    def __init__(
        self,
        pool: np.ndarray,
        kv_dtype: str,
        lease_ms: int = 2_000,
        lookup_timeout_s: float = 0.5,
        retry_after_s: float = 2.0,
        max_retry_after_s: float = 60.0,
        first_contact_wait_s: float = 0.1,
        max_nodes: int = 64,
        max_probes: int = 16,
        queue_bytes: int = 256 * 2**20,
        fetch_batch_bytes: int = 16 * 2**20,
        min_batch_bytes: int = 2 * 2**20,
        credentials=None,
        layerwise_fill: bool = False,
        read_in_place: bool = True,
    ):
        self.pool = pool
        self.wire_dtype = storage_dtype(kv_dtype)
        holds = (self.wire_dtype,) if self.wire_dtype == np.uint8 else (self.wire_dtype, np.float32)  # no cast of bytes
        if pool.dtype not in holds:
            raise ValueError(f"a {pool.dtype} pool cannot hold {kv_dtype} pages")
        self.block_shape = pool.shape[1:]
        self.page_bytes = int(np.prod(self.block_shape)) * self.wire_dtype.itemsize
        self.lease_ms = lease_ms
        self.lookup_timeout_s = lookup_timeout_s
        self.first_contact_wait_s = first_contact_wait_s
        # The connector uses fill_layerwise when True. Off by default: on the shared 2-core machine it did
        # not pay (docs/benchmarks.md).
        self.layerwise_fill = layerwise_fill
        self.num_layers = self.block_shape[0]
        self.stats = TierStats()
        self._stats_lock = threading.Lock()  # counted from the engine thread and the sender thread
        # Reading pages in place (fill_in_place) needs a pool that opens a block arena, and pages that
        # are blocks as they lie; the layer-wise fill, where it is on, is used instead.
        arena = arena_of(pool)
        in_place = read_in_place and not layerwise_fill and arena is not None and pool.dtype == self.wire_dtype
        self.in_place = InPlaceReader(arena, self._altered_in_place) if in_place else None
        # Bounded: at most max_nodes known (the least recently used idle one evicted and closed) and
        # max_probes first contacts in flight (past it an unknown address is a miss).
        self.nodes = NodeTable(self.page_bytes, lookup_timeout_s, retry_after_s, max_retry_after_s, max_nodes,
                               max_probes, on_failure=lambda: self._count("node_failures", 1),
                               credentials=credentials,
                               on_answered=self.in_place.prepare if self.in_place is not None else lambda node: None,
                               page_sizes=page_sizes(self.block_shape, kv_dtype))
        self.fetcher = PageFetcher(pool, self.wire_dtype, fetch_batch_bytes, min_batch_bytes, self._count)
        self.fetch_batch_pages, self.min_batch_pages = self.fetcher.fetch_batch_pages, self.fetcher.min_batch_pages
        # Copies of blocks (a float32 one cast when sent): bounded in bytes (1,024 gpt2-small pages would be 1.2 GB).
        # Its thread also sweeps the windows onto gone nodes' pools (WriteBack, its `sweep`).
        self.writeback = WriteBack(self.nodes, self.wire_dtype, self.page_bytes,
                                   max(16, queue_bytes // pool[0].nbytes), lookup_timeout_s, self._count,
                                   send=self._send, sweep=self.in_place.sweep if self.in_place is not None else None)
        self._outbox = self.writeback.outbox  # its queue (tests look at its bound)

    # ---- the engine's hook -----------------------------------------------------

    def lookup(self, keys: Sequence[bytes], placement: Placement) -> int:
        """How many of `keys`, from the first, the first answering placed node holds (leased for the fetch).

        Placement addresses come from clients, so a request never waits long on a node it has no good
        record of: first contact is a probe on a probe thread (nodes.py), awaited at most
        `first_contact_wait_s` in all before the node counts as a miss while the probe goes on; and
        one request's lookup spends at most `lookup_timeout_s` across all its placed nodes, not per node.
        """
        self._count("lookups", 1)
        placement.source, placement.source_hits = None, 0
        started = time.monotonic()
        contact_until, deadline = started + self.first_contact_wait_s, started + self.lookup_timeout_s
        with self.nodes.use(placement.addresses) as nodes:
            for node in nodes:
                if time.monotonic() >= deadline:
                    break
                if not self.nodes.ready(node, min(contact_until, deadline)):
                    continue
                try:
                    hits = self._lookup(node, keys, deadline)
                except NodeError as exc:
                    self.nodes.failed(node, exc)
                    continue
                placement.source, placement.source_hits = node.address, hits
                return hits
        return 0

    def _lookup(self, node: Node, keys: Sequence[bytes], deadline: float) -> int:
        """The node's hits among `keys`, leased, asked in requests of at most the node's key (and
        lease) limit, until `deadline`."""
        hits = 0
        for start in range(0, len(keys), node.max_lookup_keys):
            left = deadline - time.monotonic()
            if left <= 0:
                break  # the request's lookup time is spent: the hits so far
            part = keys[start : start + node.max_lookup_keys]
            found = node.client.lookup(part, lease_ms=self.lease_ms, timeout=min(left, self.lookup_timeout_s))
            self.nodes.succeeded(node)
            hits += found
            if found < len(part):
                break
        return hits

    def fill(self, keys: Sequence[bytes], block_ids: Sequence[int], placement: Placement) -> int:
        """Fetch `keys` into `block_ids`; returns how many leading pages really arrived (the engine computes the rest).

        A node that fails part way keeps the pages that arrived; the next node is asked for the rest.
        """
        if not keys:
            return 0
        started = time.perf_counter()
        try:
            return self._fill(keys, block_ids, placement)
        finally:
            self._count("fill_ms", (time.perf_counter() - started) * 1000.0)

    def fill_in_place(self, keys: Sequence[bytes], block_ids: Sequence[int], placement: Placement) -> PagesInPlace | None:
        """`keys` pinned where they lie in the pool of the node that answered the lookup, readable
        in the arena until released (worker/kv/pages_in_place.py), so the request's first step reads
        them where they lie instead of copying them into its blocks first. Only from the node that
        answered the lookup, and all the pages or none: on any failure None, and `fill` fetches them."""
        if self.in_place is None or not keys or not placement.source:
            return None
        started = time.perf_counter()
        try:
            with self.nodes.use([placement.source]) as nodes:
                if not nodes or not self.nodes.ready(nodes[0], 0.0):
                    return None
                node = nodes[0]
                try:
                    pages = self.in_place.pin(node, keys, block_ids, self._fetch_timeout(len(keys)))
                except NodeError as exc:
                    self._fetch_failed(node, exc)
                    return None
                self.nodes.succeeded(node)
                if pages is not None:
                    self._count("pages_in_place", len(pages))
                return pages
        finally:
            self._count("fill_ms", (time.perf_counter() - started) * 1000.0)

    def fill_layerwise(self, keys: Sequence[bytes], block_ids: Sequence[int], placement: Placement,
                       landed: Callable[[int], None]) -> int:
        """Fetch `keys` into `block_ids` layer by layer from the lookup's node, calling landed(l) once
        layer l of every page is in the pool; how many leading pages are whole and intact (all of
        them, or what was computed with the others must be thrown away).

        One banded GET, a band per layer: a page is laid out layer-major, so layer l of every page
        is one contiguous range on the wire, and the engine may compute layer l of the request's
        suffix while later layers are on the way. Pages are checked once their last band landed,
        after the engine may have used them: the count stops before an altered page, and is 0 after
        a node error (every page part-way). No replica is tried."""
        if not keys:
            return 0
        started = time.perf_counter()
        try:
            with self.nodes.use([placement.source] if placement.source else []) as nodes:
                if not nodes or not self.nodes.ready(nodes[0], 0.0):
                    return 0
                node = nodes[0]
                if len(keys) > node.max_keys:  # more than one request: whole pages, every layer at the end
                    filled = self._fill(keys, block_ids, placement)
                    for layer in range(self.num_layers):
                        landed(layer)
                    return filled
                try:
                    self.fetcher.fetch_in_bands(node, keys, block_ids, landed)
                except PageRejected as exc:  # the pages before it are whole and intact
                    self.nodes.succeeded(node)
                    self._reject(node.address, exc)
                    self._count("pages_fetched", exc.index)
                    return exc.index
                except NodeError as exc:
                    self._fetch_failed(node, exc)
                    return 0
                self.nodes.succeeded(node)
                self._count("pages_fetched", len(keys))
                self._count("bytes_fetched", len(keys) * self.page_bytes)
                return len(keys)
        finally:
            self._count("fill_ms", (time.perf_counter() - started) * 1000.0)

    def _fill(self, keys: Sequence[bytes], block_ids: Sequence[int], placement: Placement) -> int:
        candidates = [placement.source] if placement.source else []
        candidates += [a for a in placement.addresses if a not in candidates]
        filled = 0
        deadline = time.monotonic() + self.lookup_timeout_s  # for the replicas' lookups, all of them
        with self.nodes.use(candidates) as nodes:
            for node in nodes:
                if not self.nodes.ready(node, 0.0):  # lookup() waited for first contacts already
                    continue
                wanted = keys[filled:]
                if node.address != placement.source:  # a replica: ask what it holds first
                    try:
                        hits = self._lookup(node, wanted, deadline)
                    except NodeError as exc:
                        self.nodes.failed(node, exc)
                        continue
                    wanted = wanted[:hits]
                    if not wanted:
                        continue
                arrived, error = self.fetcher.fetch(node, wanted, block_ids[filled : filled + len(wanted)])
                filled += arrived
                if error is None:
                    self.nodes.succeeded(node)
                    return filled
                if isinstance(error, PageRejected):  # the rest is computed (see _reject)
                    self.nodes.succeeded(node)
                    self._reject(node.address, error)
                    return filled
                self._fetch_failed(node, error)
        return filled

    def _fetch_failed(self, node: Node, exc: NodeError) -> None:
        """A fetch from `node` failed: counted, and the node skipped for its back-off unless it
        answered that a page is gone (NOT_FOUND: evicted or dropped since the lookup, which may be
        half a lease old when the load starts, and a DropPages from any worker removes leased pages
        too). That fails the fetch as any failure does (a replica is asked for the rest, what no node
        delivers is computed), but the node answered: it is not skipped and nothing is logged as a
        warning. Any other error skips it; gRPC's RESOURCE_EXHAUSTED (its calls in flight at their
        bound) so sheds load from it, and a busy data plane never reaches the tier (NodeClient goes
        over gRPC; a refused pin answers None)."""
        self._count("fetch_failures", 1)
        if exc.code != grpc.StatusCode.NOT_FOUND:
            self.nodes.failed(node, exc)
            return
        self._count("fetches_not_found", 1)
        self.nodes.succeeded(node)  # it answered
        log.debug("kvnode %s no longer holds a page of a fetch (%s); computing it", node.address, exc.details)

    def _reject(self, address: str, rejected: PageRejected) -> None:
        """A fetched page failed its checksum: count it, say so, have the node drop it.

        A fetched page is used only once its bytes match its checksum; at the first that does not,
        the fill stops there: the pages before it are kept, it and every page after it computed
        (a page's KV depends on its whole prefix: its children would follow a page we do not have).
        The drop (DropPages: the node drops the page and its descendants if its own copy fails too)
        goes through the write-back queue, so it reaches the node before the write-back of the page
        computed in its place."""
        self._count("pages_rejected", 1)
        log.warning("kvnode %s sent page %s whose bytes do not match its checksum; computing it and the pages "
                    "after it, and asking the node to drop it", address, rejected.key.hex())
        self.writeback.queue_drop(address, rejected.key)

    def _altered_in_place(self, address: str, index: int, key: bytes) -> None:
        """A page read in place failed its check (InPlaceReader, beside the forward): reported as a
        fetched one."""
        self._reject(address, PageRejected(address, index, key))

    def on_page_full(self, key: bytes, parent: bytes, block_id: int, placement: Placement) -> None:
        """Queue a copy of a newly full page for every placed node; never blocks (a full queue drops it)."""
        self.writeback.queue_page(placement.addresses, key, parent, self.pool[block_id])

    def _count(self, name: str, amount: int) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + amount)

    def _fetch_timeout(self, pages: int) -> float:
        return transfer_timeout(pages, self.page_bytes)

    # ---- write-back (worker/remote/writeback.py) -------------------------------------

    def _send(self, batch: list) -> None:
        """One batch of queued pages to their nodes, on the write-back thread (a subclass may wrap it)."""
        self.writeback.send(batch)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued page was sent or dropped (tests, shutdown); False on timeout."""
        return self.writeback.flush(timeout_s)

    def close(self) -> None:
        self.writeback.close()
        self.fetcher.close()
        if self.in_place is not None:
            self.in_place.close()
        self.nodes.close()
