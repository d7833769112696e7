"""The remote tier: kvnodes named by each request's placement, behind the engine's hook.

Design notes
1. A kvnode never makes a request fail: every call has a short deadline, a node that fails is
   skipped for a while (longer each time in a row), and whatever cannot be fetched is computed.
2. `lookup` and `fill` run on the KV connector's threads (worker/connector/connector.py), off the
   engine's; still, placement addresses come from clients, so a request never waits long on a
   node it has no good record of: first contact happens on
   a probe thread (remote/nodes.py), and a request waits for its nodes' probes at most
   `first_contact_wait_s` in all, then counts a miss while they go on. One request's lookup
   spends at most `lookup_timeout_s` across all its placed nodes, not that much per node.
3. The known nodes are bounded (`max_nodes`, least recently used evicted and closed), and so are
   the probes in flight (`max_probes`; past it an unknown address is a miss).
4. Fetched pages come in batches, the transfer of one overlapping the writing of the one before
   into the pool; a PageFetcher (worker/remote/fetch.py, its notes 1 and 2) does the receiving
   and the writing, the tier chooses the node and counts what arrived.
5. Write-back runs on one background thread with a bounded queue; what cannot be sent is
   counted and dropped. A `WriteBack` (worker/remote/writeback.py, its notes 1 to 3) does the
   queueing and the sending, the tier hands it the pages and counts what it sent.
6. A fetched page is used only once its bytes match its checksum (NodeClient checks them as
   they arrive). At the first that does not, the fill stops: the pages before it are kept,
   it and every page after it are computed (a page's KV depends on its whole prefix, and its
   children are keys the node may hold intact, but they would follow a page we do not have).
   The rejection is counted, logged once, and the node is told to drop the page (DropPages:
   it goes with its descendants) through the write-back queue, so the drop reaches the node
   before the write-back of the page computed in its place (remote/writeback.py note 2).
7. Layer-wise fill (issue 19, `fill_layerwise`): the pages come from the node that answered the
   lookup in one banded GET, a band per layer (a page is laid out layer-major, so layer l of
   every page is one contiguous range on the wire), and `landed(l)` is called once layer l of
   every page is in the pool, so the engine may compute layer l of the request's suffix while
   the later layers are on the way (how each layer lands: remote/fetch.py note 2). Off by
   default (`layerwise_fill`): on the shared 2-core machine it did not pay (docs/benchmarks.md). Pages are checked
   once their last band landed, after the engine may have used them: the count returned says
   how many leading pages are whole and intact (those before an altered page; none after a node
   error, every page being part-way), and when it is short the caller throws away what it
   computed with them. No replica is tried. More pages than the node takes in one request are
   fetched whole (`fill`), every layer landing at the end.
8. Pages read in place (`fill_in_place`, worker/kv/pages_in_place.py): with a block arena and a pool
   in the wire dtype, the pages of a node on this host whose pool its client maps are pinned
   there and read where they lie for the request's first step, instead of copied into its
   blocks first; only from the node that answered the lookup, and only all the pages or none (a
   failure of any kind answers None, and `fill` fetches them as before). Not with the layer-wise
   fill, which this replaces where it applies.
9. A fetch the node answers NOT_FOUND (a page evicted or dropped since the lookup: the lookup
   may be up to half a lease old when the load starts, loads queue behind one another, and a
   DropPages from any worker removes leased pages too) fails as any fetch may (`fill` asks a
   replica for the rest, the others answer as on any failure, and what no node delivers is
   computed), counted in `fetches_not_found`; but the node answered: it is not skipped
   (remote/nodes.py note 2) and no warning is logged. Every other error skips the node: a data
   plane busy never reaches the tier (NodeClient goes over gRPC, a refused pin answers None),
   and gRPC's RESOURCE_EXHAUSTED (the node's calls in flight at their bound) sheds load from it.
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
    pages_rejected: int = 0  # fetched pages whose bytes did not match their checksums (design note 6)
    drops_reported: int = 0  # DropPages calls a node answered
    pages_in_place: int = 0  # fetched pages read where they lay in a same-host node's pool (design note 8)
    fetches_not_found: int = 0  # fetches the node answered NOT_FOUND, its pages gone since the lookup (note 9)


class RemoteTier(Tier):
    """Fetches pages into the engine's pool and writes full pages back.

    `pool` is the engine's block array [blocks, layers, 2, kv_heads, page_tokens, head_dim], in
    `kv_dtype` or float32; on the wire a page is that block in `kv_dtype` (float16 halves the bytes).
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
        self.wire_dtype = np.dtype(kv_dtype)
        if pool.dtype not in (self.wire_dtype, np.float32):
            raise ValueError(f"a {pool.dtype} pool cannot hold {kv_dtype} pages")
        self.block_shape = pool.shape[1:]
        self.page_bytes = int(np.prod(self.block_shape)) * self.wire_dtype.itemsize
        self.lease_ms = lease_ms
        self.lookup_timeout_s = lookup_timeout_s
        self.first_contact_wait_s = first_contact_wait_s
        self.layerwise_fill = layerwise_fill  # the connector uses fill_layerwise when True (design note 7)
        self.num_layers = self.block_shape[0]
        self.stats = TierStats()
        self._stats_lock = threading.Lock()  # counted from the engine thread and the sender thread
        # Design note 8: needs a pool that opens a block arena, and pages that are blocks as they lie.
        arena = arena_of(pool)
        in_place = read_in_place and not layerwise_fill and arena is not None and pool.dtype == self.wire_dtype
        self.in_place = InPlaceReader(arena, self._altered_in_place) if in_place else None
        self.nodes = NodeTable(self.page_bytes, lookup_timeout_s, retry_after_s, max_retry_after_s, max_nodes,
                               max_probes, on_failure=lambda: self._count("node_failures", 1),
                               credentials=credentials,
                               on_answered=self.in_place.prepare if self.in_place is not None else lambda node: None)
        self.fetcher = PageFetcher(pool, self.wire_dtype, fetch_batch_bytes, min_batch_bytes, self._count)
        self.fetch_batch_pages, self.min_batch_pages = self.fetcher.fetch_batch_pages, self.fetcher.min_batch_pages
        # Copies of blocks (a float32 one cast when sent): bounded in bytes (1,024 gpt2-small pages would be 1.2 GB).
        # Its thread also sweeps the windows onto gone nodes' pools (remote/writeback.py note 3).
        self.writeback = WriteBack(self.nodes, self.wire_dtype, self.page_bytes,
                                   max(16, queue_bytes // pool[0].nbytes), lookup_timeout_s, self._count,
                                   send=self._send, sweep=self.in_place.sweep if self.in_place is not None else None)
        self._outbox = self.writeback.outbox  # its queue (tests look at its bound)

    # ---- the engine's hook -----------------------------------------------------

    def lookup(self, keys: Sequence[bytes], placement: Placement) -> int:
        """How many of `keys`, from the first, the first answering placed node holds (leased for the fetch).

        Waits for first contacts at most `first_contact_wait_s`, and `lookup_timeout_s` in all (design note 2).
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
        in the arena until released (design note 8); None when they cannot be, `fill` then fetches them."""
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
        layer l of every page is in the pool (design note 7); how many leading pages are whole and
        intact (all of them, or what was computed with the others must be thrown away)."""
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
                if isinstance(error, PageRejected):  # design note 6: the rest is computed
                    self.nodes.succeeded(node)
                    self._reject(node.address, error)
                    return filled
                self._fetch_failed(node, error)
        return filled

    def _fetch_failed(self, node: Node, exc: NodeError) -> None:
        """A fetch from `node` failed: counted, and the node skipped for its back-off unless it
        answered that a page is gone (design note 9)."""
        self._count("fetch_failures", 1)
        if exc.code != grpc.StatusCode.NOT_FOUND:
            self.nodes.failed(node, exc)
            return
        self._count("fetches_not_found", 1)
        self.nodes.succeeded(node)  # it answered
        log.debug("kvnode %s no longer holds a page of a fetch (%s); computing it", node.address, exc.details)

    def _reject(self, address: str, rejected: PageRejected) -> None:
        """A fetched page failed its checksum (design note 6): count it, say so, have the node drop it."""
        self._count("pages_rejected", 1)
        log.warning("kvnode %s sent page %s whose bytes do not match its checksum; computing it and the pages "
                    "after it, and asking the node to drop it", address, rejected.key.hex())
        self.writeback.queue_drop(address, rejected.key)

    def _altered_in_place(self, address: str, index: int, key: bytes) -> None:
        """A page read in place failed its check (pages_in_place.py note 2): reported as a fetched one."""
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
