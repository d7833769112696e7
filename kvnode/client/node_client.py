"""NodeClient: the one way other parts talk to a kvnode.

Every call has a deadline; failures raise NodeError, which keeps the gRPC status code.
get_pages, put_pages and lookup go over the node's data plane (kvnode/data_plane/server.py) when its
Info advertises one, else over gRPC (lookup also from a node whose data plane predates its
LOOKUP op); a data plane never reached (a firewall, or a node that died before
the first connection) sends calls over gRPC, and Info and the data plane are tried again after
DATA_PLANE_RETRY_S, doubled at each failure up to MAX_DATA_PLANE_RETRY_S, a log line each (given
up for good, a node met while it restarted stayed on gRPC for the client's life). When the node's
same-host Unix socket name has nobody listening (the node exited or restarted), the next call
reads Info again first: a node restarted since gives its new name.
Pages carry checksums (kvnode/wire/checksum.py): put_pages sends them (computed here unless the
caller did once for several nodes), get_pages checks every page it received against its own
before returning, and raises PageRejected at the first that does not match; get_pages_in_batches
checks each batch so before handing it over; get_pages_in_bands hands each band over as it
lands and checks the pages once their last band did (so a caller that used a band must be able
to throw that work away on PageRejected). pin_pages leaves pages pinned in the node's shared
pool for a caller that reads them in place, through its own mapping of shared_pool_file's
descriptor, and releases them itself (shared_pool_pins.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from base import security
from base.observability import traced_channel
from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import CHECKSUM_BYTES, page_checksum
from kvnode.client import grpc_pages, shared_pool_pins, stepwise_gets
from kvnode.client.data_client import DataPlaneClient
from kvnode.client.data_client_io import DataPlaneError
from kvnode.client.shared_pool_pins import PinnedPages
from kvnode.client.shared_pool_reader import SharedPoolFile
from kvnode.client.types import (NodeError, NodeInfo, PageRejected, PutResult, check_keys, checked_array,
                                 time_left, verified)
from protos import kvcache_pb2 as pb
from protos import kvcache_pb2_grpc as pb_grpc
from protos.methods import method_path

log = logging.getLogger("kvnode.client")

# GetPages and PutPages carry page bytes framed by kvnode/wire/grpc_frames.py, not parsed by protobuf: hand-built calls.
_GET_PAGES = method_path("KVStore", "GetPages")
_PUT_PAGES = method_path("KVStore", "PutPages")
DEFAULT_TIMEOUT_S = 5.0
DATA_PLANE_RETRY_S, MAX_DATA_PLANE_RETRY_S = 5.0, 300.0  # a data plane never reached: gRPC meanwhile
_CLIENT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def _byte_view(page, index: int) -> memoryview:
    try:
        return memoryview(page).cast("B")
    except TypeError as exc:
        raise ValueError(f"page {index} is not a C-contiguous bytes-like buffer: {exc}") from None


_OUTCOME_NAMES = {o: pb.PutReply.Outcome.Name(o).lower() for o in pb.PutReply.Outcome.values()}


def _host_of(address: str) -> str | None:
    """The host of a gRPC target "host:port" or "[v6]:port"; None for other target forms."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class NodeClient:
    """`use_data_plane=False` keeps every call on gRPC (benches and tests compare the two);
    `unix_socket=False` keeps the data plane on TCP when the node also offers its same-host
    socket (the bench compares the two); `shared_memory=False` keeps it on that socket when the
    node would also let it copy pages out of its shared pool (shared_pool_reader.py);
    `credentials` (base.security) make both gRPC and the data plane mutual TLS."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT_S, use_data_plane: bool = True,
                 credentials: security.Credentials | None = None, unix_socket: bool = True,
                 shared_memory: bool = True):
        self.address = address
        self.unix_socket = unix_socket
        self.shared_memory = shared_memory
        self.credentials = credentials
        self.timeout = timeout
        self.use_data_plane = use_data_plane
        self._data: DataPlaneClient | None = None
        self._data_retry_s, self._data_off_until = 0.0, 0.0  # gRPC until then: the data plane never connected
        self._told_busy = False
        self._bands_refused = threading.Event()  # the node's data plane predates GET_BANDS: plain GETs instead
        self._lookups_refused = False  # the node's data plane predates LOOKUP: lookups over gRPC instead
        self._data_lock = threading.Lock()
        self._channel = traced_channel(security.channel(
            address, credentials,
            options=[
                ("grpc.max_receive_message_length", _CLIENT_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _CLIENT_MAX_MESSAGE_BYTES),
            ],
        ))
        stub = pb_grpc.KVStoreStub(self._channel)
        self._info = stub.Info
        self._lookup = stub.Lookup
        self._get_pages = self._channel.unary_stream(
            _GET_PAGES, pb.GetPagesRequest.SerializeToString, None  # framed by kvnode.wire
        )
        self._put_pages = self._channel.stream_unary(_PUT_PAGES, None, pb.PutReply.FromString)
        self._stats = stub.Stats
        self._drop_pages = stub.DropPages
        self._node_info: NodeInfo | None = None

    # ---- calls ---------------------------------------------------------------

    def info(self, timeout: float | None = None) -> NodeInfo:
        reply = self._call(self._info, pb.InfoRequest(), timeout)
        self._node_info = NodeInfo(**{name: getattr(reply, name) for name in NodeInfo.__dataclass_fields__})
        return self._node_info

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0, timeout: float | None = None) -> int:
        """How many of `keys`, from the first, are cached; leases them for lease_ms when > 0. Over the
        data plane when the client uses one (its LOOKUP op), else over gRPC."""
        deadline = time.monotonic() + (timeout or self.timeout)
        plane = None
        if keys and not self._lookups_refused and isinstance(lease_ms, int) and 0 <= lease_ms < 2**32:
            plane = self._data_plane(timeout or self.timeout)  # Info, when unknown, within the lookup's timeout
        if plane is not None:  # no keys, or a lease_ms gRPC's uint32 refuses: over gRPC, as ever
            check_keys(self.address, keys)
            try:
                return plane.lookup(keys, lease_ms, time_left(self.address, deadline))
            except DataPlaneError as exc:
                if dw.is_unknown_op(exc.code, exc.details):
                    log.info("kvnode %s: its data plane predates LOOKUP; lookups go over gRPC", self.address)
                    self._lookups_refused = True
                elif exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._data_plane_failed(plane, exc)  # returns only to fall back to gRPC
                # else a refused lease or a node at its connection bound (kvnode/wire/data_frames.py, LOOKUP): gRPC's Lookup
                # refuses the one with the same code and message and serves the other; not a busy sign
            timeout = time_left(self.address, deadline)
        return self._call(self._lookup, pb.LookupRequest(keys=keys, lease_ms=lease_ms), timeout).hits

    def get_pages(self, keys: Sequence[bytes], out: np.ndarray | None = None, timeout: float | None = None) -> np.ndarray:
        """The pages' bytes as a (len(keys), page_bytes) uint8 array, written into `out` when given,
        each checked against its checksum: PageRejected names the first that fails (design above)."""
        shape = (len(keys), self._known_info().page_bytes)
        out = np.empty(shape, dtype=np.uint8) if out is None else checked_array(out, *shape)
        if not keys:
            return out  # nothing to fetch: (0, page_bytes), no call
        checksums = bytearray(len(keys) * CHECKSUM_BYTES)
        plane = self._data_plane()
        if plane is not None:
            check_keys(self.address, keys)
            deadline = time.monotonic() + (timeout or self.timeout)
            try:
                plane.get_into(keys, memoryview(out).cast("B"), memoryview(checksums), timeout or self.timeout)
                return verified(self.address, keys, out, checksums)
            except DataPlaneError as exc:
                self._data_plane_failed(plane, exc)  # returns only to fall back to gRPC
            timeout = time_left(self.address, deadline)
        self._grpc_get_pages(keys, out, checksums, timeout)
        return verified(self.address, keys, out, checksums)

    def get_pages_in_batches(self, batches: Sequence[Sequence[bytes]],
                             out_for: Callable[[int], np.ndarray | list[np.ndarray]],
                             landed: Callable[[int], None], timeout: float | None = None) -> None:
        """get_pages of several batches, in order: batch i into out_for(i), a (len, page_bytes) uint8
        array or a list of len (page_bytes,) uint8 arrays, one a page (so pages bound for scattered
        memory land there with no copy in between), asked once its pages are coming (it may wait
        until that memory is free), checked
        against their checksums, then landed(i). Over the data plane every request is sent at once
        and the node answers them in turn, so the batches cost one round trip, not one each; over
        gRPC they go one by one. A page that fails its checksum raises PageRejected, its index
        counted from the first page of the first batch: the batches before its own landed, and
        the pages of its batch before it are intact in that batch's array (landed is not called
        for it). Any other failure after some batches landed raises NodeError: those stay the
        caller's."""
        self._stepwise().get_pages_in_batches(batches, out_for, landed, timeout)

    def get_pages_in_bands(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], band_bytes: int,
                           landed: Callable[[int], None], timeout: float | None = None) -> None:
        """The pages of `keys` into outs[i] (a C-contiguous uint8 array of page_bytes each), sent
        band-major in bands of band_bytes (GET_BANDS, kvnode/wire/data_frames.py); landed(b) once band b of
        every page arrived, in band order. Each page is hashed band by band as it lands and checked
        once its last band did: PageRejected names the first that fails, after every landed call
        (the bands handed over must then be thrown away). Over gRPC, or from a node whose data
        plane predates the op, the pages come whole and every band lands at the end."""
        self._stepwise().get_pages_in_bands(keys, outs, band_bytes, landed, timeout)

    def pin_pages(self, keys: Sequence[bytes], timeout: float | None = None, check: bool = True) -> PinnedPages | None:
        """The pages pinned in the node's shared pool, to read in place through shared_pool_file's
        mapping of the same generation and release() soon: the node drops unreleased pins after its
        data plane timeout (60 s by default). Checked first (unless `check` is False: then the
        caller checks them with first_altered() before it trusts them): PageRejected, or NodeError
        NOT_FOUND, with nothing left pinned. None, nothing pinned, when they cannot be read in
        place: get_pages them then. `timeout` bounds the call (shared_pool_pins.py)."""
        return shared_pool_pins.pin_pages(self.address, self._known_info, self._data_plane, keys,
                                          timeout or self.timeout, check)

    def shared_pool_file(self) -> SharedPoolFile | None:
        """While this client has the node's pool mapped: a new descriptor of it (the caller's to close),
        its shape and the mapping's generation, which a remapped pool (a restarted node's) changes
        None while nothing is mapped. Asks the node nothing."""
        plane = self._data
        return plane.shared_pool_file() if plane is not None else None

    def shared_pool_state(self, wait: float = 0.0) -> str | None:
        """This client's mapping of the node's pool (made in the background): "unasked", "mapping",
        "mapped" or "refused", once a mapping under way ended or `wait` seconds passed; None while it
        has no data plane client. Begins no mapping; asks the node nothing."""
        plane = self._data
        return plane.pool_state_after(wait) if plane is not None else None

    def _grpc_get_pages(self, keys: Sequence[bytes], out: np.ndarray, checksums: bytearray,
                        timeout: float | None) -> None:
        try:
            stream = self._get_pages(pb.GetPagesRequest(keys=keys), timeout=timeout or self.timeout)
            grpc_pages.receive_pages(stream, keys, out, checksums, self.address)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def put_pages(
        self, keys: Sequence[bytes], parents: Sequence[bytes], pages, timeout: float | None = None,
        checksums: Sequence[bytes] | None = None,
    ) -> PutResult:
        """Store pages, parents first; `pages` is (n, page_bytes) bytes-like rows (a root's parent is b"").
        `checksums`: the pages' (page_checksum), when the caller computed them once for several nodes."""
        if not len(keys) == len(parents) == len(pages):
            raise ValueError(f"got {len(keys)} keys, {len(parents)} parents and {len(pages)} pages: give one of each per page")
        if checksums is not None and len(checksums) != len(keys):
            raise ValueError(f"got {len(checksums)} checksums for {len(keys)} pages: give one per page")
        # Checked here, in the caller's thread: a flaw found while gRPC pulls the stream
        # surfaces only as "UNKNOWN: Exception iterating requests!".
        items = [(bytes(memoryview(k)), bytes(memoryview(p)), _byte_view(page, i))
                 for i, (k, p, page) in enumerate(zip(keys, parents, pages))]
        if checksums is None:
            checksums = [page_checksum(key, view) for key, _, view in items]
        info = self._known_info()
        plane = self._data_plane() if items else None
        if plane is not None:
            keys, parents, views = zip(*items)
            check_keys(self.address, keys, parents)
            for key, view in zip(keys, views):
                if view.nbytes != info.page_bytes:
                    raise NodeError(self.address, grpc.StatusCode.INVALID_ARGUMENT,
                                    f"page {key.hex()} has {view.nbytes} bytes; this node stores pages of "
                                    f"{info.page_bytes} bytes")
            deadline = time.monotonic() + (timeout or self.timeout)
            try:
                outcomes = plane.put(keys, parents, checksums, views, info.page_bytes, timeout or self.timeout)
                return PutResult(tuple(_OUTCOME_NAMES.get(o, "unknown") for o in outcomes))
            except DataPlaneError as exc:
                self._data_plane_failed(plane, exc)  # returns only to fall back to gRPC
            timeout = time_left(self.address, deadline)
        messages = grpc_pages.put_messages(items, checksums, info.max_message_bytes - 64)
        reply = self._call(self._put_pages, messages, timeout)
        return PutResult(tuple(_OUTCOME_NAMES.get(o, "unknown") for o in reply.outcomes))

    def drop_pages(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """Tell the node these pages failed their checksums here: it drops each with its descendants;
        how many pages went."""
        return self._call(self._drop_pages, pb.DropPagesRequest(keys=keys), timeout).dropped

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        reply = self._call(self._stats, pb.StatsRequest(), timeout)
        return {field.name: getattr(reply, field.name) for field in reply.DESCRIPTOR.fields}

    # ---- plumbing ------------------------------------------------------------

    def _known_info(self, timeout: float | None = None) -> NodeInfo:
        """The node's Info, asked (within `timeout`, else the client's) only when not known."""
        plane = self._data
        if plane is not None and plane.unix_gone:  # the node's socket name went: a restarted node has a new one
            with self._data_lock:
                if plane.unix_gone:
                    plane.unix_gone = False
                    self._node_info = None
        return self._node_info or self.info(timeout)

    def data_plane_address(self) -> str | None:
        """host:port of the node's data plane this client uses (or tries first), or None when it uses gRPC."""
        plane = self._data_plane()
        return plane.address if plane is not None else None

    def data_plane_transport(self) -> str | None:
        """"shared memory" (the node's pool mapped), "unix" (its same-host socket) or "tcp" for the
        data plane this client uses, None on gRPC."""
        plane = self._data_plane()
        return plane.transport if plane is not None else None

    def prepare_data_plane(self) -> None:
        """Begin now, in the background, what the first data plane call would wait for or do
        beside it: the shared pool's mapping."""
        plane = self._data_plane()
        if plane is not None:
            plane.start_mapping()

    def map_shared_pool(self, timeout: float | None = None) -> bool:
        """Map the node's shared pool now rather than in the background; whether pages now come out
        of it."""
        plane = self._data_plane()
        return plane is not None and plane.map_pool(timeout or self.timeout)

    def _data_plane(self, timeout: float | None = None) -> DataPlaneClient | None:
        """The data plane client, or None on gRPC; `timeout` bounds the Info asked when unknown."""
        if not self.use_data_plane or time.monotonic() < self._data_off_until:
            return None
        info = self._known_info(timeout)
        port = info.data_port
        if not port:
            return None
        with self._data_lock:
            unix = info.data_unix if self.unix_socket else ""
            if self._data is None or (self._data.port, self._data.offered_unix) != (port, unix):
                host = info.data_host or _host_of(self.address)
                if host is None:
                    log.warning("kvnode %s: cannot tell its host for the data plane; using gRPC", self.address)
                    self.use_data_plane = False
                    return None
                if self._data is not None:
                    self._data.close()
                tls = self.credentials.client_context() if self.credentials is not None else None
                self._data = DataPlaneClient(host, port, tls, unix, self.shared_memory)
            if self._data_retry_s and self._data.connected_once:
                self._data_retry_s = 0.0  # reached: the next one that never connects waits the first delay
            return self._data

    def _data_plane_failed(self, plane: DataPlaneClient, exc: DataPlaneError) -> None:
        """Fall back to gRPC for a while when the data plane was never reachable, for this call when
        it is busy (RESOURCE_EXHAUSTED: all its connections taken, or too many put bytes in
        flight; gRPC has its own bounds) or closed a new connection unanswered (a busy refusal
        can arrive so; a node that is down fails over gRPC too); else raise."""
        if exc.connect_failed and not plane.connected_once:
            self._data_retry_s = min(MAX_DATA_PLANE_RETRY_S, max(DATA_PLANE_RETRY_S, 2 * self._data_retry_s))
            self._data_off_until = time.monotonic() + self._data_retry_s
            self._node_info = None  # a node restarted meanwhile advertises another port
            log.warning("kvnode %s: data plane %s unreachable (%s); using gRPC, trying it again in %gs",
                        self.address, plane.address, exc.details, self._data_retry_s)
            return
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED or exc.closed_unanswered:
            if not self._told_busy:
                log.info("kvnode %s: data plane busy or closing (%s); such calls go over gRPC (said once per client)",
                         self.address, exc.details)
                self._told_busy = True
            return
        if exc.connect_failed:
            self._node_info = None  # a restarted node may listen on another data port: ask Info again
        raise NodeError(self.address, exc.code, exc.details) from None

    def _stepwise(self) -> stepwise_gets.StepwiseGets:
        """What get_pages_in_batches and _in_bands use of this client, for one call (stepwise_gets.py)."""
        return stepwise_gets.StepwiseGets(self.address, self.timeout, self._known_info, self._data_plane,
                                          self._data_plane_failed, self._grpc_get_pages, self.get_pages,
                                          self._bands_refused)

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
        with self._data_lock:
            if self._data is not None:
                self._data.close()
        self._channel.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
