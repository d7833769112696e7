"""The KVStore gRPC service: unpacks messages, calls the PageStore, turns its errors
into status codes. Bulk messages (PageChunk, PutItem) are framed by kvnode.wire. Pages go
out with their checksums and come in with them (kvnode/wire/checksum.py)."""

from __future__ import annotations

import functools
import logging
import threading
import uuid

import grpc

from base import security
from base.serving import DEFAULT_MAX_MESSAGE_BYTES, Malformed, tolerant
from base import version
from kvnode.wire import grpc_frames as wire
from kvnode.wire.checksum import CHECKSUM_BYTES
from kvnode.store.put_refusals import log_refused
from kvnode.store.page_store import InvalidRequest, LeaseRefused, PageNotFound, PageStore, check_key
from protos import kvcache_pb2 as pb
from protos.methods import service_name

log = logging.getLogger("kvnode")

SERVICE_NAME = service_name("KVStore")
READERS = ("worker",)  # whose certificates may look pages up, get, put and drop them: a client's certificate may not
# Trailing metadata of a Lookup whose hits the node's leased-pages bound cut short, so the client knows why it got fewer hits.
LEASE_LIMITED_KEY = "kvcache-lease-limited"
DEFAULT_MAX_KEYS = 256
_CHUNK_HEADROOM = 64  # bytes kept for a PageChunk's header within the message limit
# A PutItem's bytes beside its page (key, parent, checksum, tags: ~70); one that brings more (fields
# this node does not know) has its page copied out, so the message is not kept alive (_receive_pages).
_PUT_ITEM_SLACK = 1024


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class KVStoreService:
    def __init__(
        self,
        store: PageStore,
        node_id: str | None = None,
        max_keys_per_request: int = DEFAULT_MAX_KEYS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        if max_message_bytes <= _CHUNK_HEADROOM * 2:
            raise ValueError(f"max_message_bytes must exceed {_CHUNK_HEADROOM * 2}, got {max_message_bytes}")
        self.store = store
        self.node_id = node_id or uuid.uuid4().hex[:12]
        self.max_keys = max_keys_per_request
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = max_message_bytes - _CHUNK_HEADROOM
        self.data_port = 0  # the node's data plane port, advertised in Info; 0 = none
        self.data_host = ""  # its host as advertised (--advertise's); "" = the host clients dialed for gRPC
        self.data_unix = ""  # the data plane's abstract unix socket name; "" = none
        self.metrics = None  # kvnode.metrics.NodeMetrics with --metrics-port: bytes and put outcomes
        self._calls_in_flight = 0
        self._calls_lock = threading.Lock()

    def calls_in_flight(self) -> int:
        """Calls being handled now (the daemon's drain reports them)."""
        with self._calls_lock:
            return self._calls_in_flight

    def _count_call(self, step: int) -> None:
        with self._calls_lock:
            self._calls_in_flight += step

    # ---- handlers ------------------------------------------------------------

    def info(self, request, context) -> pb.NodeInfo:
        self._check_parsed(request, context)
        store = self.store
        leased = store.num_leased()
        return pb.NodeInfo(
            node_id=self.node_id,
            version=version.installed(),
            page_bytes=store.page_bytes,
            capacity_pages=store.capacity_pages,
            used_pages=store.num_used(),
            leased_pages=leased,
            free_pages=store.num_free(),
            max_keys_per_request=self.max_keys,
            max_message_bytes=self.max_message_bytes,
            data_port=self.data_port,
            data_host=self.data_host,
            data_unix=self.data_unix,
            ram_capacity_pages=store.ram_capacity_pages,
            ram_used_pages=store.num_in_ram(),
            disk_capacity_pages=store.capacity_pages if store.disk is not None else 0,
            disk_used_pages=store.num_on_disk(),
            dirty_pages=store.num_dirty(),
            max_leases_per_call=store.max_leases_per_call or 0,
        )

    def lookup(self, request, context) -> pb.LookupReply:
        self._check_parsed(request, context)
        security.refuse_unless_member(context, READERS, "Lookup", log)
        keys = self._checked_keys(request.keys, context)
        try:
            hits, cut = self.store.lookup_and_lease(keys, request.lease_ms)
        except InvalidRequest as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LeaseRefused as exc:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        if cut:
            message = (f"{hits} hits: this node leases at most {self.store.max_leased_pages} pages at once and "
                       "that many are leased; later pages were neither leased nor counted")
            log.info("lookup cut short: %s", message)
            context.set_trailing_metadata(((LEASE_LIMITED_KEY, message),))
        return pb.LookupReply(hits=hits)

    def get_pages(self, request, context):
        self._check_parsed(request, context)
        security.refuse_unless_member(context, READERS, "GetPages", log)
        keys = self._checked_keys(request.keys, context)
        if not keys:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "GetPages needs at least one key")
        page_bytes, chunk = self.store.page_bytes, self.chunk_bytes
        try:
            self.store.check_cached(keys)
            if page_bytes + CHECKSUM_BYTES <= chunk:
                # Few large messages (gRPC's cost is per message), each page with its checksum.
                per_message = chunk // (page_bytes + CHECKSUM_BYTES)
                for first in range(0, len(keys), per_message):
                    group = keys[first : first + per_message]
                    checksums = b"".join(self.store.checksums(group))
                    yield self.store.read(group, wire.page_chunk_header(first, 0, len(group) * page_bytes, checksums))
                    if self.metrics is not None:
                        self.metrics.pages_sent("grpc", len(group) * page_bytes)
                return
            for index, key in enumerate(keys):
                checksum = self.store.checksums([key])[0]
                page = memoryview(self.store.read([key]))  # read once, so every chunk is of one page
                for offset in range(0, page_bytes, chunk):
                    piece = page[offset : offset + chunk]
                    header = wire.page_chunk_header(index, offset, len(piece), checksum if offset == 0 else b"")
                    yield b"".join((header, piece))
                if self.metrics is not None:
                    self.metrics.pages_sent("grpc", page_bytes)
        except PageNotFound as exc:
            self._abort(context, grpc.StatusCode.NOT_FOUND, str(exc))

    def put_pages(self, request_iterator, context) -> pb.PutReply:
        security.refuse_unless_member(context, READERS, "PutPages", log)
        try:
            items = self._receive_pages(request_iterator)
            for key, parent, data, checksum in items:
                self.store.validate_put(key, parent, data, checksum)
        except (_Abort, InvalidRequest) as exc:
            code = exc.code if isinstance(exc, _Abort) else grpc.StatusCode.INVALID_ARGUMENT
            self._abort(context, code, str(exc))
        if not context.is_active():
            self._abort(context, grpc.StatusCode.CANCELLED, "PutPages stream ended abnormally; nothing stored")
        outcomes = [self.store.put(key, parent, data, checksum) for key, parent, data, checksum in items]
        if self.metrics is not None:
            self.metrics.pages_put("grpc", len(items) * self.store.page_bytes, outcomes)
        log_refused(outcomes)
        return pb.PutReply(outcomes=[int(o) for o in outcomes])

    def stats(self, request, context) -> pb.NodeStats:
        self._check_parsed(request, context)
        s = self.store.stats
        return pb.NodeStats(
            lookups=s.lookups,
            hit_pages=s.hit_pages,
            miss_pages=s.miss_pages,
            puts=s.puts,
            stored_pages=s.stored_pages,
            evictions=s.evictions,
            refusals=s.refusals,
            bytes_in=s.bytes_in,
            bytes_out=s.bytes_out,
            get_pages=s.get_pages,
            disk_reads=s.disk_reads,
            disk_writes=s.disk_writes,
            promotions=s.promotions,
            demotions=s.demotions,
            corrupted_pages_dropped=s.corrupted_dropped,
            orphaned_pages_dropped=s.orphans_dropped,
            recovered_pages=s.recovered_pages,
            recovery_ms=round(s.recovery_seconds * 1000),
            disk_errors=s.disk_errors,
            reported_pages_dropped=s.reported_dropped,
        )

    def drop_pages(self, request, context) -> pb.DropPagesReply:
        """A reader found these pages altered (their bytes fail their checksums): drop each with its descendants."""
        self._check_parsed(request, context)
        security.refuse_unless_member(context, READERS, "DropPages", log)
        keys = self._checked_keys(request.keys, context)
        dropped = 0
        for key in keys:
            count = self.store.drop_reported(key)
            if count:
                log.warning("dropped page %s and %d descendants: a reader (%s) found its bytes do not match its "
                            "checksum", key.hex(), count - 1, context.peer())
            dropped += count
        return pb.DropPagesReply(dropped=dropped)

    # ---- helpers -------------------------------------------------------------

    def _receive_pages(self, request_iterator) -> list[tuple[bytes, bytes, bytes, bytes | None]]:
        """Whole pages from a PutPages stream; any flaw rejects the whole stream.

        A page sent in pieces is copied into one buffer as they arrive, and every item must carry
        data: however a client splits its pages, a stream holds at most one page's bytes per page.
        A page sent whole is kept as a view of its message (no copy), unless the message is larger
        than the page by more than _PUT_ITEM_SLACK (unknown fields): a view keeps its whole message
        alive, and 256 such items of 8 MiB held 2 GiB for 32 MiB of pages. Then the page is copied.
        """
        page_bytes = self.store.page_bytes
        items: list[tuple[bytes, bytes, bytes, bytes | None]] = []
        key = parent = b""
        checksum: bytes | None = None  # of the page being received; None: the node computes it
        page: bytearray | None = None  # the page being assembled from pieces
        received = 0
        ended = False
        for message in request_iterator:
            if isinstance(message, Malformed):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{message.reason}; nothing stored")
            if ended:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "PutPages item after the one marked last; nothing stored")
            item_key, item_parent, data, ended, item_checksum = message
            if item_key:
                if key:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, _short_page(key, received, page_bytes))
                check_key(item_key)
                key, parent, page, received = item_key, item_parent, None, 0
                checksum = item_checksum or None
                if len(items) >= self.max_keys:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, self._too_many(len(items) + 1))
            elif not key:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "PutPages item has no key and follows no page")
            elif item_parent or item_checksum:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             "a continuation item must not carry a parent or a checksum (the page's first item does)")
            if not data.nbytes:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"a PutPages item of page {key.hex()} carries no data; every item carries part of a page")
            if received + data.nbytes > page_bytes:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"page {key.hex()} has more than {page_bytes} bytes; this node stores pages of {page_bytes} bytes",
                )
            if data.nbytes == page_bytes:
                if memoryview(data.obj).nbytes > page_bytes + _PUT_ITEM_SLACK:
                    data = bytes(data)  # the view would keep its whole (padded) message alive
                items.append((key, parent, data, checksum))
                key, received = b"", 0
                continue
            if page is None:
                page = bytearray(page_bytes)
            page[received : received + data.nbytes] = data
            received += data.nbytes
            if received == page_bytes:
                items.append((key, parent, page, checksum))
                key, page, received = b"", None, 0
        if key:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, _short_page(key, received, page_bytes))
        if not items:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "PutPages stream carried no pages")
        if not ended:
            # grpcio ends the iterator as if the stream were complete when a message is cut off
            # or over the size limit; only the marked final item says the stream really ended.
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         "PutPages stream ended without an item marked last (cut short?); nothing stored")
        return items

    def _checked_keys(self, keys, context) -> list[bytes]:
        if len(keys) > self.max_keys:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, self._too_many(len(keys)))
        keys = list(keys)
        try:
            for key in keys:
                check_key(key)
        except InvalidRequest as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return keys

    def _too_many(self, count: int) -> str:
        return f"{count} keys in one request; this node takes at most {self.max_keys}: split the request"

    def _check_parsed(self, request, context) -> None:
        if isinstance(request, Malformed):
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)

    @staticmethod
    def _abort(context, code: grpc.StatusCode, message: str):
        log.info("refused request: %s: %s", code.name, message)
        context.abort(code, message)


def _short_page(key: bytes, received: int, page_bytes: int) -> str:
    return f"page {key.hex()} ended after {received} of {page_bytes} bytes; nothing stored"


def handler(service: KVStoreService) -> grpc.GenericRpcHandler:
    """Method handlers for kvcache.v1.KVStore; every request is parsed tolerantly."""

    def parse(message_cls):
        return tolerant(message_cls.FromString, message_cls.DESCRIPTOR.name)

    def serialize(message):
        return message.SerializeToString()

    def counted(behavior):
        @functools.wraps(behavior)
        def call(request, context):
            service._count_call(1)
            try:
                return behavior(request, context)
            finally:
                service._count_call(-1)

        return call

    def counted_stream(behavior):
        @functools.wraps(behavior)
        def call(request, context):
            service._count_call(1)
            try:
                yield from behavior(request, context)
            finally:
                service._count_call(-1)

        return call

    methods = {
        "Info": grpc.unary_unary_rpc_method_handler(counted(service.info), parse(pb.InfoRequest), serialize),
        "Lookup": grpc.unary_unary_rpc_method_handler(counted(service.lookup), parse(pb.LookupRequest), serialize),
        "GetPages": grpc.unary_stream_rpc_method_handler(
            counted_stream(service.get_pages), parse(pb.GetPagesRequest), None  # replies are framed bytes already
        ),
        "PutPages": grpc.stream_unary_rpc_method_handler(
            counted(service.put_pages), tolerant(wire.parse_put_item, "PutItem"), serialize
        ),
        "Stats": grpc.unary_unary_rpc_method_handler(counted(service.stats), parse(pb.StatsRequest), serialize),
        "DropPages": grpc.unary_unary_rpc_method_handler(counted(service.drop_pages), parse(pb.DropPagesRequest),
                                                         serialize),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
