"""What the engine hands back for a request: a handle to iterate, a delta per new token, and
the final Completion. Plain data, shared by the engine and whoever reads its output."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Iterator

from base.generation import Prompt, TokenLogprob, Usage


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # the new tokens (a final stop token included)
    text: str             # their text (stop tokens and stop strings excluded)
    finish_reason: str    # "stop", "length", "abort" or "error"
    usage: Usage
    num_preemptions: int = 0
    error: str | None = None  # with finish_reason "error": what failed (it failed alone: StepRunner._run_isolated)
    logprobs: list[TokenLogprob | None] | None = None  # per new token when asked (None: a resumed one's)
    prompt: Prompt | None = None  # the prompt, when asked for it back (echo, prompt_logprobs)


class RequestIdInUse(ValueError):
    """`add_request` got an id that a request not yet finished holds (Engine.add_request)."""


@dataclass
class StreamDelta:
    request_id: str
    token_ids: list[int]             # tokens new since the previous delta
    text: str                        # text new since the previous delta
    finished: bool = False
    completion: Completion | None = None  # on the final delta
    logprobs: list[TokenLogprob | None] | None = None  # one per token id, when the request asked
    prompt: Prompt | None = None  # on the first delta after the prompt is computed, when asked (Engine._prompt)


class RequestHandle:
    """What `add_request` returns: iterate it (from any thread) for the request's deltas."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: queue.Queue[StreamDelta] = queue.Queue()
        self.completion: Completion | None = None

    def __iter__(self) -> Iterator[StreamDelta]:
        while True:
            delta = self.queue.get()
            yield delta
            if delta.finished:
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request finishes (some other thread must be stepping the engine)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            delta = self.queue.get(timeout=remaining)
            if delta.finished:
                return delta.completion
