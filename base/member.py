"""The member's side of membership: register with every coordinator, then beat.

kvnode and worker daemons run one MembershipAgent when started with --coordinators; it lives in
base/, not coordinator/, so neither daemon reaches into the coordinator's package.
A coordinator that does not answer is retried every beat; one that forgot the member
(it restarted) gets a fresh registration. Logs one line per change, not per beat.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Callable, Sequence

import grpc

from base import addresses, security
from protos import kvcache_pb2 as pb
from protos import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger("membership")


class _Coordinator:
    def __init__(self, address: str, credentials: security.Credentials | None):
        self.address = address
        self.credentials = credentials
        self.channel = security.channel(address, credentials)
        stub = pb_grpc.CoordinatorStub(self.channel)
        self.register = stub.Register
        self.heartbeat = stub.Heartbeat
        self.deregister = stub.Deregister
        self.member_id: str | None = None
        self.reachable: bool | None = None


class MembershipAgent:
    def __init__(
        self,
        coordinators: Sequence[str],
        registration: pb.RegisterRequest,
        load: Callable[[], pb.MemberLoad],
        interval_s: float = 1.0,
        credentials: security.Credentials | None = None,
    ):
        self.registration = registration
        self.load = load
        self.interval_s = interval_s
        self._coordinators = [_Coordinator(a, credentials) for a in dict.fromkeys(coordinators)]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and deregister from every coordinator that knows us (1 s each at most),
        so they stop routing here at once rather than after missed beats."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
        for coordinator in self._coordinators:
            if coordinator.member_id is not None:
                try:
                    coordinator.deregister(pb.DeregisterRequest(member_id=coordinator.member_id), timeout=1.0)
                    log.info("deregistered from coordinator %s", coordinator.address)
                except grpc.RpcError as exc:
                    log.info("could not deregister from coordinator %s (%s); it will notice the missed beats",
                             coordinator.address, exc.code().name)
            coordinator.channel.close()

    def _run(self) -> None:
        while not self._stopping.is_set():
            for coordinator in self._coordinators:
                self._beat(coordinator)
            self._stopping.wait(self.interval_s)

    def _beat(self, coordinator: _Coordinator) -> None:
        timeout = max(0.2, self.interval_s * 0.8)
        try:
            if coordinator.member_id is None:
                reply = coordinator.register(self.registration, timeout=timeout)
                coordinator.member_id = reply.member_id
                log.info("registered with coordinator %s as %s", coordinator.address, reply.member_id)
            else:
                request = pb.HeartbeatRequest(member_id=coordinator.member_id, load=self.load())
                if not coordinator.heartbeat(request, timeout=timeout).known:
                    log.info("coordinator %s no longer knows us; registering again", coordinator.address)
                    coordinator.member_id = None
                    return self._beat(coordinator)
            if coordinator.reachable is False:
                log.info("coordinator %s reachable again", coordinator.address)
            coordinator.reachable = True
        except grpc.RpcError as exc:
            if coordinator.reachable is not False:
                mismatch = (security.tls_mismatch(coordinator.address, coordinator.credentials, "the coordinator",
                                                  member=True)
                            if exc.code() == grpc.StatusCode.UNAVAILABLE else None)
                log.warning("coordinator %s unreachable (%s); retrying every beat", coordinator.address,
                            mismatch or exc.code().name)
            coordinator.reachable = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The membership options of `kvcache node` and `kvcache worker`."""
    parser.add_argument(
        "--coordinators", default="", help="coordinators to register with and beat to: A,B (default: none, standalone)"
    )
    parser.add_argument(
        "--advertise", default=None, metavar="HOST[:PORT]",
        help="the address other machines reach this daemon at, registered with the coordinators; its host "
             "is the data plane's too (a kvnode's Info). PORT defaults to the bound one; an IPv6 address "
             "goes in brackets, [fd00::1]:50051 (default: --host, refused when --host is a wildcard "
             "such as 0.0.0.0 or ::)"
    )


def advertised_address(args: argparse.Namespace, port: int) -> str:
    """The host:port this member registers (base.addresses.advertised); ValueError when there
    is none to give, so the daemon refuses to start rather than register an undialable address."""
    return addresses.advertised(args.host, port, args.advertise)


def start_from_args(args: argparse.Namespace, address: str, registration: pb.RegisterRequest,
                    load: Callable[[], pb.MemberLoad],
                    credentials: security.Credentials | None = None) -> MembershipAgent | None:
    """Start beating to args.coordinators, registered at `address` (advertised_address), None
    when there are none (a standalone daemon); with `credentials`, over mutual TLS."""
    coordinators = [a.strip() for a in args.coordinators.split(",") if a.strip()]
    if not coordinators:
        return None
    registration.address = address
    membership = MembershipAgent(coordinators, registration, load, credentials=credentials)
    membership.start()
    return membership
