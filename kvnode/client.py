"""NodeClient: the one way other parts talk to a kvnode.

Every call has a deadline; failures raise NodeError, which keeps the gRPC status code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc
import numpy as np

from kvnode import wire
from protos import kvcache_pb2 as pb

_SERVICE = "/kvcache.v1.KVStore/"
DEFAULT_TIMEOUT_S = 5.0
_CLIENT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class NodeError(Exception):
    """A kvnode call failed; `code` is the grpc.StatusCode, `details` the node's message."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        super().__init__(f"kvnode {address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details


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


def _byte_view(page, index: int) -> memoryview:
    try:
        return memoryview(page).cast("B")
    except TypeError as exc:
        raise ValueError(f"page {index} is not a C-contiguous bytes-like buffer: {exc}") from None


class NodeClient:
    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", _CLIENT_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _CLIENT_MAX_MESSAGE_BYTES),
            ],
        )
        self._info = self._channel.unary_unary(
            _SERVICE + "Info", pb.InfoRequest.SerializeToString, pb.NodeInfo.FromString
        )
        self._lookup = self._channel.unary_unary(
            _SERVICE + "Lookup", pb.LookupRequest.SerializeToString, pb.LookupReply.FromString
        )
        self._get_pages = self._channel.unary_stream(
            _SERVICE + "GetPages", pb.GetPagesRequest.SerializeToString, None  # framed by kvnode.wire
        )
        self._put_pages = self._channel.stream_unary(_SERVICE + "PutPages", None, pb.PutReply.FromString)
        self._stats = self._channel.unary_unary(
            _SERVICE + "Stats", pb.StatsRequest.SerializeToString, pb.NodeStats.FromString
        )
        self._node_info: NodeInfo | None = None

    # ---- calls ---------------------------------------------------------------

    def info(self, timeout: float | None = None) -> NodeInfo:
        reply = self._call(self._info, pb.InfoRequest(), timeout)
        self._node_info = NodeInfo(
            reply.node_id,
            reply.version,
            reply.page_bytes,
            reply.capacity_pages,
            reply.used_pages,
            reply.leased_pages,
            reply.free_pages,
            reply.max_keys_per_request,
            reply.max_message_bytes,
        )
        return self._node_info

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0, timeout: float | None = None) -> int:
        """How many of `keys`, from the first, are cached; leases them for lease_ms when > 0."""
        return self._call(self._lookup, pb.LookupRequest(keys=keys, lease_ms=lease_ms), timeout).hits

    def get_pages(self, keys: Sequence[bytes], out: np.ndarray | None = None, timeout: float | None = None) -> np.ndarray:
        """The pages' bytes as a (len(keys), page_bytes) uint8 array, written into `out` when given."""
        page_bytes = self._known_info().page_bytes
        shape = (len(keys), page_bytes)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}, got {out.dtype} {out.shape}")
        received = 0
        try:
            stream = self._get_pages(pb.GetPagesRequest(keys=keys), timeout=timeout or self.timeout)
            flat = out.reshape(-1)
            for message in stream:
                index, offset, data = wire.parse_page_chunk(message)
                start = index * page_bytes + offset
                if index >= len(keys) or start + data.nbytes > flat.size:
                    raise NodeError(self.address, grpc.StatusCode.DATA_LOSS, f"chunk out of range: page {index}")
                flat[start : start + data.nbytes] = np.frombuffer(data, dtype=np.uint8)
                received += data.nbytes
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        except wire.MalformedMessage as exc:
            raise NodeError(self.address, grpc.StatusCode.DATA_LOSS, f"PageChunk does not parse: {exc}") from None
        if received != out.nbytes:
            raise NodeError(
                self.address, grpc.StatusCode.DATA_LOSS, f"received {received} of {out.nbytes} bytes of pages"
            )
        return out

    def put_pages(
        self, keys: Sequence[bytes], parents: Sequence[bytes], pages, timeout: float | None = None
    ) -> PutResult:
        """Store pages, parents first; `pages` is (n, page_bytes) bytes-like rows (a root's parent is b"")."""
        if not len(keys) == len(parents) == len(pages):
            raise ValueError(f"got {len(keys)} keys, {len(parents)} parents and {len(pages)} pages: give one of each per page")
        # Checked here, in the caller's thread: a flaw found while gRPC pulls the stream
        # surfaces only as "UNKNOWN: Exception iterating requests!".
        items = [(bytes(memoryview(k)), bytes(memoryview(p)), _byte_view(page, i))
                 for i, (k, p, page) in enumerate(zip(keys, parents, pages))]
        chunk = self._known_info().max_message_bytes - 64

        def messages():
            for number, (key, parent, view) in enumerate(items, start=1):
                for offset in range(0, max(view.nbytes, 1), chunk):
                    first, last = offset == 0, number == len(keys) and offset + chunk >= view.nbytes
                    yield wire.put_item(
                        key if first else b"", parent if first else b"", view[offset : offset + chunk], last
                    )

        reply = self._call(self._put_pages, messages(), timeout)
        names = {o: pb.PutReply.Outcome.Name(o).lower() for o in pb.PutReply.Outcome.values()}
        return PutResult(tuple(names[o] for o in reply.outcomes))

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        reply = self._call(self._stats, pb.StatsRequest(), timeout)
        return {field.name: getattr(reply, field.name) for field in reply.DESCRIPTOR.fields}

    # ---- plumbing ------------------------------------------------------------

    def _known_info(self) -> NodeInfo:
        return self._node_info or self.info()

    def _call(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _error(self, exc: grpc.RpcError) -> NodeError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return NodeError(self.address, code, details or "no details")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
