"""The Coordinator gRPC service: membership calls, cluster status, and Generate, which
relay.py carries out (placement, routing, failover, resume); this file unpacks calls,
bounds the streams relayed at once (capacity.py) and turns refusals into status codes.
"""

from __future__ import annotations

import logging
import threading
import uuid

import grpc

from base import security, serving
from base.tokens import forwarded
from coordinator.capacity import DEFAULT_MAX_STREAMS, StreamSlots
from coordinator.membership import HEARTBEAT_INTERVAL_S, NODE, Membership
from coordinator.relay import ClientCall, Refused, Relay
from coordinator.ring import DEFAULT_PREFIX_CHARS
from coordinator.router import Router
from coordinator.workers import WorkerStreams
from protos import kvcache_pb2 as pb
from protos.methods import service_name

log = logging.getLogger("coordinator")

SERVICE_NAME = service_name("Coordinator")
TRACE_ROOTS = ("Generate",)  # where a request's trace starts when its caller sent none (base/observability.py)
MEMBERS = ("node", "worker")  # whose certificates may join a secure cluster: a client's may not register


class CoordinatorService:
    def __init__(
        self,
        membership: Membership,
        replicas: int = 2,
        prefix_chars: int = DEFAULT_PREFIX_CHARS,
        coordinator_id: str | None = None,
        request_timeout_s: float = 600.0,
        max_streams: int = DEFAULT_MAX_STREAMS,
        credentials=None,
        tokens=None,
    ):
        self.membership = membership
        self.router = Router()
        self.replicas = replicas
        self.coordinator_id = coordinator_id or uuid.uuid4().hex[:12]
        self.streams = StreamSlots(max_streams)
        self.workers = WorkerStreams(credentials)  # mutual TLS to workers when given
        self.relay = Relay(membership, self.router, self.workers.open, replicas, prefix_chars, request_timeout_s)
        self.metrics = None  # coordinator.metrics.CoordinatorMetrics (--metrics-port): requests by outcome
        self.tokens = tokens  # base.tokens.Tokens (--tokens-file): the caller's tenant salts its placement
        self.peer_role = security.peer_role  # the caller's role; under TLS its front's (base/tls_front.py)

    # ---- membership ------------------------------------------------------------

    def register(self, request, context) -> pb.RegisterReply:
        _check_parsed(request, context)
        security.refuse_unless_member(context, MEMBERS, "Register", log, self.peer_role)
        try:
            member = self.membership.register(
                request.role, request.address, request.capacity_bytes, request.page_bytes,
                request.model, request.fingerprint,
            )
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("%s %s joined as %s (epoch %s)", member.role, member.address, member.member_id,
                 self.membership.ring.epoch)
        return pb.RegisterReply(member_id=member.member_id, heartbeat_interval_ms=int(HEARTBEAT_INTERVAL_S * 1000))

    def heartbeat(self, request, context) -> pb.HeartbeatReply:
        _check_parsed(request, context)
        security.refuse_unless_member(context, MEMBERS, "Heartbeat", log, self.peer_role)
        load = {f.name: v for f, v in request.load.ListFields()} if request.HasField("load") else None
        return pb.HeartbeatReply(known=self.membership.heartbeat(request.member_id, load))

    def deregister(self, request, context) -> pb.DeregisterReply:
        _check_parsed(request, context)
        security.refuse_unless_member(context, MEMBERS, "Deregister", log, self.peer_role)
        member = self.membership.deregister(request.member_id)
        if member is not None:
            log.info("%s %s left (deregistered; epoch %s)", member.role, member.address, self.membership.ring.epoch)
        return pb.DeregisterReply(known=member is not None)

    def cluster_status(self, request, context) -> pb.ClusterStatusReply:
        _check_parsed(request, context)
        now = self.membership.clock()
        members = [
            pb.MemberStatus(
                role=m.role, address=m.address, alive=m.alive,  # never member_id: the member's credential
                seconds_since_beat=now - m.last_beat, capacity_bytes=m.capacity_bytes, page_bytes=m.page_bytes,
                model=m.model, load=pb.MemberLoad(**m.load), outstanding=self.router.outstanding(m.address),
            )
            for m in self.membership.members()
        ]
        return pb.ClusterStatusReply(
            coordinator_id=self.coordinator_id, epoch=self.membership.ring.epoch, replicas=self.replicas,
            members=members,
        )

    # ---- generation ------------------------------------------------------------

    def generate(self, request, context):
        _check_parsed(request, context)
        if not self.streams.try_acquire():
            if self.metrics is not None:
                self.metrics.request_done("resource_exhausted")
            self._refuse_at_limit(context)
        outcome = "cancelled"  # unless it ends otherwise: the client went away
        try:
            metadata = context.invocation_metadata()
            tenant = self.tokens.tenant_of(metadata) if self.tokens is not None else None
            call = ClientCall(context.time_remaining, context.is_active, context.add_callback,
                              namespace=tenant.namespace if tenant else "", metadata=forwarded(metadata))
            for reply in self.relay.generate(request, call):
                if reply.finish_reason:  # the final reply: done, whenever the client hangs up after it
                    outcome = "ok"
                yield reply
        except Refused as exc:
            outcome = exc.code.name.lower()
            _abort(context, exc.code, exc.message)
        finally:
            self.streams.release()
            if self.metrics is not None:
                self.metrics.request_done(outcome)

    def _refuse_at_limit(self, context):
        refused = self.streams.take_refusals_to_log()
        if refused:  # a flood must not flood the log: one line per interval
            log.warning("at the limit of %d streams: refused %d since the last such line", self.streams.limit, refused)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"this coordinator is at its limit of {self.streams.limit} streams: retry shortly or use "
                      f"another coordinator")

    def close(self) -> None:
        self.workers.close()


def run_sweeper(membership: Membership, stopping: threading.Event, interval_s: float = 0.5) -> None:
    """Mark members that missed their beats dead, logging each once."""
    while not stopping.wait(interval_s):
        for member in membership.sweep():
            what = "left the ring" if member.role == NODE else "no longer gets requests"
            log.warning("%s %s missed its heartbeats: %s (epoch %s)", member.role, member.address, what,
                        membership.ring.epoch)


def _check_parsed(request, context) -> None:
    serving.abort_if_malformed(request, context, log)


def _abort(context, code: grpc.StatusCode, message: str):
    serving.abort(context, code, message, log)


def handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    parse, serialize = serving.parser_for, serving.serialize
    unary = grpc.unary_unary_rpc_method_handler
    methods = {
        "Generate": grpc.unary_stream_rpc_method_handler(service.generate, parse(pb.GenerateRequest), serialize),
        "ClusterStatus": unary(service.cluster_status, parse(pb.ClusterStatusRequest), serialize),
        "Register": unary(service.register, parse(pb.RegisterRequest), serialize),
        "Heartbeat": unary(service.heartbeat, parse(pb.HeartbeatRequest), serialize),
        "Deregister": unary(service.deregister, parse(pb.DeregisterRequest), serialize),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
