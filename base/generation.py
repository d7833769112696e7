"""A Generate call's events as Python sees them, on every hop (engine, worker, coordinator, gateway):
Piece after Piece of text, then one Finished with the request's Usage. Plain dataclasses with no
protobuf, so the engine's core uses them too; worker/client.py turns them into messages and back."""

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
class Piece:
    """New text and the token ids it came from."""

    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    usage: Usage
    finish_reason: str
