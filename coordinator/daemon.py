"""`kvcache coordinator`: membership, the ring, and routing of client prompts to workers."""

from __future__ import annotations

import argparse
import logging
import threading

from base import addresses, observability, security, serving, startup, tokens
from base.tls_front import TlsFront, listen
from coordinator.capacity import DEFAULT_MAX_STREAMS, server_threads
from coordinator.membership import Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.ring import DEFAULT_PREFIX_CHARS
from coordinator.service import SERVICE_NAME, TRACE_ROOTS, CoordinatorService, handler, run_sweeper
from protos.methods import method_path

log = logging.getLogger("coordinator")

# Called by members, not clients: no token (members hold certificates, not client tokens); the
# service refuses any caller without a member's certificate (security.refuse_unless_member).
MEMBER_METHODS = [method_path("Coordinator", name) for name in ("Register", "Heartbeat", "Deregister")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serving.add_listen_arguments(parser, default_port=addresses.COORDINATOR_PORT, reached=True)
    parser.add_argument("--replicas", type=int, default=2, help="kvnodes each sequence's pages go to (default 2)")
    parser.add_argument(
        "--prefix-chars",
        type=int,
        default=DEFAULT_PREFIX_CHARS,
        help=f"prompt characters that pick the placement when no session id is given (default {DEFAULT_PREFIX_CHARS})",
    )
    parser.add_argument("--coordinator-id", default=None, help="name shown in status and logs (default: random)")
    parser.add_argument(
        "--max-streams",
        type=int,
        default=DEFAULT_MAX_STREAMS,
        help=f"Generate streams relayed at once; more are refused with RESOURCE_EXHAUSTED "
             f"(default {DEFAULT_MAX_STREAMS}; membership and status calls have threads of their own)",
    )
    parser.add_argument("--grace", type=float, default=5.0, help="seconds running requests get on stop (default 5)")
    security.add_arguments(parser)
    tokens.add_arguments(parser)
    observability.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    startup.log_to_stderr()
    try:
        if args.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
        if args.prefix_chars < 1:
            raise ValueError(f"--prefix-chars must be at least 1, got {args.prefix_chars}")
        if args.max_streams < 1:
            raise ValueError(f"--max-streams must be at least 1, got {args.max_streams}")
        credentials = security.from_args(args)
        client_tokens = tokens.from_args(args)
        membership = Membership()
        service = CoordinatorService(membership, args.replicas, args.prefix_chars, args.coordinator_id,
                                     max_streams=args.max_streams, credentials=credentials,
                                     tokens=client_tokens)
        observability.setup_tracing(args, "kvcache-coordinator")
        metrics = CoordinatorMetrics(membership, service.router) if args.metrics_port is not None else None
        service.metrics = service.relay.metrics = metrics
        server, health = serving.make_server(
            [handler(service)], [SERVICE_NAME], max_workers=server_threads(args.max_streams),
            interceptors=tokens.interceptors(client_tokens, MEMBER_METHODS)
            + observability.server_interceptors(SERVICE_NAME, metrics and metrics.request_duration, TRACE_ROOTS))
        front = None
        if credentials is None:
            port = serving.bind(server, args.host, args.port)
        else:  # TLS in front of gRPC: members present certificates, clients need not (base/tls_front.py)
            front = TlsFront(credentials, listen(args.host, args.port), serving.bind(server, "127.0.0.1", 0), log)
            service.peer_role = front.peer_role
            port = front.port
        reached = addresses.reached_at(args.host, port, args.advertise)
        metrics_server = (observability.start_metrics(metrics.registry, args, credentials)
                          if metrics is not None else None)
    except (ValueError, OSError) as exc:
        return startup.refuse("coordinator", exc)
    stopping = startup.answer_signals(args.host, credentials, log)
    sweeper = threading.Thread(target=run_sweeper, args=(membership, stopping), name="sweeper", daemon=True)
    sweeper.start()
    server.start()
    if front is not None:
        try:
            front.start()
        except OSError as exc:
            serving.stop(server, health, 0)
            return startup.refuse("coordinator", exc)
    serving.freeze_startup_objects()
    reached_at = f"reached at {reached}, " if args.advertise else ""
    print(
        f"coordinator {service.coordinator_id} listening on {serving.host_port(args.host, port)} "
        f"({reached_at}replicas {args.replicas}, placement by the first {args.prefix_chars} characters or the "
        f"session id, up to {args.max_streams} streams)",
        flush=True,
    )
    serving.wait_until(stopping)
    log.info("stopping: finishing running requests for up to %.1fs", args.grace)
    serving.stop(server, health, args.grace)
    if front is not None:
        front.stop()
    service.close()
    if metrics_server is not None:
        metrics_server.stop()
    log.info("stopped")
    return 0
