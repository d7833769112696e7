"""The Coordinator gRPC service: membership calls, cluster status, and Generate, which
places the sequence on the ring, routes it to a worker and relays the worker's stream.

Failure handling (design notes)
1. A worker that fails before its first token: the request goes to another worker, unseen.
2. After tokens were sent: a greedy or seeded request is resumed on another worker with the
   tokens so far (seeded draws depend only on seed and position), so no token repeats or
   goes missing; any other request ends with UNAVAILABLE saying it may be retried.
3. A worker's own verdict on the request (INVALID_ARGUMENT and the like) goes to the client
   as it is: another worker would say the same.
"""

from __future__ import annotations

import logging
import threading
import uuid

import grpc

from coordinator.membership import HEARTBEAT_INTERVAL_S, NODE, WORKER, Membership
from coordinator.ring import DEFAULT_PREFIX_CHARS, placement_key
from coordinator.router import Router
from protos import kvcache_pb2 as pb
from protos import serving
from worker.client import WorkerClient

log = logging.getLogger("coordinator")

SERVICE_NAME = "kvcache.v1.Coordinator"
MAX_ATTEMPTS = 3
_REQUEST_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class CoordinatorService:
    def __init__(
        self,
        membership: Membership,
        replicas: int = 2,
        prefix_chars: int = DEFAULT_PREFIX_CHARS,
        coordinator_id: str | None = None,
        request_timeout_s: float = 600.0,
    ):
        self.membership = membership
        self.router = Router()
        self.replicas = replicas
        self.prefix_chars = prefix_chars
        self.coordinator_id = coordinator_id or uuid.uuid4().hex[:12]
        self.request_timeout_s = request_timeout_s
        self._workers: dict[str, WorkerClient] = {}
        self._workers_lock = threading.Lock()

    # ---- membership ------------------------------------------------------------

    def register(self, request, context) -> pb.RegisterReply:
        _check_parsed(request, context)
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
        load = {f.name: v for f, v in request.load.ListFields()} if request.HasField("load") else None
        return pb.HeartbeatReply(known=self.membership.heartbeat(request.member_id, load))

    def cluster_status(self, request, context) -> pb.ClusterStatusReply:
        _check_parsed(request, context)
        now = self.membership.clock()
        members = [
            pb.MemberStatus(
                member_id=m.member_id, role=m.role, address=m.address, alive=m.alive,
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
        if not request.prompt and not request.prompt_token_ids:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty: send text or token ids")
        prompt_head = request.prompt or " ".join(map(str, request.prompt_token_ids[: self.prefix_chars]))
        key = placement_key(prompt_head, request.session_id, self.prefix_chars)
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        del forward.placement[:]
        forward.placement.extend(self.membership.ring.placement(key, self.replicas))
        forward.request_id = request.request_id or uuid.uuid4().hex[:16]
        resumable = request.temperature == 0 or request.HasField("seed")
        sent: list[int] = []
        tried: list[str] = []
        failure = "no live worker"
        for _ in range(MAX_ATTEMPTS):
            workers = [m.address for m in self.membership.live(WORKER)]
            worker = self.router.choose(key, workers, exclude=tried)
            if worker is None:
                break
            tried.append(worker)
            attempt = self._resumed(forward, sent) if sent else forward
            try:
                for reply in self._relay(worker, attempt, context):
                    sent.extend(reply.token_ids)
                    yield reply
                    if reply.finish_reason:
                        return
                failure = f"worker {worker} ended the stream without finishing"
            except grpc.RpcError as exc:
                if not context.is_active():
                    return  # our client went away; _relay cancelled the worker's stream
                if exc.code() in _REQUEST_ERRORS:
                    _abort(context, exc.code(), exc.details() or "refused by the worker")
                failure = f"worker {worker} failed: {exc.code().name}: {exc.details()}"
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.membership.mark_dead(worker)
            finally:
                self.router.done(worker)
            log.warning("%s (request %s, %d tokens sent)", failure, forward.request_id, len(sent))
            if sent and not resumable:
                _abort(context, grpc.StatusCode.UNAVAILABLE,
                       f"{failure} after {len(sent)} tokens; a sampled request without a seed cannot be resumed "
                       f"exactly: retry it (or give a seed)")
        _abort(context, grpc.StatusCode.UNAVAILABLE, f"{failure}; tried {len(tried)} workers: retry later")

    def _relay(self, worker: str, request: pb.GenerateRequest, context):
        stream = self._client(worker).generate_stream(request, timeout=self.request_timeout_s)
        context.add_callback(stream.cancel)
        yield from stream

    @staticmethod
    def _resumed(request: pb.GenerateRequest, sent: list[int]) -> pb.GenerateRequest:
        """The request for the next worker: it goes on after the tokens sent so far, which count
        in the request's max_tokens and usage as if it had generated them (the worker does that)."""
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        resumed.resume_token_ids.extend(sent)
        return resumed

    def _client(self, address: str) -> WorkerClient:
        with self._workers_lock:
            client = self._workers.get(address)
            if client is None:
                client = self._workers[address] = WorkerClient(address)
            return client

    def close(self) -> None:
        with self._workers_lock:
            for client in self._workers.values():
                client.close()
            self._workers.clear()


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
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
