"""WorkerClient: talk to one worker's `Worker` service (the coordinator and tools use this)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator, Mapping, Sequence

import grpc

from base import security
from base.generation import Candidate, Finished, Piece, Prompt, TokenLogprob, Usage
from base.observability import traced_channel
from base.tokens import authorization
from protos import kvcache_pb2 as pb
from protos import kvcache_pb2_grpc as pb_grpc


# Trailing metadata of a call a worker refused because it is shutting down: send the request to
# another worker, and do not take this one for dead. Callers check the key, never the message.
DRAINING_KEY = "kvcache-worker-draining"


def is_draining(exc: grpc.RpcError) -> bool:
    """Whether a worker ended the call because it is shutting down (DRAINING_KEY among its trailers)."""
    return any(key == DRAINING_KEY for key, _ in exc.trailing_metadata() or ())


class WorkerError(Exception):
    """A worker call failed; `code` is the grpc.StatusCode, `details` the worker's message."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        super().__init__(f"worker {address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details


def usage_from_proto(usage: pb.Usage) -> Usage:
    return Usage(**{name: getattr(usage, name) for name in Usage.__dataclass_fields__})


def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(**asdict(usage))


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    version: str
    model: str
    fingerprint: str
    kv_dtype: str
    page_tokens: int
    page_bytes: int
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    max_tokens_limit: int
    max_positions: int


def generate_request(
    prompt: str | Sequence[int] | Sequence[Mapping[str, str]],
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    placement: Sequence[str] = (),
    no_cache: bool = False,
    request_id: str = "",
    ignore_eos: bool = False,
    priority: int = 0,
    echo: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> pb.GenerateRequest:
    """`echo`: the prompt comes back on the first Piece; `logprobs`, `prompt_logprobs`: the top-k count
    of each generated token's, each prompt token's logprobs (None: none; prompt_logprobs needs echo)."""
    request = pb.GenerateRequest(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        placement=list(placement),
        no_cache=no_cache,
        request_id=request_id,
        ignore_eos=ignore_eos,
        priority=priority,
        echo=echo,
    )
    if logprobs is not None:
        request.logprobs = logprobs
    if prompt_logprobs is not None:
        request.prompt_logprobs = prompt_logprobs
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt and isinstance(prompt[0], Mapping):   # a chat: [{"role": ..., "content": ...}, ...]
        request.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        request.prompt_token_ids.extend(prompt)
    if seed is not None:
        request.seed = seed
    return request


def parse_reply(reply: pb.GenerateReply) -> Piece | Finished:
    if reply.finish_reason:
        return Finished(usage_from_proto(reply.usage), reply.finish_reason)
    prompt = None
    if reply.prompt_token_ids:
        prompt = Prompt(list(reply.prompt_token_ids), reply.prompt_text,
                        [logprob_from_proto(e) for e in reply.prompt_logprobs] if reply.prompt_logprobs else None,
                        reply.prompt_first_token)
    return Piece(reply.text, list(reply.token_ids),
                 [logprob_from_proto(e) for e in reply.logprobs] if reply.logprobs else None, prompt)


def generate_reply(text: str, token_ids, logprobs=None, prompt: Prompt | None = None) -> pb.GenerateReply:
    """A message of new text: its token ids, their logprobs and the prompt when asked (a worker's)."""
    reply = pb.GenerateReply(text=text, token_ids=token_ids)
    if logprobs:
        reply.logprobs.extend(logprob_to_proto(e) for e in logprobs)
    if prompt is not None:
        reply.prompt_token_ids.extend(prompt.token_ids)
        reply.prompt_text = prompt.text
        reply.prompt_first_token = prompt.first_token
        if prompt.logprobs:
            reply.prompt_logprobs.extend(logprob_to_proto(e) for e in prompt.logprobs)
    return reply


def logprob_to_proto(entry: TokenLogprob) -> pb.TokenLogprob:
    def candidate(c: Candidate) -> pb.Candidate:
        return pb.Candidate(token_id=c.token_id, logprob=c.logprob, token=c.token)

    return pb.TokenLogprob(chosen=candidate(entry.chosen), top=[candidate(c) for c in entry.top])


def logprob_from_proto(entry: pb.TokenLogprob) -> TokenLogprob:
    def candidate(c: pb.Candidate) -> Candidate:
        return Candidate(c.token_id, c.logprob, c.token)

    return TokenLogprob(candidate(entry.chosen), tuple(candidate(c) for c in entry.top))


def without_prompt(reply: pb.GenerateReply) -> pb.GenerateReply | None:
    """`reply` without the prompt a resumed attempt sent again (a second copy: the first went out);
    None when nothing else is left in it."""
    if not reply.prompt_token_ids:
        return reply
    copy = pb.GenerateReply()
    copy.CopyFrom(reply)
    for name in ("prompt_token_ids", "prompt_text", "prompt_logprobs", "prompt_first_token"):
        copy.ClearField(name)
    return copy if copy.token_ids or copy.text or copy.finish_reason else None


class WorkerClient:
    def __init__(self, address: str, timeout: float = 300.0, credentials: security.Credentials | None = None,
                 token: str | None = None):
        self.address = address
        self.timeout = timeout
        self.metadata = authorization(token)  # base/tokens.py: a worker started with --tokens-file needs one
        self._channel = traced_channel(security.channel(address, credentials, security.KEEPALIVE_OPTIONS))
        stub = pb_grpc.WorkerStub(self._channel)
        self._generate = stub.Generate
        self._info = stub.Info

    def generate(self, prompt: str | Sequence[int], timeout: float | None = None, **options) -> Iterator[Piece | Finished]:
        """Pieces as the worker produces them, then one Finished; options as in generate_request."""
        stream = self.generate_stream(generate_request(prompt, **options), timeout)
        try:
            for reply in stream:
                yield parse_reply(reply)
        except grpc.RpcError as exc:
            exc.__traceback__ = None  # no cycle keeps the call for exit (coordinator/client.py: Client.close)
            raise self._error(exc) from None
        finally:
            stream.cancel()  # a caller that stops early frees the worker's blocks at once

    def generate_stream(self, request: pb.GenerateRequest, timeout: float | None = None, metadata=None):
        """The raw reply stream (a grpc call: iterate it, `cancel()` it); for relays such as the coordinator,
        which send their caller's `metadata` (its token) instead of this client's."""
        return self._generate(request, timeout=timeout or self.timeout,
                              metadata=self.metadata if metadata is None else metadata)

    def info(self, timeout: float = 5.0) -> WorkerInfo:
        try:
            reply = self._info(pb.WorkerInfoRequest(), timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return WorkerInfo(**{name: getattr(reply, name) for name in WorkerInfo.__dataclass_fields__})

    def _error(self, exc: grpc.RpcError) -> WorkerError:
        return WorkerError(self.address, exc.code(), exc.details() or "no details")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
