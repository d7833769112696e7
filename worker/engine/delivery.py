"""A request's delivery, kept by the engine from add_request to the request's end: the handle
its deltas go to, its stop checker (what text is out), and what has been sent so far.

The engine owns the scheduling side (worker/engine/request.py's Request); this module turns a
request's progress into the StreamDelta and Completion it hands back (worker/engine/outputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from base.generation import Prompt, TokenLogprob, Usage
from worker.engine.outputs import Completion, RequestHandle, StreamDelta
from worker.engine.request import Request
from worker.engine.sampling import StopChecker


@dataclass
class Delivery:
    request: Request
    handle: RequestHandle
    checker: StopChecker
    arrival: float
    first_token_time: float | None = None
    num_sent_tokens: int = 0
    logprobs: list[TokenLogprob | None] | None = None  # per output token, with params.logprobs (None: resumed)
    prompt_sent: bool = False  # the prompt went out on a delta (echo, prompt_logprobs: prompt)

    def prompt(self, tokenizer) -> Prompt | None:
        """The prompt to hand back, once it is computed, when the request asked for it (`echo`,
        `prompt_logprobs`): its ids, its text and its tokens' logprobs, on the first delta after it."""
        request = self.request
        if not request.prompt_computed or not (request.params.echo or request.prompt_logprobs is not None):
            return None
        ids = request.token_ids[:request.num_prompt_tokens]
        return Prompt(ids, tokenizer.decode(ids),
                      None if request.prompt_logprobs is None else list(request.prompt_logprobs),
                      tokenizer.token_bytes(ids[0]))

    def send(self, tokenizer, completion: Completion | None = None) -> StreamDelta:
        """Put on the handle's queue what is new since the last delta (the final one with `completion`)."""
        output = self.request.output_token_ids
        prompt = None if self.prompt_sent else self.prompt(tokenizer)
        delta = StreamDelta(self.request.request_id, output[self.num_sent_tokens:], self.checker.take_text_delta(),
                            finished=completion is not None, completion=completion,
                            logprobs=None if self.logprobs is None else self.logprobs[self.num_sent_tokens:],
                            prompt=prompt)
        self.prompt_sent |= prompt is not None
        self.num_sent_tokens = len(output)
        self.handle.queue.put(delta)
        return delta

    def completion(self, tokenizer, error: str | None = None) -> Completion:
        """The request's Completion, its usage counted as its first admission decided."""
        request = self.request
        # prompt_tokens = cached_tokens_local + cached_tokens_remote + computed_tokens, as decided at the
        # request's first admission: recomputing after a preemption is not counted (num_preemptions is).
        # A resumed request's cache hits may reach into its resumed tokens: count prompt tokens only.
        local = min(request.cached_tokens_local or 0, request.num_prompt_tokens)
        remote = min(request.cached_tokens_remote or 0, request.num_prompt_tokens - local)
        ttft = 0.0 if self.first_token_time is None else (self.first_token_time - self.arrival) * 1000.0
        usage = Usage(prompt_tokens=request.num_prompt_tokens, cached_tokens_local=local, cached_tokens_remote=remote,
                      computed_tokens=request.num_prompt_tokens - local - remote if request.cached_tokens_local is not None else 0,
                      completion_tokens=len(request.output_token_ids), ttft_ms=ttft)
        return Completion(request.request_id, request.token_ids[:request.num_prompt_tokens],
                          request.output_token_ids, self.checker.text, self.checker.finish_reason, usage,
                          request.num_preemptions, error, logprobs=self.logprobs, prompt=self.prompt(tokenizer))
