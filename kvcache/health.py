"""`kvcache health HOST:PORT`: ask a daemon's gRPC health service whether it serves, as a
container's readiness or liveness probe does. Exit 0 when it answers SERVING, 1 otherwise
(NOT_SERVING while it drains, or unreachable), 2 for bad options. With --tls-* it speaks mutual
TLS, which Kubernetes' own gRPC probe cannot."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from base import security


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST:PORT", help="the daemon's gRPC address ([::1]:50051 for IPv6)")
    parser.add_argument("--service", default="", help="the service to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")
    security.add_arguments(parser, client=True)


def run(args: argparse.Namespace) -> int:
    try:
        credentials = security.from_args(args, client=True)
    except ValueError as exc:
        print(f"kvcache health: error: {exc}", file=sys.stderr)
        return 2
    with security.channel(args.address, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
