"""A Generate call's events as Python sees them, on every hop (engine, worker, coordinator, gateway):
Piece after Piece of text, then one Finished with the request's Usage. Plain dataclasses with no
protobuf, so the engine's core uses them too; worker/client.py turns them into messages and back.

Logprobs ride on the pieces: a Piece's `logprobs` has one TokenLogprob per token id of the piece
(when the request asked for them), and the first Piece of a request that asked for its prompt back
(echo) carries it as a Prompt: its token ids, its text, and with prompt logprobs one TokenLogprob
per prompt token after the first (the first has nothing before it to be predicted from)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Usage:
    """Where a request's tokens came from; these names are used in every output (engine
    completions, the gRPC final message, CLI JSON, the gateway's usage)."""

    prompt_tokens: int = 0
    cached_tokens_local: int = 0
    cached_tokens_remote: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0  # arrival to first token; 0.0 if none was produced (aborted first)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Candidate:
    """A token at one position with its log probability there (natural log, float32 precision)."""

    token_id: int
    logprob: float
    token: bytes  # the token's own bytes: UTF-8, possibly part of a character that the next token ends

    @property
    def text(self) -> str:
        """Its bytes as text (U+FFFD for part of a character)."""
        return self.token.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenLogprob:
    """The token at one position and the most likely tokens there, most likely first."""

    chosen: Candidate
    top: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the worker read it (sent back when asked: echo)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token after the first, when asked
    first_token: bytes = b""  # the first token's own bytes (it has no logprob, so no Candidate)


@dataclass(frozen=True)
class Piece:
    """New text and the token ids it came from; their logprobs and the prompt when asked."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id
    prompt: Prompt | None = None  # on the first piece of a request that asked for its prompt back


@dataclass(frozen=True)
class Finished:
    usage: Usage
    finish_reason: str
