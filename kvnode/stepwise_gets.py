"""NodeClient's GETs that hand the pages over as they land rather than all at once (kvnode/client.py):
get_pages_in_batches, batch by batch, and get_pages_in_bands, band by band (kvnode/data_wire.py
note 6); each falls back to gRPC, or to whole pages, as NodeClient's other calls do. Each function
here is the NodeClient method of its name, whose docstring says what it does, run for `client`
with that client's data plane, fallbacks and deadline.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Callable, Sequence

import numpy as np

from kvnode import data_wire as dw
from kvnode.checksum import CHECKSUM_BYTES, page_digest
from kvnode.client_types import NodeError, PageRejected, check_keys, verified
from kvnode.data_client_io import DataPlaneError

log = logging.getLogger("kvnode.client")


def get_pages_in_batches(client, batches: Sequence[Sequence[bytes]],
                         out_for: Callable[[int], np.ndarray | list[np.ndarray]],
                         landed: Callable[[int], None], timeout: float | None) -> None:
    """NodeClient.get_pages_in_batches for `client` (a NodeClient)."""
    page_bytes = client._known_info().page_bytes
    firsts = list(itertools.accumulate((len(keys) for keys in batches), initial=0))  # each batch's first page
    checksums = [bytearray(len(keys) * CHECKSUM_BYTES) for keys in batches]
    outs: dict[int, np.ndarray | list[np.ndarray]] = {}
    done = 0

    def checked(number: int) -> np.ndarray | list[np.ndarray]:
        if number not in outs:  # asked once, even when a retry or the fallback asks again
            outs[number] = _checked_pages(out_for(number), len(batches[number]), page_bytes)
        return outs[number]

    def count(number: int) -> None:
        nonlocal done
        verified(client.address, batches[number], outs.pop(number), checksums[number], first=firsts[number])
        landed(number)
        done = number + 1

    if not all(batches):
        raise ValueError("every batch needs at least one key")
    plane = client._data_plane() if batches else None
    deadline = time.monotonic() + (timeout or client.timeout)
    if plane is not None:
        for keys in batches:
            check_keys(client.address, keys)
        try:
            plane.get_batches(batches, lambda i: (_byte_views(checked(i)), memoryview(checksums[i])),
                              count, timeout or client.timeout)
            return
        except DataPlaneError as exc:
            if done:
                raise NodeError(client.address, exc.code, exc.details) from None
            client._data_plane_failed(plane, exc)  # returns only to fall back to gRPC
    for number in range(len(batches)):  # nothing landed over the data plane
        out = checked(number)
        rows = out if isinstance(out, np.ndarray) else np.empty((len(out), page_bytes), dtype=np.uint8)
        client._grpc_get_pages(batches[number], rows, checksums[number], client._time_left(deadline))
        if rows is not out:
            for page, row in zip(out, rows):
                np.copyto(page, row)
        count(number)


def get_pages_in_bands(client, keys: Sequence[bytes], outs: Sequence[np.ndarray], band_bytes: int,
                       landed: Callable[[int], None], timeout: float | None) -> None:
    """NodeClient.get_pages_in_bands for `client` (a NodeClient)."""
    page_bytes = client._known_info().page_bytes
    if len(outs) != len(keys):
        raise ValueError(f"{len(outs)} page buffers for {len(keys)} keys: give one per key")
    for out in outs:
        if out.shape != (page_bytes,) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"each page buffer must be a C-contiguous uint8 array of shape ({page_bytes},), "
                             f"got {out.dtype} {out.shape}")
    bands = dw.caller_band_bounds(page_bytes, band_bytes)
    if not keys:
        return
    deadline = time.monotonic() + (timeout or client.timeout)
    plane = client._data_plane() if not client._bands_refused else None
    if plane is not None:
        check_keys(client.address, keys)
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
                            timeout or client.timeout)
        except DataPlaneError as exc:
            if done:
                raise NodeError(client.address, exc.code, exc.details) from None
            if dw.is_unknown_op(exc.code, exc.details):
                log.info("kvnode %s: its data plane predates banded GETs; fetching whole pages", client.address)
                client._bands_refused = True
            else:
                client._data_plane_failed(plane, exc)  # returns only to fall back to a plain GET
        else:
            for index, (key, digest) in enumerate(zip(keys, digests)):
                if digest.digest() != bytes(checksums[index * CHECKSUM_BYTES : (index + 1) * CHECKSUM_BYTES]):
                    raise PageRejected(client.address, index, bytes(key))
            return
    whole = np.empty((len(keys), page_bytes), dtype=np.uint8)
    try:
        client.get_pages(keys, out=whole, timeout=client._time_left(deadline))
    except PageRejected as exc:  # the pages before it are intact: theirs as a banded GET would leave them
        for out, page in zip(outs[: exc.index], whole):
            np.copyto(out, page)
        raise
    for out, page in zip(outs, whole):
        np.copyto(out, page)
    for band in range(len(bands)):
        landed(band)


def _checked_pages(out, count: int, page_bytes: int) -> np.ndarray | list[np.ndarray]:
    """`out` when it holds `count` pages: a C-contiguous (count, page_bytes) uint8 array, or a list
    of `count` C-contiguous (page_bytes,) uint8 arrays; ValueError saying what it is otherwise."""
    if isinstance(out, np.ndarray):
        shape = (count, page_bytes)
        if out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}, got {out.dtype} {out.shape}")
        return out
    if len(out) != count or any(page.shape != (page_bytes,) or page.dtype != np.uint8 or not page.flags.c_contiguous
                                for page in out):
        raise ValueError(f"out must be {count} C-contiguous uint8 arrays of shape ({page_bytes},), one a page")
    return out


def _byte_views(out: np.ndarray | list[np.ndarray]) -> memoryview | list[memoryview]:
    """What the data plane receives `out`'s pages into: one view of all, or one a page."""
    return memoryview(out).cast("B") if isinstance(out, np.ndarray) else [memoryview(page) for page in out]
