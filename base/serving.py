"""What every kvcache daemon's gRPC server shares: one factory with its options,
health and reflection, tolerant request parsing, and a bounded graceful stop."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import gc
import logging
import signal
import socket
import threading
from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from base import addresses

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


class Malformed:
    """Stands in for a request that did not parse, so the handler can answer INVALID_ARGUMENT.

    grpcio's threaded server, left to itself, aborts such a call with INTERNAL, and for
    a client stream may end the handler's iterator as if the stream were complete.
    """

    def __init__(self, reason: str):
        self.reason = reason


def tolerant(parse: Callable[[bytes], object], name: str) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except Exception as exc:  # any parse failure is the caller's mistake
            return Malformed(f"{name} message does not parse: {exc}")

    return deserialize


def add_listen_arguments(parser, default_port: int, reached: bool = False) -> None:
    """--host and --port, the same for every daemon; `reached`: --advertise for a daemon that
    registers nowhere (members add theirs with base.member)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=default_port,
                        help=f"port to listen on; 0 picks a free one (default {default_port})")
    if reached:
        parser.add_argument("--advertise", default=None, metavar="HOST[:PORT]",
                            help="the address clients reach this daemon at (a DNS name, a load balancer), shown "
                                 "on its listening line; it registers nowhere, so a wildcard --host needs none. "
                                 "PORT defaults to the bound one; an IPv6 address goes in brackets")


def parser_for(message_cls) -> Callable[[bytes], object]:
    """A request deserializer for a protobuf message class that never raises (see Malformed)."""
    return tolerant(message_cls.FromString, message_cls.DESCRIPTOR.name)


def serialize(message) -> bytes:
    return message.SerializeToString()


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str, logger: logging.Logger):
    """End the call with `code`: one log line, no traceback (the caller's mistake, not ours)."""
    logger.info("refused request: %s: %s", code.name, message)
    context.abort(code, message)


def abort_if_malformed(request: object, context: grpc.ServicerContext, logger: logging.Logger) -> None:
    if isinstance(request, Malformed):
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason, logger)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C). Install before printing the listening line,
    so a supervisor's early SIGTERM still stops the daemon gracefully."""
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    return stopping


def freeze_startup_objects() -> None:
    """Once a daemon has built its parts: move the objects made so far (modules, model, gRPC's;
    ~45k in a worker) out of the garbage collector's sight, for they live as long as the
    process. A full collection scanned them every time (~7-14 ms a collection here), and full
    collections come often when objects live a few seconds, as trace spans do in the exporter's
    queue: with tracing on, collections took 10% of a busy worker's samples (2.5% without)."""
    gc.collect()
    gc.freeze()


def wait_until(stopping: threading.Event) -> None:
    """Block the main thread until `stopping` is set, waking often enough for signals to run."""
    while not stopping.wait(timeout=1.0):
        pass


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Every daemon's gRPC server arguments. gRPC ignores an argument it does not know without a
    word, so tests/test_grpc_options.py checks each name is one its core reads."""
    return [
        # KV pages are far larger than gRPC's 4 MiB default; the node chunks replies to this size.
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Answer clients' keepalive pings even between calls, so idle channels stay up, and take
        # one every 5 s while no data flows (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
        # whose name has no "recv"): callers ping every 10 s (base/security.py), also through a long
        # prefill. Left at gRPC's default of one in 5 minutes, the third such ping ended the call
        # with GOAWAY too_many_pings: a 6,000-token prompt of the default model lost its worker.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        # One process per port: never share a port with a stale daemon.
        ("grpc.so_reuseport", 0),
    ]


def make_server(
    handlers: Iterable[grpc.GenericRpcHandler],
    service_names: Iterable[str],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int = 16,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, health.HealthServicer]:
    """A threaded gRPC server with health and reflection on; not yet bound or started.
    `interceptors`: metrics and tracing (base/observability.py), none unless they are on."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=server_options(max_message_bytes),
        # Beyond this many calls in flight, new ones get RESOURCE_EXHAUSTED instead of queueing forever.
        maximum_concurrent_rpcs=max_workers * 4,
        interceptors=list(interceptors),
    )
    for handler in handlers:
        server.add_generic_rpc_handlers((handler,))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, health_servicer


host_port = addresses.host_port  # kept here too: daemons print their address with it


def bind(server: grpc.Server, host: str, port: int, credentials=None) -> int:
    """Bind host:port (port 0 picks a free one) and return the port, or raise a clear error.
    With `credentials` (base.security.Credentials) the port takes mutual TLS only."""
    where = host_port(host, port)
    reason = _why_unbindable(host.strip("[]"), port)
    if reason:
        raise OSError(f"cannot listen on {where}: {reason}")
    try:
        if credentials is None:
            bound = server.add_insecure_port(where)
        else:
            bound = server.add_secure_port(where, credentials.server_credentials())
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {where} ({exc}): is the port taken?") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {where}: is the port taken or the host not local?")
    return bound


def _why_unbindable(host: str, port: int) -> str | None:
    """Ask plain sockets first: when gRPC fails to bind it writes its own log line to stderr
    and says only "Failed to bind", so a taken port would read as two muddled lines.
    Like gRPC, binding succeeds if any address `host` resolves to can be bound."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror})"
    reasons = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(address)
                return None
            except OSError as exc:
                in_use = exc.errno == errno.EADDRINUSE
                reasons.append(f"{exc.strerror}{': is another process listening there?' if in_use else ''}")
    return "; ".join(dict.fromkeys(reasons)) or "no address to listen on"


def stop(server: grpc.Server, health_servicer: health.HealthServicer, grace_s: float) -> None:
    """Health to NOT_SERVING first, then stop; the wait is bounded (a stuck call must not hang us)."""
    health_servicer.enter_graceful_shutdown()
    if not server.stop(grace_s).wait(timeout=grace_s + 2.0):
        log.warning("gRPC server did not stop within %.1fs; exiting anyway", grace_s + 2.0)


def tune_allocator() -> None:
    """Keep glibc from returning large message buffers to the kernel after each call.

    Fresh memory is written far slower than reused memory (measured here: ~1.6 against ~11 GB/s); raising the
    mmap and trim thresholds lets gRPC reuse its buffers. A no-op off glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc else None
    except (OSError, AttributeError):
        return
    if mallopt is None:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 * 1024 * 1024)
    mallopt(m_trim_threshold, 1024 * 1024 * 1024)
