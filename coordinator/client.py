"""Client: the usual way to use a kvcache cluster from Python.

Client(["host:port", ...]) talks to any of several coordinators: one that does not
answer is skipped, and a greedy or seeded request whose coordinator dies mid-stream
is resumed through another without repeating or losing a token.

A secure cluster: `token` is sent with every call (`authorization: Bearer TOKEN`; it names the
tenant whose cached pages the requests share), `tls_ca` (the cluster's CA file) checks the
coordinators, `tls_cert` and `tls_key` (a client certificate of that CA) are presented to them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import grpc

from base import security
from base.generation import Finished, Piece
from base.observability import traced_channel
from base.tokens import authorization
from protos import kvcache_pb2 as pb
from protos import kvcache_pb2_grpc as pb_grpc
from worker.client import generate_request, parse_reply

__all__ = ["Cancel", "Client", "ClusterError", "TlsMismatch"]

# A coordinator that is down, or at its limit of streams (RESOURCE_EXHAUSTED): try the next one.
TRY_ELSEWHERE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED}


def resumed(request: pb.GenerateRequest, sent: list[int]) -> pb.GenerateRequest:
    """The request to send to the next coordinator after `sent` tokens: the worker goes on after
    them, counting them as its own (max_tokens, usage)."""
    if not sent:
        return request
    attempt = pb.GenerateRequest()
    attempt.CopyFrom(request)
    attempt.resume_token_ids.extend(sent)
    return attempt


def first_prompt(event: Piece | Finished, prompt_sent: bool) -> Piece | Finished | None:
    """`event` as the caller gets it: a prompt (echo) only the first time, a piece left empty
    without it skipped (None). A coordinator resuming the request sends its prompt again."""
    if not prompt_sent or not isinstance(event, Piece) or event.prompt is None:
        return event
    if not event.text and not event.token_ids:
        return None
    return Piece(event.text, event.token_ids, event.logprobs)


def resumable(request: pb.GenerateRequest) -> bool:
    return request.temperature == 0 or request.HasField("seed")


def not_resumable(sent: list[int], errors: list[str]) -> "ClusterError":
    return ClusterError(grpc.StatusCode.UNAVAILABLE,
                        f"coordinator failed after {len(sent)} tokens ({errors[-1]}); a sampled request "
                        f"without a seed cannot be resumed exactly: retry it")


def none_served(codes: set, errors: list[str]) -> "ClusterError":
    busy = codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}  # every one at its limit: retry shortly
    return ClusterError(grpc.StatusCode.RESOURCE_EXHAUSTED if busy else grpc.StatusCode.UNAVAILABLE,
                        "no coordinator could serve the request: " + "; ".join(errors))


def client_credentials(coordinators: Sequence[str], tls_ca: str | None, tls_cert: str | None,
                       tls_key: str | None) -> security.Credentials | None:
    """A client's options checked (Client's and AsyncClient's): its TLS credentials, None for plaintext."""
    if not coordinators:
        raise ValueError("give at least one coordinator address (host:port)")
    if (tls_cert or tls_key) and not tls_ca:
        raise ValueError("a client certificate needs tls_ca, the CA that checks the coordinators")
    return security.Credentials(Path(tls_ca), tls_cert and Path(tls_cert), tls_key and Path(tls_key)) if tls_ca else None


class ClusterError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class TlsMismatch(ClusterError):
    """No coordinator answered because this client's TLS and theirs differ: the one line that says how
    (security.tls_mismatch), with what to do."""

    def __init__(self, line: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, line)

    def __str__(self) -> str:
        return self.details


def may_be_tls_mismatch(exc: grpc.RpcError) -> bool:
    """The call failed as one does whose TLS and the server's differ: UNAVAILABLE, the connection
    made but closed or its handshake failed (not refused: nothing listens there)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "Connection refused" not in (exc.details() or "")


def tls_mismatch(failed: Sequence[str], credentials: security.Credentials | None) -> TlsMismatch | None:
    """A TlsMismatch when the first coordinator in `failed` (none answered) that can be asked speaks
    TLS otherwise than this client; None when none does."""
    for address in failed:
        line = security.tls_mismatch(address, credentials)
        if line is not None:
            return TlsMismatch(line)
    return None


class Cancel:
    """Ends a Client.generate from any thread: its current stream is cancelled at once (the worker
    frees the request's blocks) and generate raises ClusterError(CANCELLED), trying no other
    coordinator. For callers that iterate generate on one thread and learn of a hang-up on another."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stream = None
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def _attach(self, stream) -> None:
        with self._lock:
            self._stream = stream
            cancelled = self.cancelled
        if cancelled:
            stream.cancel()


@dataclass
class _Coordinator:
    address: str
    channel: grpc.Channel
    generate: object = field(default=None)
    status: object = field(default=None)


class Client:
    def __init__(self, coordinators: Sequence[str], timeout: float = 600.0, token: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None):
        credentials = client_credentials(coordinators, tls_ca, tls_cert, tls_key)
        self.timeout = timeout
        self._credentials = credentials
        self._metadata = authorization(token)
        self._coordinators = []
        for address in dict.fromkeys(coordinators):
            channel = traced_channel(security.channel(address, credentials, security.KEEPALIVE_OPTIONS))
            stub = pb_grpc.CoordinatorStub(channel)
            self._coordinators.append(_Coordinator(address, channel, stub.Generate, stub.ClusterStatus))
        self._preferred = 0
        self._closed = False

    def generate(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]], session_id: str = "",
                 cancel: Cancel | None = None, token: str | None = None, **options) -> Iterator[Piece | Finished]:
        """Pieces as they come, then one Finished; options as worker.client.generate_request. The
        prompt is text, token ids, or a chat ([{"role": ..., "content": ...}, ...]) that the worker
        renders with its model's template. `cancel.cancel()` ends it from another thread. `token`
        sends this call with another client's token (a gateway relaying its callers' keys)."""
        metadata = self._metadata if token is None else authorization(token)
        request = generate_request(prompt, **options)
        request.session_id = session_id
        sent: list[int] = []
        prompt_sent = False  # echo: the prompt goes to the caller once
        errors, codes, unreachable = [], set(), []
        for coordinator in self._in_order():
            stream = coordinator.generate(resumed(request, sent), timeout=self.timeout, metadata=metadata)
            if cancel is not None:
                cancel._attach(stream)
            try:
                for reply in stream:
                    if (event := first_prompt(parse_reply(reply), prompt_sent)) is None:
                        continue
                    if isinstance(event, Piece):
                        sent.extend(event.token_ids)
                        prompt_sent |= event.prompt is not None
                    yield event
                    if isinstance(event, Finished):
                        self._preferred = self._coordinators.index(coordinator)
                        return
                errors.append(f"{coordinator.address}: stream ended without finishing")
            except grpc.RpcError as exc:
                # The exception is the call itself: its traceback would hold a cycle (this frame, with the
                # next attempt's call) that only a garbage collection frees, perhaps at exit (see close).
                exc.__traceback__ = None
                if cancel is not None and cancel.cancelled:
                    raise ClusterError(grpc.StatusCode.CANCELLED, "cancelled by the caller") from None
                if exc.code() not in TRY_ELSEWHERE:
                    raise ClusterError(exc.code(), exc.details() or "no details") from None
                errors.append(f"{coordinator.address}: {exc.code().name}: {exc.details()}")
                codes.add(exc.code())
                if may_be_tls_mismatch(exc) and not sent:
                    unreachable.append(coordinator.address)
            finally:
                stream.cancel()
            if sent and not resumable(request):
                raise not_resumable(sent, errors)
        if codes == {grpc.StatusCode.UNAVAILABLE}:
            mismatch = tls_mismatch(unreachable, self._credentials)
            if mismatch is not None:
                raise mismatch
        raise none_served(codes, errors)

    def status(self, timeout: float = 5.0, token: str | None = None) -> pb.ClusterStatusReply:
        metadata = self._metadata if token is None else authorization(token)
        errors, unreachable = [], []
        for coordinator in self._in_order():
            try:
                return coordinator.status(pb.ClusterStatusRequest(), timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # another coordinator would say the same
                    raise ClusterError(exc.code(), exc.details() or "no details") from None
                errors.append(f"{coordinator.address}: {exc.code().name}")
                if may_be_tls_mismatch(exc):
                    unreachable.append(coordinator.address)
        mismatch = tls_mismatch(unreachable, self._credentials)
        if mismatch is not None:
            raise mismatch
        raise ClusterError(grpc.StatusCode.UNAVAILABLE, "no coordinator answered: " + "; ".join(errors))

    def _in_order(self) -> list[_Coordinator]:
        if self._closed:
            raise ValueError("the Client is closed")
        first = self._preferred
        return self._coordinators[first:] + self._coordinators[:first]

    def close(self) -> None:
        """Close the channels and let go of them now. No gRPC object may be left for the interpreter's
        exit: its last garbage collection runs after grpc's daemon threads were stopped where they
        stood, and a call or channel freed then takes its lock first, waiting forever if a stopped
        thread held it (seen: a client that had printed its whole answer never exited)."""
        self._closed = True
        for coordinator in self._coordinators:
            coordinator.channel.close()
        self._coordinators = []  # freed now, while grpc's threads still run

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

