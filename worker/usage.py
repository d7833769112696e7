"""Usage: where a request's tokens came from. These names are used in every output
(engine completions, the gRPC final message, CLI JSON, client objects)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens_local: int = 0
    cached_tokens_remote: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0  # arrival to first token; 0.0 if none was produced (aborted first)

    def to_dict(self) -> dict:
        return asdict(self)
