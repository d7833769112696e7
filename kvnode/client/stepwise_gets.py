"""NodeClient's GETs that hand the pages over as they land rather than all at once (node_client.py):
get_pages_in_batches, batch by batch, and get_pages_in_bands, band by band (GET_BANDS,
kvnode/wire/data_frames.py); each falls back to gRPC, or to whole pages, as NodeClient's other calls do. Each method
of StepwiseGets is the NodeClient method of its name, whose docstring says what it does.

StepwiseGets is handed exactly what these calls use of their NodeClient (its Info, its data plane
and the handling of its failures, its gRPC and whole-page GETs), so that this module depends on
those calls and not on the client's insides. NodeClient builds one a call instead of keeping one:
holding the client's bound methods, a kept one would put the client in a reference cycle, and a
client dropped unclosed would then wait for the garbage collector to free its sockets.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import CHECKSUM_BYTES, page_digest
from kvnode.client.data_client_io import DataPlaneError
from kvnode.client.types import NodeError, NodeInfo, PageRejected, check_keys, checked_pages, time_left, verified

if TYPE_CHECKING:
    from kvnode.client.data_client import DataPlaneClient

log = logging.getLogger("kvnode.client")


class StepwiseGets:
    """One stepwise GET of the NodeClient at `address`, whose default call timeout is `timeout`:
    known_info() is its Info (asked once, again when stale); data_plane() its data plane client,
    None for gRPC; data_plane_failed(plane, exc) returns only when the call is to fall back to gRPC;
    grpc_get_pages(keys, out, checksums, timeout) fills `out` over gRPC; get_pages(keys, out=,
    timeout=) is its whole-page GET. `bands_refused`, the client's across calls, is set once the
    node's data plane turned out to predate GET_BANDS: plain GETs from then on."""

    def __init__(self, address: str, timeout: float, known_info: Callable[[], NodeInfo],
                 data_plane: Callable[[], DataPlaneClient | None],
                 data_plane_failed: Callable[[DataPlaneClient, DataPlaneError], None],
                 grpc_get_pages: Callable[..., None], get_pages: Callable[..., np.ndarray],
                 bands_refused: threading.Event):
        self.address = address
        self.timeout = timeout
        self.known_info = known_info
        self.data_plane = data_plane
        self.data_plane_failed = data_plane_failed
        self.grpc_get_pages = grpc_get_pages
        self.get_pages = get_pages
        self.bands_refused = bands_refused

    def get_pages_in_batches(self, batches: Sequence[Sequence[bytes]],
                             out_for: Callable[[int], np.ndarray | list[np.ndarray]],
                             landed: Callable[[int], None], timeout: float | None) -> None:
        page_bytes = self.known_info().page_bytes
        firsts = list(itertools.accumulate((len(keys) for keys in batches), initial=0))  # each batch's first page
        checksums = [bytearray(len(keys) * CHECKSUM_BYTES) for keys in batches]
        outs: dict[int, np.ndarray | list[np.ndarray]] = {}
        done = 0

        def checked(number: int) -> np.ndarray | list[np.ndarray]:
            if number not in outs:  # asked once, even when a retry or the fallback asks again
                outs[number] = checked_pages(out_for(number), len(batches[number]), page_bytes)
            return outs[number]

        def count(number: int) -> None:
            nonlocal done
            verified(self.address, batches[number], outs.pop(number), checksums[number], first=firsts[number])
            landed(number)
            done = number + 1

        if not all(batches):
            raise ValueError("every batch needs at least one key")
        plane = self.data_plane() if batches else None
        deadline = time.monotonic() + (timeout or self.timeout)
        if plane is not None:
            for keys in batches:
                check_keys(self.address, keys)
            try:
                plane.get_batches(batches, lambda i: (_byte_views(checked(i)), memoryview(checksums[i])),
                                  count, timeout or self.timeout)
                return
            except DataPlaneError as exc:
                if done:
                    raise NodeError(self.address, exc.code, exc.details) from None
                self.data_plane_failed(plane, exc)  # returns only to fall back to gRPC
        for number in range(len(batches)):  # nothing landed over the data plane
            out = checked(number)
            rows = out if isinstance(out, np.ndarray) else np.empty((len(out), page_bytes), dtype=np.uint8)
            self.grpc_get_pages(batches[number], rows, checksums[number], time_left(self.address, deadline))
            if rows is not out:
                for page, row in zip(out, rows):
                    np.copyto(page, row)
            count(number)

    def get_pages_in_bands(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], band_bytes: int,
                           landed: Callable[[int], None], timeout: float | None) -> None:
        page_bytes = self.known_info().page_bytes
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} page buffers for {len(keys)} keys: give one per key")
        for out in outs:
            if out.shape != (page_bytes,) or out.dtype != np.uint8 or not out.flags.c_contiguous:
                raise ValueError(f"each page buffer must be a C-contiguous uint8 array of shape ({page_bytes},), "
                                 f"got {out.dtype} {out.shape}")
        bands = dw.caller_band_bounds(page_bytes, band_bytes)
        if not keys:
            return
        deadline = time.monotonic() + (timeout or self.timeout)
        plane = self.data_plane() if not self.bands_refused.is_set() else None
        if plane is not None:
            check_keys(self.address, keys)
            checksums = bytearray(len(keys) * CHECKSUM_BYTES)
            digests = [page_digest(k) for k in keys]  # fed band by band
            done = 0

            def hashed(band: int) -> None:
                nonlocal done
                start, end = bands[band]
                for digest, out in zip(digests, outs):
                    digest.update(out[start:end])
                done = band + 1
                landed(band)

            try:
                plane.get_bands(keys, [memoryview(out) for out in outs], memoryview(checksums), band_bytes, hashed,
                                timeout or self.timeout)
            except DataPlaneError as exc:
                if done:
                    raise NodeError(self.address, exc.code, exc.details) from None
                if dw.is_unknown_op(exc.code, exc.details):
                    log.info("kvnode %s: its data plane predates banded GETs; fetching whole pages", self.address)
                    self.bands_refused.set()
                else:
                    self.data_plane_failed(plane, exc)  # returns only to fall back to a plain GET
            else:
                for index, (key, digest) in enumerate(zip(keys, digests)):
                    if digest.digest() != bytes(checksums[index * CHECKSUM_BYTES : (index + 1) * CHECKSUM_BYTES]):
                        raise PageRejected(self.address, index, bytes(key))
                return
        whole = np.empty((len(keys), page_bytes), dtype=np.uint8)
        try:
            self.get_pages(keys, out=whole, timeout=time_left(self.address, deadline))
        except PageRejected as exc:  # the pages before it are intact: theirs as a banded GET would leave them
            for out, page in zip(outs[: exc.index], whole):
                np.copyto(out, page)
            raise
        for out, page in zip(outs, whole):
            np.copyto(out, page)
        for band in range(len(bands)):
            landed(band)


def _byte_views(out: np.ndarray | list[np.ndarray]) -> memoryview | list[memoryview]:
    """What the data plane receives `out`'s pages into: one view of all, or one a page."""
    return memoryview(out).cast("B") if isinstance(out, np.ndarray) else [memoryview(page) for page in out]
