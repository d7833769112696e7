"""The remote tier: kvnodes named by each request's placement, behind the engine's hook.

Design notes
1. A kvnode never makes a request fail: every call has a short deadline, a node that fails is
   skipped for a while (longer each time in a row), and whatever cannot be fetched is computed.
2. `lookup` and `fill` run on the KV connector's threads (worker/connector.py), off the
   engine's; still, placement addresses come from clients, so a request never waits long on a
   node it has no good record of: first contact happens on
   a probe thread (remote_nodes.py), and a request waits for its nodes' probes at most
   `first_contact_wait_s` in all, then counts a miss while they go on. One request's lookup
   spends at most `lookup_timeout_s` across all its placed nodes, not that much per node.
3. The known nodes are bounded (`max_nodes`, least recently used evicted and closed), and so are
   the probes in flight (`max_probes`; past it an unknown address is a miss).
4. Fetched pages come in batches: a fetch thread receives batch i+1 while the engine's thread
   writes batch i into the pool, so the transfer and the writing overlap instead of adding up.
   Pages bound for blocks of a pool in the wire dtype (the engine's, engine design note 9) are
   received straight into them, consecutive or not; a float32 pool's float16 pages are cast
   (half.py).
   The batches' requests all go out at once (NodeClient.get_pages_in_batches), so a fetch costs
   one round trip to the node, not one a batch; two staging buffers take turns, the fetch thread
   waiting for the one written last.
5. Write-back runs on one background thread with a bounded queue; what cannot be sent is
   counted and dropped. That thread waits for first contacts up to `lookup_timeout_s` a batch.
   Each page's checksum (kvnode/checksum.py) is computed once there, after the cast to the
   wire dtype, and sent to every placed node.
6. A fetched page is used only once its bytes match its checksum (NodeClient checks them as
   they arrive). At the first that does not, the fill stops: the pages before it are kept,
   it and every page after it are computed (a page's KV depends on its whole prefix, and its
   children are keys the node may hold intact, but they would follow a page we do not have).
   The rejection is counted, logged once, and the node is told to drop the page (DropPages:
   it goes with its descendants) through the write-back queue, so the drop reaches the node
   before the write-back of the page computed in its place.
7. Layer-wise fill (issue 19, `fill_layerwise`): the pages come from the node that answered the
   lookup in one banded GET, a band per layer (a page is laid out layer-major, so layer l of
   every page is one contiguous range on the wire), and `landed(l)` is called once layer l of
   every page is in the pool, so the engine may compute layer l of the request's suffix while
   the later layers are on the way. Pages in the pool's dtype are received straight into their
   blocks; float16 ones bound for a float32 pool into a staging buffer kept between fills, and as
   each layer lands it is cast for every page at once (gathered, half.py, then copied per run of
   consecutive blocks: one cast a page, beside the forward, took the GIL so often that the fill
   ran 3-6x longer). Off by
   default (`layerwise_fill`): on the shared 2-core machine it did not pay (docs/benchmarks.md). Pages are checked
   once their last band landed, after the engine may have used them: the count returned says
   how many leading pages are whole and intact (those before an altered page; none after a node
   error, every page being part-way), and when it is short the caller throws away what it
   computed with them. No replica is tried. More pages than the node takes in one request are
   fetched whole (`fill`), every layer landing at the end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
import numpy as np

from kvnode.client import NodeError, PageRejected, page_checksum
from worker.half import float16_to_float32
from worker.remote_nodes import Node, NodeTable

log = logging.getLogger("worker.remote")


@dataclass
class Placement:
    """The kvnodes a request's pages live on, primary first; `source` is the one that answered the lookup."""

    addresses: list[str]
    source: str | None = None
    source_hits: int = 0
    trace: object = None  # the request's trace context, parent of its tier spans (worker/observe.py)


@dataclass
class _Drop:
    """A write-back queue entry that asks `address` to drop an altered page (design note 6)."""

    address: str
    key: bytes


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


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive blocks in block_ids."""
    runs, start = [], 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


class RemoteTier:
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
        self.fetch_batch_pages = max(1, fetch_batch_bytes // self.page_bytes)
        self.min_batch_pages = max(1, min(min_batch_bytes // self.page_bytes, self.fetch_batch_pages))
        self.layerwise_fill = layerwise_fill  # the connector uses fill_layerwise when True (design note 7)
        self.num_layers = self.block_shape[0]
        self.stats = TierStats()
        self._stats_lock = threading.Lock()  # counted from the engine thread and the sender thread
        self.nodes = NodeTable(self.page_bytes, lookup_timeout_s, retry_after_s, max_retry_after_s, max_nodes,
                               max_probes, on_failure=lambda: self._count("node_failures", 1),
                               credentials=credentials)
        # Copies of blocks (a float32 one cast when sent): bounded in bytes (1,024 gpt2-small pages would be 1.2 GB).
        self._outbox: queue.Queue = queue.Queue(maxsize=max(16, queue_bytes // pool[0].nbytes))
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-fetch")
        self._fetch_lock = threading.Lock()  # one fill at a time owns the staging buffers
        # Two reused receive buffers for float16 pages bound for a float32 pool, touched now, not in a
        # request (fresh memory is written far slower here: a first fill through untouched ones took
        # 50-70 ms more for 64 gpt2-small pages). A pool in the wire dtype never needs them.
        self._staging = ([np.full((self.fetch_batch_pages, self.page_bytes), 0, dtype=np.uint8) for _ in range(2)]
                         if self.wire_dtype != pool.dtype else [])
        self._band_staging = np.empty((0, self.page_bytes), dtype=np.uint8)  # float16 layer-wise fills: grown, kept
        self._sender = threading.Thread(target=self._send_loop, name="kv-writeback", daemon=True)
        self._stopping = threading.Event()
        self._sender.start()

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
        """The node's hits among `keys`, leased, asked in requests of at most the node's key limit, until `deadline`."""
        hits = 0
        for start in range(0, len(keys), node.max_keys):
            left = deadline - time.monotonic()
            if left <= 0:
                break  # the request's lookup time is spent: the hits so far
            part = keys[start : start + node.max_keys]
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
                    self._fetch_in_bands(node, keys, block_ids, landed)
                except PageRejected as exc:  # the pages before it are whole and intact
                    self.nodes.succeeded(node)
                    self._reject(node.address, exc)
                    self._count("pages_fetched", exc.index)
                    return exc.index
                except NodeError as exc:
                    self._count("fetch_failures", 1)
                    self.nodes.failed(node, exc)
                    return 0
                self.nodes.succeeded(node)
                self._count("pages_fetched", len(keys))
                self._count("bytes_fetched", len(keys) * self.page_bytes)
                return len(keys)
        finally:
            self._count("fill_ms", (time.perf_counter() - started) * 1000.0)

    def _fetch_in_bands(self, node: Node, keys: Sequence[bytes], block_ids: Sequence[int],
                        landed: Callable[[int], None]) -> None:
        band_bytes = self.page_bytes // self.num_layers
        with self._fetch_lock:
            if self.wire_dtype == self.pool.dtype:  # straight into the blocks
                outs = [self.pool[block].reshape(-1).view(np.uint8) for block in block_ids]
                node.client.get_pages_in_bands(keys, outs, band_bytes, landed, timeout=self._fetch_timeout(len(keys)))
                return
            if len(self._band_staging) < len(keys):  # reused: fresh memory is written far slower
                self._band_staging = np.empty((len(keys), self.page_bytes), dtype=np.uint8)
            rows = self._band_staging[: len(keys)]
            layer_shape = self.block_shape[1:]
            runs = _runs(block_ids)

            halves = np.empty((len(block_ids), *layer_shape), dtype=self.wire_dtype)
            floats = np.empty(halves.shape, dtype=np.float32)

            def cast(layer: int) -> None:
                # A layer of every page at once: gathered, cast by half.py (NumPy's strided cast took twice
                # the CPU), then one copy per run of consecutive blocks. One cast a page took the GIL so often,
                # beside the forward, that the fill ran 3-6x longer.
                bands = rows[:, layer * band_bytes : (layer + 1) * band_bytes].view(self.wire_dtype)
                np.copyto(halves, bands.reshape(halves.shape))
                float16_to_float32(halves, floats)
                for start, end in runs:
                    first = block_ids[start]
                    np.copyto(self.pool[first : first + end - start, layer], floats[start:end])
                landed(layer)

            node.client.get_pages_in_bands(keys, list(rows), band_bytes, cast, timeout=self._fetch_timeout(len(keys)))

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
                arrived, error = self._fetch(node, wanted, block_ids[filled : filled + len(wanted)])
                filled += arrived
                if error is None:
                    self.nodes.succeeded(node)
                    return filled
                if isinstance(error, PageRejected):  # design note 6: the rest is computed
                    self.nodes.succeeded(node)
                    self._reject(node.address, error)
                    return filled
                self._count("fetch_failures", 1)
                self.nodes.failed(node, error)
        return filled

    def _fetch(self, node: Node, keys: Sequence[bytes], block_ids: Sequence[int]) -> tuple[int, NodeError | None]:
        """Receive batches on the fetch thread, write each into the pool here; (pages written, error or None).
        Every batch is checked before it is written; with PageRejected the pages before the rejected one
        were written, those of its own batch too (design note 6)."""
        batches = self._batches(len(keys), node.max_keys)
        with self._fetch_lock:
            if len(batches) == 1:  # nothing to overlap: received here, no thread hop
                into_pool = self._pool_rows(block_ids, 0, len(keys))
                rows = into_pool if into_pool is not None else self._staging_rows(0, len(keys))
                try:
                    node.client.get_pages_in_batches([keys], lambda _: rows, lambda _: None,
                                                     timeout=self._fetch_timeout(len(keys)))
                except PageRejected as exc:  # design note 6: the pages before it are intact
                    self._land(block_ids[: exc.index], None if into_pool is not None else rows[: exc.index], exc.index)
                    return exc.index, exc
                except NodeError as exc:
                    return 0, exc
                self._land(block_ids, None if into_pool is not None else rows, len(keys))
                return len(keys), None
            landed: queue.SimpleQueue = queue.SimpleQueue()  # batch numbers as they arrive, then None
            free = [threading.Semaphore(1), threading.Semaphore(1)]  # staging buffer i may be received into
            abandoned = threading.Event()

            def out_for(number: int) -> np.ndarray:
                start, end = batches[number]
                into_pool = self._pool_rows(block_ids, start, end)
                if into_pool is not None:
                    return into_pool
                while not free[number % 2].acquire(timeout=0.1):  # until batch number - 2 is written
                    if abandoned.is_set():
                        raise NodeError(node.address, grpc.StatusCode.CANCELLED, "the fetch was given up")
                return self._staging_rows(number % 2, end - start)

            def receive() -> None:
                try:
                    node.client.get_pages_in_batches([keys[start:end] for start, end in batches], out_for,
                                                     landed.put, timeout=self._fetch_timeout(len(keys)))
                finally:
                    landed.put(None)

            pending = self._fetcher.submit(receive)
            written = 0
            try:
                while (number := landed.get()) is not None:
                    start, end = batches[number]
                    rows = None if self._pool_rows(block_ids, start, end) is not None else \
                        self._staging_rows(number % 2, end - start)
                    self._land(block_ids[start:end], rows, end - start)
                    if rows is not None:
                        free[number % 2].release()
                    written = end
            finally:
                abandoned.set()
                error = pending.exception()  # the fetch thread lets go of the buffers before anyone reuses them
            if isinstance(error, PageRejected):  # design note 6: the pages of its batch before it are intact
                number, (start, end) = next((n, (b, e)) for n, (b, e) in enumerate(batches) if b <= error.index < e)
                if written != start:
                    raise AssertionError(f"page {error.index} rejected in batch {number} ({start}..{end}), but "
                                         f"{written} pages were written before it: batches land in order")
                rows = None if self._pool_rows(block_ids, start, end) is not None else \
                    self._staging_rows(number % 2, error.index - start)  # the fetch thread is done with it
                self._land(block_ids[start : error.index], rows, error.index - start)
                written = error.index
            if error is None or isinstance(error, NodeError):
                return written, error
            raise error

    def _land(self, block_ids: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        """Write received rows into their blocks (None: they were received in place) and count them."""
        if rows is not None and count:
            self._write_blocks(block_ids, rows.view(self.wire_dtype).reshape(-1, *self.block_shape))
        self._count("pages_fetched", count)
        self._count("bytes_fetched", count * self.page_bytes)

    def _pool_rows(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray | list[np.ndarray] | None:
        """Pages in the pool's dtype are received straight into their blocks: the blocks' bytes, one
        array when they are consecutive, else one a block; None for pages that must be cast first."""
        if self.wire_dtype != self.pool.dtype:
            return None
        count, first = end - start, block_ids[start]
        if list(block_ids[start:end]) == list(range(first, first + count)):
            return self.pool[first : first + count].reshape(count, -1).view(np.uint8)
        return [self.pool[block].reshape(-1).view(np.uint8) for block in block_ids[start:end]]

    def _staging_rows(self, buffer: int, count: int) -> np.ndarray:
        return self._staging[buffer][:count]

    def _batches(self, count: int, max_keys: int) -> list[tuple[int, int]]:
        """(start, end) of each batch: halving sizes, so the last write, which nothing overlaps, is short.

        Each batch is a request of its own: one message more over the data plane, where they share
        a round trip, but ~1 ms apiece over gRPC here, hence few of them.
        """
        most = min(self.fetch_batch_pages, max_keys)
        bounds, start = [], 0
        while start < count:
            left = count - start
            size = min(most, left if left <= 2 * self.min_batch_pages else -(-left // 2))
            bounds.append((start, start + size))
            start += size
        return bounds

    def _reject(self, address: str, rejected: PageRejected) -> None:
        """A fetched page failed its checksum (design note 6): count it, say so, have the node drop it."""
        self._count("pages_rejected", 1)
        log.warning("kvnode %s sent page %s whose bytes do not match its checksum; computing it and the pages "
                    "after it, and asking the node to drop it", address, rejected.key.hex())
        try:
            self._outbox.put_nowait(_Drop(address, rejected.key))
        except queue.Full:
            pass  # the next reader that meets the page reports it again

    def _write_blocks(self, block_ids: Sequence[int], pages: np.ndarray) -> None:
        """pages[i] -> pool[block_ids[i]], one slice copy (or cast) per run of consecutive blocks.

        A fancy-indexed assignment that also casts float16 to float32 ran 3x slower here.
        """
        start = 0
        while start < len(block_ids):
            end = start + 1
            while end < len(block_ids) and block_ids[end] == block_ids[end - 1] + 1:
                end += 1
            first = block_ids[start]
            if pages.dtype != self.pool.dtype:  # float16 pages, float32 pool
                float16_to_float32(pages[start:end], self.pool[first : first + end - start])
            else:
                np.copyto(self.pool[first : first + end - start], pages[start:end])
            start = end

    def on_page_full(self, key: bytes, parent: bytes, block_id: int, placement: Placement) -> None:
        """Queue a copy of a newly full page for every placed node; never blocks (a full queue drops it)."""
        if not any(self.nodes.may_be_usable(a) for a in placement.addresses):
            self._count("pages_dropped", len(placement.addresses))
            return
        # A plain copy (the block may be reused); the sender casts a float32 one to the wire dtype,
        # because NumPy's float32 -> float16 cast (~2-10 ms a gpt2-small page here) would delay the token.
        data = self.pool[block_id].copy()
        try:
            self._outbox.put_nowait((tuple(placement.addresses), key, parent, data))
        except queue.Full:
            self._count("pages_dropped", 1)

    def _count(self, name: str, amount: int) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + amount)

    def _fetch_timeout(self, pages: int) -> float:
        return 1.0 + pages * self.page_bytes / 100e6  # generous: 100 MB/s is far below loopback

    # ---- write-back ------------------------------------------------------------

    def _send_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                first = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < 64:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._send_drops([item for item in batch if isinstance(item, _Drop)])
                self._send([item for item in batch if not isinstance(item, _Drop)])
            except Exception as exc:  # a bug of ours must not end write-back for the life of the process
                log.exception("write-back of %d pages failed: %r; dropping them", len(batch), exc)
                self._count("pages_dropped", len(batch))
            finally:
                for _ in batch:
                    self._outbox.task_done()

    def _send_drops(self, drops: list[_Drop]) -> None:
        """Before the batch's puts, so a page computed in place of a dropped one is stored after the drop."""
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

    def _send(self, batch: list) -> None:
        by_node: dict[str, list] = {}
        for addresses, key, parent, data in batch:
            wire = data.astype(self.wire_dtype, copy=False)
            checksum = page_checksum(key, wire)  # once per page, for every placed node (design note 5)
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
                    result = node.client.put_pages(keys, parents, pages, timeout=self._fetch_timeout(len(part)),
                                                   checksums=checksums)
                except NodeError as exc:
                    self._count("pages_dropped", len(items) - start)
                    self.nodes.failed(node, exc)
                    return
                self.nodes.succeeded(node)
                self._count("pages_written", result.stored + result.already_present)
                self._count("pages_refused", result.refused)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued page was sent or dropped (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._outbox.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._outbox.unfinished_tasks

    def close(self) -> None:
        self._stopping.set()
        self._sender.join(timeout=5.0)
        self._fetcher.shutdown(wait=True)
        self.nodes.close()
