"""Fetching pages from one kvnode into the engine's pool: the transfer half of the remote tier.

The tier (worker/remote/tier.py) chooses the node, checks what it holds and decides what a failure
means; a PageFetcher receives the pages it was asked for and writes them into their blocks. Pages
bound for blocks of a pool in the wire dtype (the engine's own) are received straight into them,
consecutive or not; a float32 pool's float16 pages go through staging buffers and are cast
(worker/kv/half.py).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import grpc
import numpy as np

from kvnode.client import NodeError, PageRejected
from worker.kv.half import float16_to_float32
from worker.remote.nodes import Node


def transfer_timeout(pages: int, page_bytes: int) -> float:
    """A deadline for moving `pages` pages to or from a node."""
    return 1.0 + pages * page_bytes / 100e6  # generous: 100 MB/s is far below loopback


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive blocks in block_ids."""
    runs, start = [], 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs



class PageFetcher:
    """Receives pages from a node into the engine's pool, one fetch at a time.

    `pool` is the engine's block array, in `wire_dtype` or float32; `count(name, amount)` adds to
    the tier's stats (pages_fetched, bytes_fetched).
    """

    def __init__(self, pool: np.ndarray, wire_dtype: np.dtype, fetch_batch_bytes: int, min_batch_bytes: int,
                 count: Callable[[str, int], None]):
        self.pool = pool
        self.wire_dtype = wire_dtype
        self.block_shape = pool.shape[1:]
        self.page_bytes = int(np.prod(self.block_shape)) * self.wire_dtype.itemsize
        self.num_layers = self.block_shape[0]
        self.fetch_batch_pages = max(1, fetch_batch_bytes // self.page_bytes)
        self.min_batch_pages = max(1, min(min_batch_bytes // self.page_bytes, self.fetch_batch_pages))
        self._count = count
        self._receiver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-fetch")
        self._fetch_lock = threading.Lock()  # one fill at a time owns the staging buffers
        # Two reused receive buffers for float16 pages bound for a float32 pool, touched now, not in a
        # request (fresh memory is written far slower: docs/benchmarks-log.md). A pool in the wire
        # dtype never needs them.
        self._staging = ([np.full((self.fetch_batch_pages, self.page_bytes), 0, dtype=np.uint8) for _ in range(2)]
                         if self.wire_dtype != pool.dtype else [])
        self._band_staging = np.empty((0, self.page_bytes), dtype=np.uint8)  # float16 layer-wise fills: grown, kept

    def fetch(self, node: Node, keys: Sequence[bytes], block_ids: Sequence[int]) -> tuple[int, NodeError | None]:
        """Receive `keys` into `block_ids`; (pages written, error or None). Every batch is checked
        before it is written; with PageRejected the pages before the rejected one were written, those
        of its own batch too (RemoteTier._reject: why the rest is computed).

        Pages in the pool's dtype are received straight into their blocks, here, in requests as large
        as the node takes: nothing is left to overlap, and each batch more cost a round trip or a
        thread hop that weighed most on the smallest pages. Pages to cast arrive in batches on the
        fetch thread while this one casts the batch before (see _fetch_staged)."""
        batches = self._batches(len(keys), node.max_keys)
        with self._fetch_lock:
            if self.wire_dtype == self.pool.dtype:
                return self._fetch_straight(node, keys, block_ids, batches)
            return self._fetch_staged(node, keys, block_ids, batches)

    def _fetch_straight(self, node: Node, keys: Sequence[bytes], block_ids: Sequence[int],
                        batches: list[tuple[int, int]]) -> tuple[int, NodeError | None]:
        written = 0

        def landed(number: int) -> None:
            nonlocal written
            start, end = batches[number]
            self._land(block_ids[start:end], None, end - start)
            written = end

        try:
            node.client.get_pages_in_batches([keys[start:end] for start, end in batches],
                                             lambda number: self._pool_rows(block_ids, *batches[number]), landed,
                                             timeout=self._fetch_timeout(len(keys)))
        except PageRejected as exc:  # the pages of its batch before it are in their blocks, intact
            self._land(block_ids[written : exc.index], None, exc.index - written)
            return exc.index, exc
        except NodeError as exc:
            return written, exc
        return len(keys), None

    def _fetch_staged(self, node: Node, keys: Sequence[bytes], block_ids: Sequence[int],
                      batches: list[tuple[int, int]]) -> tuple[int, NodeError | None]:
        """Batches let the transfer and the cast overlap instead of adding up: the fetch thread
        receives batch i+1 while this one casts batch i. Their requests all go out at once
        (get_pages_in_batches), so a fetch costs one round trip to the node, not one a batch; two
        staging buffers take turns, the fetch thread waiting for the one written last."""
        if len(batches) == 1:  # nothing to overlap: received and cast here, no thread hop
            rows = self._staging_rows(0, len(keys))
            try:
                node.client.get_pages_in_batches([keys], lambda _: rows, lambda _: None,
                                                 timeout=self._fetch_timeout(len(keys)))
            except PageRejected as exc:  # the pages before it are intact (RemoteTier._reject)
                self._land(block_ids[: exc.index], rows[: exc.index], exc.index)
                return exc.index, exc
            except NodeError as exc:
                return 0, exc
            self._land(block_ids, rows, len(keys))
            return len(keys), None
        landed: queue.SimpleQueue = queue.SimpleQueue()  # batch numbers as they arrive, then None
        free = [threading.Semaphore(1), threading.Semaphore(1)]  # staging buffer i may be received into
        abandoned = threading.Event()

        def out_for(number: int) -> np.ndarray:
            start, end = batches[number]
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

        pending = self._receiver.submit(receive)
        written = 0
        try:
            while (number := landed.get()) is not None:
                start, end = batches[number]
                self._land(block_ids[start:end], self._staging_rows(number % 2, end - start), end - start)
                free[number % 2].release()
                written = end
        finally:
            abandoned.set()
            error = pending.exception()  # the fetch thread lets go of the buffers before anyone reuses them
        if isinstance(error, PageRejected):  # the pages of its batch before it are intact (RemoteTier._reject)
            number, (start, end) = next((n, (b, e)) for n, (b, e) in enumerate(batches) if b <= error.index < e)
            if written != start:
                raise AssertionError(f"page {error.index} rejected in batch {number} ({start}..{end}), but "
                                     f"{written} pages were written before it: batches land in order")
            rows = self._staging_rows(number % 2, error.index - start)  # the fetch thread is done with it
            self._land(block_ids[start : error.index], rows, error.index - start)
            written = error.index
        if error is None or isinstance(error, NodeError):
            return written, error
        raise error

    def fetch_in_bands(self, node: Node, keys: Sequence[bytes], block_ids: Sequence[int],
                       landed: Callable[[int], None]) -> None:
        """Receive `keys` into `block_ids` in one banded GET, calling landed(l) once layer l of every
        page is in the pool; raises what the node's client raised. Pages in the pool's dtype land
        straight in their blocks; float16 ones bound for a float32 pool in a staging buffer kept
        between fills, each layer cast for every page at once as it lands (see `cast`)."""
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
                # beside the forward, that the fill ran several times longer (docs/architecture.md).
                bands = rows[:, layer * band_bytes : (layer + 1) * band_bytes].view(self.wire_dtype)
                np.copyto(halves, bands.reshape(halves.shape))
                float16_to_float32(halves, floats)
                for start, end in runs:
                    first = block_ids[start]
                    np.copyto(self.pool[first : first + end - start, layer], floats[start:end])
                landed(layer)

            node.client.get_pages_in_bands(keys, list(rows), band_bytes, cast, timeout=self._fetch_timeout(len(keys)))

    def _land(self, block_ids: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        """Write received rows into their blocks (None: they were received in place) and count them."""
        if rows is not None and count:
            self._write_blocks(block_ids, rows.view(self.wire_dtype).reshape(-1, *self.block_shape))
        self._count("pages_fetched", count)
        self._count("bytes_fetched", count * self.page_bytes)

    def _pool_rows(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray | list[np.ndarray]:
        """The bytes of blocks block_ids[start:end] of a pool in the wire dtype, to receive pages
        straight into: one array when the blocks are consecutive, else one a block."""
        count, first = end - start, block_ids[start]
        if list(block_ids[start:end]) == list(range(first, first + count)):
            return self.pool[first : first + count].reshape(count, -1).view(np.uint8)
        return [self.pool[block].reshape(-1).view(np.uint8) for block in block_ids[start:end]]

    def _staging_rows(self, buffer: int, count: int) -> np.ndarray:
        return self._staging[buffer][:count]

    def _batches(self, count: int, max_keys: int) -> list[tuple[int, int]]:
        """(start, end) of each batch. Pages to cast: halving sizes, so the last cast, which nothing
        overlaps, is short. Pages received straight into the pool: as many as the node takes.

        Each batch is a request of its own: one message more over the data plane, where they share
        a round trip, but ~1 ms apiece over gRPC here, hence few of them.
        """
        if self.wire_dtype == self.pool.dtype:  # received straight into the blocks: no cast to overlap
            return [(start, min(start + max_keys, count)) for start in range(0, count, max_keys)]
        most = min(self.fetch_batch_pages, max_keys)
        bounds, start = [], 0
        while start < count:
            left = count - start
            size = min(most, left if left <= 2 * self.min_batch_pages else -(-left // 2))
            bounds.append((start, start + size))
            start += size
        return bounds

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

    def _fetch_timeout(self, pages: int) -> float:
        return transfer_timeout(pages, self.page_bytes)

    def close(self) -> None:
        self._receiver.shutdown(wait=True)
