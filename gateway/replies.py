"""The response bodies: a completion, a chat completion, their streamed chunks and the usage.

usage is OpenAI's (prompt, completion and total tokens; prompt_tokens_details.cached_tokens =
the prompt tokens the cluster served from a cache, a worker's own or a kvnode's) with our
breakdown beside it under `kvcache`: where the cached tokens came from, how many were computed,
and the worker's time to first token.

The bodies follow OpenAI's published schema (tests/openai_schema.py checks them): a required
property is always there, null where the schema allows it (a chat message's `refusal`); an
optional one that may not be null is left out rather than sent as null (`system_fingerprint`,
a completion chunk's `usage`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from base.generation import Usage

OWNED_BY = "kvcache"


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens_local + usage.cached_tokens_remote},
        "kvcache": {
            "cached_tokens_local": usage.cached_tokens_local,
            "cached_tokens_remote": usage.cached_tokens_remote,
            "computed_tokens": usage.computed_tokens,
            "ttft_ms": round(usage.ttft_ms, 3),
        },
    }


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict:
    """A streamed chunk's usage with continuous usage stats (vLLM's shape: the counts alone)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def combined(usages: list[Usage], n: int = 1) -> Usage:
    """The usage of a call's choices (n of each prompt, in order), as OpenAI counts it: each prompt
    once (its first choice's, with where its tokens came from), the completion tokens of all; the
    time to first token of the slowest prompt."""
    firsts = usages[::n]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                 cached_tokens_local=sum(u.cached_tokens_local for u in firsts),
                 cached_tokens_remote=sum(u.cached_tokens_remote for u in firsts),
                 computed_tokens=sum(u.computed_tokens for u in firsts),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 ttft_ms=max(u.ttft_ms for u in firsts))


def model_body(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY}


@dataclass
class Reply:
    """One response's identity, shared by its chunks: chat or text completion."""

    model: str
    chat: bool
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def whole(self, choices: list[tuple[str, str, dict | None]], usage: Usage) -> dict:
        """The whole response: each choice's (text, finish reason, logprobs body or None), in order."""
        if self.chat:
            bodies = [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                       "logprobs": logprobs, "finish_reason": finish_reason}
                      for i, (text, finish_reason, logprobs) in enumerate(choices)]
        else:
            bodies = [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
                      for i, (text, finish_reason, logprobs) in enumerate(choices)]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": bodies,
                "usage": usage_body(usage)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              with_usage_field: bool = False, token_ids: list[int] | None = None, index: int = 0,
              usage: dict | None = None, logprobs: dict | None = None) -> dict:
        """A streamed chunk of choice `index`: new text, or the finish reason; `role` opens a chat's
        assistant message; `token_ids` (the return_token_ids extension) the ids the text came from;
        `usage` the usage so far (continuous usage stats); `logprobs` its tokens' (gateway/logprobs.py)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        elif with_usage_field and self.chat:
            body["usage"] = None   # OpenAI's chat chunks while include_usage is on: the last chunk carries it
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage_body(usage)}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
