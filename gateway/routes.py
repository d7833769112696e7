"""The gateway's routes as metrics and spans name them: a bounded set, whatever path a client sends."""

from __future__ import annotations

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info",
          "/health", "/metrics")


def route_of(path: str) -> str | None:
    """The route serving `path` ("/v1/models" for one model's page too), or None for any other path."""
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in ROUTES else None
