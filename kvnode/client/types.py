"""What NodeClient (node_client.py) returns (NodeInfo, PutResult) and raises
(NodeError, PageRejected), and what it checks: the keys it sends over the data plane, the arrays
pages are received into, the pages it received against their checksums, and what is left of a
call's timeout for a gRPC fallback. Here so that its calls kept in other modules (stepwise_gets.py)
check as it does. Other parts import these names from kvnode.client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import grpc
import numpy as np

from kvnode.wire.checksum import CHECKSUM_BYTES, first_mismatch
from kvnode.wire.keys import InvalidRequest, check_key


class NodeError(Exception):
    """A kvnode call failed; `code` is the grpc.StatusCode, `details` the node's message."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        super().__init__(f"kvnode {address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details


class PageRejected(NodeError):
    """Page `index` of a get_pages (`key`) does not match its checksum: the node's copy was altered
    after its put. The pages before it were received intact; it and those after are not to be used."""

    def __init__(self, address: str, index: int, key: bytes):
        super().__init__(address, grpc.StatusCode.DATA_LOSS,
                         f"page {key.hex()} (number {index} of the request) does not match its checksum: "
                         "its bytes changed after its writer computed it (on the node, most likely); "
                         "compute it instead and have the node drop it")
        self.index = index
        self.key = key


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    version: str
    page_bytes: int
    capacity_pages: int
    used_pages: int
    leased_pages: int
    free_pages: int
    max_keys_per_request: int
    max_message_bytes: int
    data_port: int = 0  # 0: the node has no data plane
    ram_capacity_pages: int = 0
    ram_used_pages: int = 0
    disk_capacity_pages: int = 0  # 0: the node has no disk tier
    disk_used_pages: int = 0
    dirty_pages: int = 0  # in RAM, not yet written to disk
    data_host: str = ""  # the data plane's advertised host; "": the host of the gRPC address
    data_unix: str = ""  # the data plane's abstract unix socket name; "": none
    max_leases_per_call: int = 0  # most keys a Lookup may lease; 0: max_keys_per_request


@dataclass(frozen=True)
class PutResult:
    """Per page, in request order: 'stored', 'already_present', 'refused_no_parent' or 'refused_no_room'."""

    outcomes: tuple[str, ...]

    @property
    def stored(self) -> int:
        return self.outcomes.count("stored")

    @property
    def already_present(self) -> int:
        return self.outcomes.count("already_present")

    @property
    def refused(self) -> int:
        return sum(1 for o in self.outcomes if o.startswith("refused"))


def check_keys(address: str, keys: Sequence[bytes], parents: Sequence[bytes] = ()) -> None:
    """The data plane's framing carries 16-byte keys only: refuse others as the node would."""
    try:
        for key in keys:
            check_key(key)
        for parent in parents:
            if parent:  # a root's parent is empty
                check_key(parent, "parent key")
    except InvalidRequest as exc:
        raise NodeError(address, grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def verified(address: str, keys: Sequence[bytes], out: np.ndarray, checksums: bytearray, first: int = 0) -> np.ndarray:
    """`out` when every page matches its checksum; else PageRejected for the first that does not,
    numbered from `first` (where these keys begin in the caller's request)."""
    sums = [bytes(checksums[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES]) for i in range(len(keys))]
    index = first_mismatch(keys, out, sums)
    if index is not None:
        raise PageRejected(address, first + index, bytes(keys[index]))
    return out


def checked_array(out: np.ndarray, count: int, page_bytes: int) -> np.ndarray:
    """`out` when it is a C-contiguous (count, page_bytes) uint8 array; ValueError otherwise."""
    shape = (count, page_bytes)
    if out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}, got {out.dtype} {out.shape}")
    return out


def checked_pages(out, count: int, page_bytes: int) -> np.ndarray | list[np.ndarray]:
    """`out` when it holds `count` pages: a checked_array, or a list of `count` C-contiguous
    (page_bytes,) uint8 arrays; ValueError saying what it is otherwise."""
    if isinstance(out, np.ndarray):
        return checked_array(out, count, page_bytes)
    if len(out) != count or any(page.shape != (page_bytes,) or page.dtype != np.uint8 or not page.flags.c_contiguous
                                for page in out):
        raise ValueError(f"out must be {count} C-contiguous uint8 arrays of shape ({page_bytes},), one a page")
    return out


def time_left(address: str, deadline: float) -> float:
    """What a gRPC fallback may still take of the call's timeout (the data plane's try counts)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise NodeError(address, grpc.StatusCode.DEADLINE_EXCEEDED,
                        "the call's timeout ran out on the data plane, before the gRPC fallback")
    return left
