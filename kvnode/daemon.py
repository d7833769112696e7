"""`kvcache node`: start a KV-store node and serve until SIGTERM or Ctrl-C, then drain:
membership beats stop first (coordinators take the node out of the ring), health says
NOT_SERVING, no new gRPC call or data plane connection or request is taken, and the calls and
transfers already running get --drain-timeout seconds to finish before the rest is cut.
With --data-dir, the pages still only in RAM are then written to disk before it exits."""

from __future__ import annotations

import argparse
import logging
import time

from base import addresses, member, observability, security, serving, startup
from base.pool_sizes import MAX_NODE_POOL_BYTES, MIN_POOL_BYTES, describe, leased_pages, node_pool
from base.units import format_size, parse_size
from kvnode.disk.data_dir import DataDir
from kvnode.eviction import ALIASES, NODE_POLICIES, POLICIES, PREFIX_LRU
from kvnode.data_plane.server import DEFAULT_MAX_CONNECTIONS, DataPlaneServer
from kvnode.disk.tier import CHECK_AT_START, DISK_CHECKS, DiskTier
from kvnode.store.flusher import DEFAULT_FLUSH_INTERVAL_S, Flusher, check_flush_interval
from kvnode.metrics import NodeMetrics
from kvnode.service import DEFAULT_MAX_KEYS, SERVICE_NAME, KVStoreService, handler
from kvnode.store.page_store import PageStore
from protos import kvcache_pb2 as pb

log = logging.getLogger("kvnode")

# One float32 page of the embedded `tiny` model: 4 layers x (k,v) x 4 heads x 16 tokens x 64 dims x 4 bytes.
DEFAULT_PAGE_BYTES = 4 * 2 * 4 * 16 * 64 * 4
DEFAULT_MAX_LEASED_FRACTION = 0.5
DEFAULT_CAPACITY = "256MiB"  # without --model; with it, sized to lease a full context (base/pool_sizes.py)
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serving.add_listen_arguments(parser, default_port=50051)
    parser.add_argument(
        "--capacity", default=None, metavar="SIZE",
        help=f"memory for the page pool, allocated at start (default {DEFAULT_CAPACITY}; with --model, enough "
             "that one lookup may lease a whole prompt of the model's full context, at least "
             f"{describe(MIN_POOL_BYTES)} and at most {describe(MAX_NODE_POOL_BYTES)}: 720MiB for "
             "smollm2-135m in float32 at --max-leased-fraction 0.5)"
    )
    parser.add_argument(
        "--page-bytes",
        type=int,
        default=DEFAULT_PAGE_BYTES,
        help=f"bytes per page; must match the workers' model (default {DEFAULT_PAGE_BYTES}, the tiny model in float32)",
    )
    parser.add_argument(
        "--eviction", default=PREFIX_LRU.name, metavar="POLICY",
        help=f"which leaf goes first when the pool is full: {', '.join(NODE_POLICIES)}; each evicts only "
             "leaves, so no page is cached without its prefix (default %(default)s; `kvcache bench eviction` "
             "compares them)",
    )
    parser.add_argument("--node-id", default=None,
                        help="name shown in Info and logs (default: the one kept in --data-dir, else random)")
    parser.add_argument(
        "--data-dir", default=None, metavar="DIR",
        help="keep pages in a file of slots under DIR (created if missing), so they survive a restart, "
             "also after a crash: a node started again on DIR checks every page and serves the intact ones. "
             "Each page is written to disk within --flush-interval of its put; SIGTERM writes the rest. "
             "Default: none, pages live in RAM only and a restart starts empty")
    parser.add_argument(
        "--disk-capacity", default=None, metavar="SIZE",
        help="with --data-dir: how much DIR holds, reserved at start; at least --capacity. The node then "
             "holds that many pages, RAM a copy of those used last: a page RAM has no room for stays on "
             "disk and is read back when asked for (default: --capacity, so DIR keeps what RAM holds)")
    parser.add_argument(
        "--flush-interval", type=float, default=DEFAULT_FLUSH_INTERVAL_S, metavar="SECONDS",
        help="with --data-dir: seconds between writes of new pages to disk; a crash loses at most about the "
             "pages put in that time (and their descendants). 0 writes each page before its put is answered "
             "(default %(default)s)")
    parser.add_argument(
        "--disk-check", choices=DISK_CHECKS, default=CHECK_AT_START,
        help="with --data-dir: when a page's bytes on disk are checked against its slot's checksum. start: "
             "every slot once, when the node starts (a page this node writes is checksummed as written); a "
             "read then checks the slot's header only, and a page altered on disk later is served until "
             "a reader checking it against its writer's checksum (this project's clients check every page) "
             "reports it, then dropped. always: on every read as well, so the node never serves such a page, "
             "about a third more CPU a disk hit (default %(default)s)")
    parser.add_argument(
        "--max-keys", type=int, default=DEFAULT_MAX_KEYS, help=f"most pages per request (default {DEFAULT_MAX_KEYS})"
    )
    parser.add_argument(
        "--max-leased-fraction", type=float, default=DEFAULT_MAX_LEASED_FRACTION,
        help="most of the pool leased at once, so eviction always has room; a lookup past it leases and "
             "counts as hits only the pages that fit (default %(default)s: half the pool)",
    )
    parser.add_argument(
        "--max-leases-per-call", type=int, default=None,
        help="most keys one Lookup may ask to lease; more is refused RESOURCE_EXHAUSTED (default: --max-keys)",
    )
    parser.add_argument(
        "--max-message-bytes",
        default="8MiB",
        help="largest gRPC message sent or accepted; larger pages are chunked (default 8MiB)",
    )
    parser.add_argument(
        "--data-port", type=int, default=0,
        help="TCP port of the data plane, a plain binary protocol on --host beside gRPC that moves page "
             "bytes without gRPC's per-message costs (NodeClient fetches and stores pages over it); "
             "0 picks a free one (default 0); Info advertises it. Behind a firewall give a fixed port and "
             "open it beside --port",
    )
    parser.add_argument(
        "--data-max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
        help="data plane connections served at once, a thread each; one more is refused and its client "
             "uses gRPC for that call. Each client keeps up to 4 idle ones (default %(default)s)",
    )
    parser.add_argument(
        "--no-data-unix", action="store_true",
        help="no abstract Unix socket beside the data plane's TCP port (by default the data plane also "
             "listens on one, advertised in Info, which clients on this host reaching the node at a "
             "loopback address use: same framing and bounds, ~1.5x the throughput, and with --tls-* the "
             "same mutual TLS). Firewall rules on --data-port do not apply to it: any process in this "
             "network namespace can connect to it, as it can to the loopback port",
    )
    parser.add_argument(
        "--no-shared-pool", action="store_true",
        help="do not let clients on this host copy pages out of the node's RAM pool (by default a plaintext "
             "node keeps its pool in shared memory, and a process of the node's own user, or root, on the "
             "unix socket may map it read-only and copy the pages it fetches straight out of it, ~1.8x the unix "
             "socket's throughput; with --tls-* it is never offered)",
    )
    parser.add_argument(
        "--no-data-plane", action="store_true",
        help="serve pages over gRPC only (clients then use GetPages/PutPages)",
    )
    parser.add_argument(
        "--drain-timeout", "--grace", dest="drain_timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, seconds the gRPC calls and data plane transfers already running get to finish "
             "before they are cut (default %(default)s; --grace is the old name)",
    )
    member.add_arguments(parser)
    security.add_arguments(parser)
    observability.add_arguments(parser)


def shares_pool(args, credentials) -> bool:
    """Whether the pool goes in shared memory (kvnode/wire/shared_pool.py): only where it can be offered."""
    return not (args.no_shared_pool or args.no_data_unix or args.no_data_plane or credentials is not None)


def run(args: argparse.Namespace) -> int:
    startup.log_to_stderr()
    try:
        if args.capacity is None:
            args.capacity = DEFAULT_CAPACITY
        capacity_bytes = parse_size(args.capacity)
        max_message_bytes = parse_size(args.max_message_bytes)
        if args.page_bytes < 1:
            raise ValueError(f"--page-bytes must be positive, got {args.page_bytes}")
        if args.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must not be negative, got {args.drain_timeout}")
        if args.max_keys < 1:
            raise ValueError(f"--max-keys must be positive, got {args.max_keys}")
        eviction = ALIASES.get(args.eviction, args.eviction)
        if eviction not in NODE_POLICIES:
            why = " evicts pages whose children are cached (bench only)" if eviction in POLICIES else " is unknown"
            raise ValueError(f"--eviction {args.eviction}{why}: choose one of {', '.join(NODE_POLICIES)}")
        capacity_pages = capacity_bytes // args.page_bytes
        if capacity_pages < 1:
            raise ValueError(
                f"--capacity {args.capacity} holds no page of {args.page_bytes} bytes: give at least {args.page_bytes} bytes"
            )
        if not 0.0 <= args.max_leased_fraction <= 1.0:
            raise ValueError(f"--max-leased-fraction must be between 0 and 1, got {args.max_leased_fraction}")
        max_leases_per_call = args.max_keys if args.max_leases_per_call is None else args.max_leases_per_call
        if max_leases_per_call < 1:
            raise ValueError(f"--max-leases-per-call must be at least 1, got {max_leases_per_call}")
        member.advertised_address(args, args.port)  # refused before the pool is allocated
        credentials = security.from_args(args)
        serving.tune_allocator()
        data_dir, disk = open_disk_tier(args, capacity_pages)
        store = PageStore(capacity_pages, args.page_bytes, policy=eviction,
                          max_leased_pages=leased_pages(disk.capacity_pages if disk else capacity_pages,
                                                        args.max_leased_fraction),
                          max_leases_per_call=max_leases_per_call, disk=disk, write_through=args.flush_interval == 0,
                          shared_pool=shares_pool(args, credentials))
        if store.recovered is not None:
            log.info("%s", store.recovered.summary(disk))
        node_id = data_dir.node_id(args.node_id) if data_dir else args.node_id
        service = KVStoreService(store, node_id, args.max_keys, max_message_bytes)
        observability.setup_tracing(args, "kvcache-node")
        metrics = NodeMetrics(store) if args.metrics_port is not None else None
        service.metrics = metrics
        server, health = serving.make_server(
            [handler(service)], [SERVICE_NAME], max_message_bytes,
            interceptors=observability.server_interceptors(SERVICE_NAME, metrics and metrics.durations))
        port = serving.bind(server, args.host, args.port, credentials)
        address = member.advertised_address(args, port)
        data_plane = None
        if not args.no_data_plane:
            if not 0 <= args.data_port <= 65535:
                raise ValueError(f"--data-port must be between 0 and 65535, got {args.data_port}")
            if args.data_max_connections < 1:
                raise ValueError(f"--data-max-connections must be at least 1, got {args.data_max_connections}")
            try:
                data_plane = DataPlaneServer(store, args.host, args.data_port, args.max_keys,
                                             max_connections=args.data_max_connections, credentials=credentials,
                                             unix=not args.no_data_unix, share_pool=not args.no_shared_pool)
            except OSError as exc:
                raise OSError(f"cannot listen on {serving.host_port(args.host, args.data_port)} "
                              f"for the data plane: {exc.strerror or exc}") from None
            service.data_port = data_plane.port
            service.data_host = addresses.split_host_port(address)[0]
            service.data_unix = data_plane.unix_name
            data_plane.metrics = metrics
        metrics_server = (observability.start_metrics(metrics.registry, args, credentials)
                          if metrics is not None else None)
    except (ValueError, OSError, MemoryError) as exc:
        return startup.refuse("node", exc)

    stopping = startup.answer_signals(args.host, credentials, log)
    flusher = Flusher(store, args.flush_interval).start() if disk is not None and args.flush_interval > 0 else None
    server.start()
    if data_plane is not None:
        data_plane.start()
    serving.freeze_startup_objects()
    print(
        f"kvnode {service.node_id} listening on {serving.host_port(args.host, port)} "
        f"({capacity_pages} pages of {args.page_bytes} bytes, {format_size(capacity_pages * args.page_bytes)}, "
        f"eviction {store.policy.name}"
        + (f"; disk tier {store.capacity_pages} pages, {format_size(store.capacity_pages * args.page_bytes)}, "
           f"{store.num_used()} recovered, disk check {disk.check}" if disk is not None else "")
        + f"; {lease_says(store, args)})",
        flush=True,
    )
    if data_plane is not None:
        log.info("data plane (GET/PUT of pages over %s) on %s%s", "TLS" if credentials else "plain TCP",
                 serving.host_port(args.host, data_plane.port),
                 f" and the abstract unix socket @{data_plane.unix_name}" if data_plane.unix_name else "")
    else:
        log.info("data plane off (--no-data-plane): pages move over gRPC only")
    registration = pb.RegisterRequest(
        role="node", capacity_bytes=store.capacity_pages * args.page_bytes, page_bytes=args.page_bytes
    )
    membership = member.start_from_args(args, address, registration, lambda: node_load(store), credentials)
    serving.wait_until(stopping)
    drain(args.drain_timeout, membership, health, server, service, data_plane, flusher)
    if metrics_server is not None:
        metrics_server.stop()
    if disk is not None:
        disk.close()
        data_dir.close()
    return 0


def lease_says(store: PageStore, args: argparse.Namespace) -> str:
    """How much of a prompt one lookup can lease here; with the workers' model known (`kvcache node
    --model` sets args.model_context: name, page tokens, max positions), in its tokens, and when that
    is less than its full context, the --capacity that leases one."""
    leased = store.max_leased_pages
    says = f"leases at most {leased} pages at once, --max-leased-fraction {args.max_leased_fraction:g} of the pool"
    context = getattr(args, "model_context", None)
    if context is None:
        return says
    name, page_tokens, max_positions = context
    if leased * page_tokens >= max_positions:
        return f"{says}: a whole {max_positions}-token prompt of {name}"
    says = f"{says}: {leased * page_tokens} tokens of a {name} prompt, fewer than its {max_positions}"
    whole = node_pool(args.page_bytes, max_positions, page_tokens, args.max_leased_fraction)
    return says if whole.capped else f"{says}; --capacity {whole.size()} leases a whole one"


def open_disk_tier(args: argparse.Namespace, capacity_pages: int) -> tuple[DataDir | None, DiskTier | None]:
    """The data folder and its disk tier when --data-dir is given (ValueError for bad options)."""
    if args.data_dir is None:
        if args.disk_capacity is not None:
            raise ValueError("--disk-capacity needs --data-dir: say where the pages go")
        return None, None
    check_flush_interval(args.flush_interval)
    disk_pages = capacity_pages
    if args.disk_capacity is not None:
        disk_pages = parse_size(args.disk_capacity) // args.page_bytes
        if disk_pages < capacity_pages:
            raise ValueError(f"--disk-capacity {args.disk_capacity} holds {disk_pages} pages, fewer than --capacity's "
                             f"{capacity_pages}: the disk keeps every page RAM holds, give at least --capacity")
    data_dir = DataDir(args.data_dir, args.page_bytes)
    try:
        return data_dir, DiskTier(data_dir.path, disk_pages, args.page_bytes, check=args.disk_check)
    except BaseException:
        data_dir.close()
        raise


def drain(timeout_s: float, membership, health, server, service: KVStoreService, data_plane,
          flusher: Flusher | None = None) -> None:
    """The stop sequence of the module docstring; every wait bounded by timeout_s (+2 s to join)."""
    started = time.monotonic()
    if membership is not None:
        membership.stop()
    health.enter_graceful_shutdown()
    calls = service.calls_in_flight()
    grpc_stopped = server.stop(timeout_s)  # new calls refused at once; running ones get timeout_s
    log.info("stopping: draining %d gRPC calls and the data plane's transfers for up to %.1fs", calls, timeout_s)
    finished, cut = data_plane.drain(timeout_s) if data_plane is not None else (0, 0)
    left = max(0.0, started + timeout_s - time.monotonic())
    if not grpc_stopped.wait(left + 2.0):
        log.warning("gRPC server did not stop within %.1fs; exiting anyway", timeout_s + 2.0)
    calls_cut = service.calls_in_flight()
    log.info("drained in %.2fs: %d data plane transfers finished, %d cut; %d gRPC calls were running, "
             "%d still at the end (cut)", time.monotonic() - started, finished, cut, calls, calls_cut)
    store = service.store
    if store.disk is not None:
        written = flusher.stop() if flusher is not None else store.flush()
        log.info("wrote %d pages to the disk tier; it holds %d pages", written, store.num_on_disk())
    log.info("stopped")  # the last line, as every daemon's


def node_load(store: PageStore) -> pb.MemberLoad:
    stats = store.stats
    return pb.MemberLoad(
        used_pages=store.num_used(), capacity_pages=store.capacity_pages,
        hit_pages=stats.hit_pages, miss_pages=stats.miss_pages, evictions=stats.evictions,
    )
