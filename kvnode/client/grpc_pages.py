"""The client's side of the gRPC page methods (GetPages, PutPages), NodeClient's way for page
bytes when the node has no data plane it can use: the PageChunk stream received into the
caller's array, and the PutItem stream cut from the caller's pages (framing: kvnode/wire/grpc_frames.py)."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import grpc
import numpy as np

from kvnode.wire import grpc_frames as wire
from kvnode.wire.checksum import CHECKSUM_BYTES
from kvnode.client.types import NodeError


def receive_pages(stream: Iterable[bytes], keys: Sequence[bytes], out: np.ndarray, checksums: bytearray,
                  address: str) -> None:
    """A GetPages reply's chunks into `out` (len(keys) x page_bytes) and the pages' checksums into
    `checksums`; NodeError(DATA_LOSS) for a chunk out of range, bytes missing or a page without its
    checksum. grpc.RpcError passes through."""
    page_bytes = out.shape[1]
    received = 0
    summed = [False] * len(keys)
    flat = out.reshape(-1)
    try:
        for message in stream:
            index, offset, data, sums = wire.parse_page_chunk(message)
            start = index * page_bytes + offset
            if index >= len(keys) or start + data.nbytes > flat.size:
                raise NodeError(address, grpc.StatusCode.DATA_LOSS, f"chunk out of range: page {index}")
            flat[start : start + data.nbytes] = np.frombuffer(data, dtype=np.uint8)
            received += data.nbytes
            starting = -(-data.nbytes // page_bytes) if offset == 0 else 0  # pages that begin in this chunk
            if sums.nbytes == starting * CHECKSUM_BYTES:
                checksums[index * CHECKSUM_BYTES : (index + starting) * CHECKSUM_BYTES] = sums
                summed[index : index + starting] = [True] * starting
    except wire.MalformedMessage as exc:
        raise NodeError(address, grpc.StatusCode.DATA_LOSS, f"PageChunk does not parse: {exc}") from None
    if received != out.nbytes:
        raise NodeError(address, grpc.StatusCode.DATA_LOSS, f"received {received} of {out.nbytes} bytes of pages")
    if not all(summed):
        key = bytes(keys[summed.index(False)])
        raise NodeError(address, grpc.StatusCode.DATA_LOSS,
                        f"the node sent page {key.hex()} without its checksum (a node older than this client?): "
                        "upgrade the node; its pages cannot be used unchecked")


def put_messages(items: Sequence[tuple[bytes, bytes, memoryview]], checksums: Sequence[bytes],
                 chunk: int) -> Iterator[bytes]:
    """PutItem messages for (key, parent, page) `items`, each page cut in `chunk`-byte pieces, the
    key, parent and checksum on a page's first piece, `last` on the final one."""
    for number, ((key, parent, view), checksum) in enumerate(zip(items, checksums), start=1):
        for offset in range(0, max(view.nbytes, 1), chunk):
            first, last = offset == 0, number == len(items) and offset + chunk >= view.nbytes
            yield wire.put_item(key if first else b"", parent if first else b"", view[offset : offset + chunk],
                                last, checksum if first else b"")
