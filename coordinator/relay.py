"""Generate's core, apart from gRPC: place the sequence, pick a worker, relay its stream,
and after each failed attempt decide whether to try another worker, resume there, or give up.
A worker that fails before its first token is invisible to the client (the request goes to
another); after tokens were sent, only a request that can be resumed exactly goes on elsewhere.
The rules as a whole: docs/architecture.md, "Failures and isolation".
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from grpc import StatusCode

from coordinator.membership import WORKER, Membership
from coordinator.ring import placement_key
from coordinator.router import Router
from protos import kvcache_pb2 as pb
from worker.client import without_prompt

log = logging.getLogger("coordinator")

MAX_FAILURES = 3  # attempts that failed (busy or draining workers are skipped, not counted)
MAX_WORKERS_TRIED = 16
MAX_CLIENT_ID_CHARS = 64  # of the client's request id kept in the attempt ids
# The request's own fault goes to the client as it is: another worker would say or fail the same
# (a worker answers INTERNAL only for a request that failed a step alone, its others going on).
REQUEST_FAULTS = {StatusCode.INVALID_ARGUMENT, StatusCode.OUT_OF_RANGE, StatusCode.FAILED_PRECONDITION,
                  StatusCode.INTERNAL}


class Refused(Exception):
    """The client's call ends with this status."""

    def __init__(self, code: StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class AttemptFailed(Exception):
    """A worker's stream ended with a status (raised by the stream the caller opens); `draining`:
    the worker said it is shutting down (worker.client.DRAINING_KEY)."""

    def __init__(self, code: StatusCode, details: str, draining: bool = False):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.draining = draining


@dataclass
class ClientCall:
    """What the relay may know of the client's call."""

    time_remaining: Callable[[], float | None]  # seconds left of the client's deadline (None: no deadline)
    is_active: Callable[[], bool]  # False once the client cancelled, went away or ran out of time
    on_end: Callable[[Callable[[], None]], object]  # run a callback when the call ends
    namespace: str = ""  # the caller's tenant namespace (base/tokens.py): salts the placement key
    metadata: tuple = ()  # sent on with each attempt: the caller's authorization, for the worker


# (worker address, request, timeout s, call) -> the worker's replies; raises AttemptFailed.
OpenStream = Callable[[str, pb.GenerateRequest, float, ClientCall], Iterable[pb.GenerateReply]]


def attempt_ids(client_id: str) -> Iterator[str]:
    """`<client id>.<tag of this call>.<attempt>`: unique per attempt, still readable in logs, so a
    client reusing ids, or a retry, never collides with an attempt still running on a worker
    (ALREADY_EXISTS is retried with the next id)."""
    base = client_id[:MAX_CLIENT_ID_CHARS] or "req"
    tag = uuid.uuid4().hex[:8]
    attempt = 0
    while True:
        attempt += 1
        yield f"{base}.{tag}.{attempt}"


class Relay:
    def __init__(self, membership: Membership, router: Router, open_stream: OpenStream, replicas: int,
                 prefix_chars: int, request_timeout_s: float):
        self.membership = membership
        self.router = router
        self.open_stream = open_stream
        self.replicas = replicas
        self.prefix_chars = prefix_chars
        self.request_timeout_s = request_timeout_s
        self.metrics = None  # coordinator.metrics.CoordinatorMetrics (--metrics-port): resumes, failed attempts

    def generate(self, request: pb.GenerateRequest, call: ClientCall) -> Iterator[pb.GenerateReply]:
        """The reply stream for `request`; raises Refused when the call must end with a status."""
        if not request.prompt and not request.prompt_token_ids and not request.messages:
            raise Refused(StatusCode.INVALID_ARGUMENT, "the prompt is empty: send text, token ids or messages")
        prompt_head = (request.prompt or " ".join(map(str, request.prompt_token_ids[: self.prefix_chars]))
                       or chat_head(request.messages, self.prefix_chars))
        key = placement_key(prompt_head, request.session_id, self.prefix_chars, call.namespace)
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        del forward.placement[:]
        forward.placement.extend(self.membership.ring.placement(key, self.replicas))
        ids = attempt_ids(request.request_id)
        # Seeded draws depend only on seed and position, so a greedy or seeded request resumes on another
        # worker with the tokens so far, none repeated or lost; any other ends UNAVAILABLE, retryable.
        resumable = request.temperature == 0 or request.HasField("seed")
        sent: list[int] = []
        prompt_sent = False  # echo: the prompt goes to the client once, whichever attempt sent it
        skipped: list[str] = []  # workers this request will not go to again
        busy: list[str] = []
        failures = 0
        failure = "no live worker"
        while failures < MAX_FAILURES and len(skipped) < MAX_WORKERS_TRIED:
            timeout, client_bound = self._timeout(call, len(sent))
            worker = self.router.choose(key, [m.address for m in self.membership.live(WORKER)], exclude=skipped,
                                        cached=not request.no_cache)
            if worker is None:
                break
            attempt = _copy(forward)
            attempt.resume_token_ids.extend(sent)  # the worker counts them as its own (max_tokens, usage)
            attempt.request_id = next(ids)
            if sent and self.metrics is not None:
                self.metrics.resumes.inc()
            try:
                for reply in self.open_stream(worker, attempt, timeout, call):
                    if prompt_sent and (reply := without_prompt(reply)) is None:
                        continue
                    prompt_sent |= len(reply.prompt_token_ids) > 0
                    sent.extend(reply.token_ids)
                    yield reply
                    if reply.finish_reason:
                        return
                failure = f"worker {worker} ended the stream without finishing"
                failures += 1
                skipped.append(worker)
            except AttemptFailed as exc:
                if not call.is_active():
                    return  # our client went away or ran out of time; its stream to the worker is cancelled
                failure = f"worker {worker} failed: {exc.code.name}: {exc.details}"
                if self.metrics is not None:
                    self.metrics.attempt_failed(exc.code)
                counted = self._judge(worker, exc, attempt, client_bound, len(sent), skipped, busy)
                failures += counted
                if not counted:
                    continue  # busy or draining: nothing was sent, the request goes on as it was
            finally:
                self.router.done(worker)
            log.warning("%s (request %s, %d tokens sent)", failure, attempt.request_id, len(sent))
            if sent and not resumable:
                raise Refused(StatusCode.UNAVAILABLE,
                              f"{failure} after {len(sent)} tokens; a sampled request without a seed cannot be "
                              f"resumed exactly: retry it (or give a seed)")
        if busy and failures < MAX_FAILURES:  # so the client knows to retry shortly, not that something broke
            raise Refused(StatusCode.RESOURCE_EXHAUSTED,
                          f"all workers are busy ({len(busy)} refused the request, {len(skipped) - len(busy)} "
                          f"failed): retry shortly or use another coordinator")
        raise Refused(StatusCode.UNAVAILABLE, f"{failure}; tried {len(skipped)} workers: retry later")

    def _timeout(self, call: ClientCall, num_sent: int) -> tuple[float, bool]:
        """Seconds the next attempt may take, and whether the client's deadline is what bounds it: a
        worker gets what is left of it (at most the request timeout), and when it ends the call, the
        call ends DEADLINE_EXCEEDED with membership untouched."""
        remaining = call.time_remaining()
        if remaining is None or remaining >= self.request_timeout_s:
            return self.request_timeout_s, False
        if remaining <= 0:
            raise Refused(StatusCode.DEADLINE_EXCEEDED,
                          f"the request's deadline passed after {num_sent} tokens: give it more time")
        return remaining, True

    def _judge(self, worker: str, exc: AttemptFailed, attempt: pb.GenerateRequest, client_bound: bool,
               num_sent: int, skipped: list[str], busy: list[str]) -> int:
        """Act on a failed attempt: raise Refused to end the call, else return 1 if it counts as a failure."""
        code = exc.code
        if code in REQUEST_FAULTS:
            raise Refused(code, exc.details or "refused by the worker")
        if code == StatusCode.DEADLINE_EXCEEDED and client_bound:
            raise Refused(code, f"the request's deadline passed after {num_sent} tokens: give it more time")
        if code == StatusCode.ALREADY_EXISTS:
            return 1  # the worker still runs an attempt of that id: the next attempt has a new one
        skipped.append(worker)
        # Busy, or draining (below): skipped for this request and left in the cluster.
        if code == StatusCode.RESOURCE_EXHAUSTED:
            busy.append(worker)
            log.info("worker %s is busy (%s); trying another (request %s)", worker, exc.details, attempt.request_id)
            return 0
        if code == StatusCode.UNAVAILABLE and exc.draining:
            log.info("worker %s is shutting down; trying another (request %s)", worker, attempt.request_id)
            return 0
        if code == StatusCode.UNAVAILABLE:  # only a worker that cannot be reached is dead, until its next beat
            self.membership.mark_dead(worker)
            log.warning("worker %s unreachable (%s): no requests to it until it beats again", worker, exc.details)
        return 1


def _copy(request: pb.GenerateRequest) -> pb.GenerateRequest:
    copy = pb.GenerateRequest()
    copy.CopyFrom(request)
    return copy


def chat_head(messages, prefix_chars: int) -> str:
    """What stands in for a chat's rendered text when placing it (the worker alone renders):
    its messages' roles and contents in order, so chats under one system prompt share nodes."""
    text = ""
    for m in messages:
        text += f"{m.role}\n{m.content}\n"
        if len(text) >= prefix_chars:
            break
    return text
