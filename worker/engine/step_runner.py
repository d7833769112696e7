"""Running one scheduled step: the forward over its requests, newcomers computed between its
layers, a layer-wise step's waits for its pages, and failures kept to the requests at fault.

The Engine (worker/engine/engine.py) keeps its requests' lifecycle and hands each scheduled step to a
`StepRunner`, which sees the engine's requests only through `LiveRequests`. It runs on the loop
thread, under the engine's lock.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

import numpy as np

from worker.kv.block_pool import BlockPool
from worker.model import ForwardBatch
from worker.engine.outputs import StreamDelta
from worker.engine.request import Request
from worker.engine.scheduled_batch import ScheduledBatch
from worker.engine.scheduler import Scheduler

log = logging.getLogger("worker.engine")  # its messages are the engine's


class LiveRequests(Protocol):
    """What a step needs of the engine's requests."""

    on_step: Callable[[dict], None] | None  # called with each step's record (`_step_record`)

    def take_arrivals(self) -> bool:
        """Hand requests added since the step began to the scheduler; False when there were none."""

    def arrival(self, request: Request) -> float:
        """When it was added (time.monotonic())."""

    def append_token(self, request: Request, logits: np.ndarray) -> StreamDelta:
        """Sample its next token from `logits` and send it (or its end)."""

    def take_prompt_logits(self, request: Request, start: int, logits: np.ndarray) -> None:
        """Logits at its positions start, start + 1, ... (a chunk of its prompt): its prompt logprobs."""

    def fail(self, request: Request, message: str) -> list[StreamDelta]:
        """End it with an error (StepRunner._run_isolated); [] when it already ended."""


class StepRunner:
    """Runs the engine's scheduled steps: forwards, newcomers between layers, failures."""

    def __init__(self, model, pool: BlockPool, kv_dtype: str, scheduler: Scheduler, requests: LiveRequests):
        self.model = model
        self.pool = pool
        self.kv_dtype = kv_dtype
        self.scheduler = scheduler
        self.requests = requests
        self._unix_offset = time.time() - time.monotonic()  # monotonic times to Unix seconds, for on_step

    def run(self, batch: ScheduledBatch, started: float) -> list[StreamDelta]:
        """The step's forward and its deltas, newcomers' first; a layer-wise step's own way
        (_step_layerwise). An exception of the scheduler's escapes (_run_isolated says why).

        Between two layers, a request that arrived since the step began may be computed whole, in
        a forward of its own, before the step goes on (Scheduler.schedule_newcomer): a short prompt
        then does not wait for the rest of a long prompt's chunk. The check is one look at the
        inbox per layer; the step's own requests and blocks are left untouched."""
        if batch.layerwise:
            return self._step_layerwise(batch, started)
        newcomer_deltas: list[StreamDelta] = []
        scheduler_failures: list[Exception] = []

        def between_layers() -> None:
            if scheduler_failures or not self.requests.take_arrivals():
                return  # nobody new: the usual case, one cheap check a layer
            paused = time.monotonic()
            try:
                newcomer = self.scheduler.schedule_newcomer(batch)
            except Exception as exc:  # not a request's fault: raised after the forward (_run_isolated)
                scheduler_failures.append(exc)
                return
            if newcomer is not None:
                newcomer_deltas.extend(self._run_isolated(newcomer, paused))

        deltas = self._run_isolated(batch, started, between_layers)
        if scheduler_failures:
            raise scheduler_failures[0]
        return newcomer_deltas + deltas

    def _step_layerwise(self, batch: ScheduledBatch, started: float) -> list[StreamDelta]:
        """A request whose remote pages are still landing, each layer computed once its pages are in.

        Before each layer the forward waits for that layer's pages (the connector's `wait_layer`:
        a short wait a layer and a budget a step, worker/connector/layers.py says why), under the
        engine's lock as the forward is; the network I/O itself runs on the connector's loader
        thread. A layer that does not come in time ends the forward at once and the request waits
        for its load as any parked one; pages not all intact after the forward throw the step's
        work away (no token), and the request computes its prompt without them."""
        request, connector = batch.requests[0], self.scheduler.connector
        layer = 0

        def next_layer() -> None:  # after layer `layer`, before the next one
            nonlocal layer
            layer += 1
            if not connector.layerwise_loads.wait_layer(request, layer):
                raise _LayerMissing(layer)

        try:
            if not connector.layerwise_loads.wait_layer(request, 0):
                raise _LayerMissing(0)
            return self._run(batch, started, time.monotonic(), next_layer,
                             settle=lambda: self.scheduler.settle_layerwise(request))
        except _LayerMissing as missing:
            log.info("layer %d of request %s's remote pages did not land in time; it waits for its load",
                     missing.layer, request.request_id)
            self.scheduler.repark(request)
            return []
        except Exception as exc:  # the model failed on it: it fails alone (_run_isolated)
            return self.requests.fail(request, f"the model failed on it: {exc!r}")

    def _run_isolated(self, batch: ScheduledBatch, started: float,
                      between_layers: Callable[[], None] | None = None) -> list[StreamDelta]:
        """`_run`, and if its forward raises, each request alone; those that fail alone fail.

        A step that fails fails only the requests at fault: a forward writes nothing but the K/V of
        the positions it computes, so each request of a failed forward can run again alone, and
        those that fail alone finish with an error (`finish_reason` "error"). Work after the
        forward (sampling, stop checks) is done request by request in `_run`, so a request whose
        own work raises fails alone. Only an exception outside any request (the scheduler's)
        escapes `step()`: then the engine's state is in doubt, and its caller stops using it."""
        try:
            return self._run(batch, started, time.monotonic(), between_layers)
        except Exception as exc:
            if len(batch) == 1:
                return self.requests.fail(batch.requests[0], f"the model failed on it: {exc!r}")
            deltas = []
            for request, num_new in zip(batch.requests, batch.num_new_tokens):
                deltas += self._run_isolated(ScheduledBatch([request], [num_new]), time.monotonic())
            return deltas

    def _run(self, batch: ScheduledBatch, started: float, scheduled: float,
             between_layers: Callable[[], None] | None, settle: Callable[[], bool] | None = None) -> list[StreamDelta]:
        """Forward a scheduled batch, then account for its tokens; its deltas. A batch run
        between the layers of another gets no `between_layers` of its own (no nesting deeper).
        `settle()` False after the forward throws its work away (Scheduler.settle_layerwise)."""
        # For on_step only: what each request had computed, and when it arrived (a finished one leaves _live).
        on_step = self.requests.on_step
        before = None if on_step is None else [(r.num_computed_tokens, self.requests.arrival(r)) for r in batch.requests]
        tables = [self.scheduler.in_place.forward_table(r) for r in batch.requests]
        token_ids, positions, starts = [], [], [0]
        # A request that wants its prompt's logprobs needs logits at every position of its chunk: the
        # forward then returns them all (`all_logits`), and each request's next token is drawn from its
        # last row as always. The step's other requests pay the head's product over their new tokens
        # too: a decode has one, and prompts that join a step have few (Scheduler.join_tokens).
        prompt_logits = [r.wants_prompt_logits and r.num_computed_tokens < r.num_prompt_tokens - 1
                         for r in batch.requests]
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            token_ids.extend(request.token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
            starts.append(starts[-1] + num_new)
        forward_batch = ForwardBatch(
            token_ids=np.asarray(token_ids, dtype=np.int64),
            positions=np.asarray(positions, dtype=np.int64),
            query_starts=np.asarray(starts, dtype=np.int64),
            context_lens=np.asarray([r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens)],
                                    dtype=np.int64),
            block_tables=[np.asarray(table, dtype=np.int32) for table, _ in tables],
            cached_lens=self._cached_lens(batch),
            all_logits=any(prompt_logits),
        )
        rows = np.asarray(starts[1:]) - 1 if any(prompt_logits) else np.arange(len(batch))  # each one's last
        # Pages read in place (InPlaceJoins.forward_table) lie in the arena's windows, past the pool's
        # own blocks, so the forward is given the arena's whole range. They are cached pages, never
        # written: a forward writes only the K/V of the positions it computes, and a prompt whose
        # every page is cached computes its last token without writing it (_cached_lens).
        kv = self.pool.arena.all_blocks if any(in_place for _, in_place in tables) else self.pool.kv
        logits = self.model.forward(forward_batch, kv, self.kv_dtype, between_layers=between_layers)
        forwarded = time.monotonic()
        if settle is not None and not settle():
            return []
        altered = self.scheduler.settle_in_place(batch.requests) if any(in_place for _, in_place in tables) else ()
        deltas = []
        for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if id(request) in altered:
                continue  # its pages read in place were altered: it computes its prompt again
            try:
                if prompt_logits[row]:
                    self.requests.take_prompt_logits(request, request.num_computed_tokens,
                                                     logits[starts[row]:starts[row + 1]])
                self.scheduler.on_computed(request, num_new)
                if request.num_computed_tokens == request.num_tokens:
                    deltas.append(self.requests.append_token(request, logits[rows[row]]))
            except Exception as exc:  # this request's own work: it fails alone
                deltas += self.requests.fail(request, f"its next token failed: {exc!r}")
        if before is not None:
            nested = between_layers is None
            try:
                on_step(self._step_record(batch, before, started, scheduled, forwarded, nested))
            except Exception as exc:  # a log that cannot be written must not fail requests
                log.warning("on_step failed: %r", exc)
        return deltas

    def _cached_lens(self, batch: ScheduledBatch) -> np.ndarray | None:
        """Per request, the tokens whose K/V came from a cache (its cached pages, and remote pages
        still landing under a layer-wise fill), when a step computes some of them again (a prompt
        whose every page was cached computes its last token: Scheduler._admit); None when no
        request does, the usual case."""
        cached = [self.scheduler.remote.num_reused_tokens(r) for r in batch.requests]
        if all(c <= r.num_computed_tokens for c, r in zip(cached, batch.requests)):
            return None
        return np.asarray(cached, dtype=np.int64)

    def _step_record(self, batch, before: list[tuple[int, float]], started: float, scheduled: float,
                     forwarded: float, nested: bool) -> dict:
        """One step for `on_step` (times from time.monotonic()): when it started (Unix seconds), how
        long scheduling and the forward took, and per request its tokens and arrival (a request
        whose `computed` + `new` reaches `prompt` got its first token in this step). A step run
        between the layers of another (`run`) is logged first and says so; the other's
        forward_ms includes it."""
        return {
            "time": self._unix_offset + started,
            "between_layers": nested,
            "schedule_ms": (scheduled - started) * 1000.0,
            "forward_ms": (forwarded - scheduled) * 1000.0,
            "requests": [
                {"id": r.request_id, "arrived": self._unix_offset + arrived, "new": n, "computed": computed,
                 "prompt": r.num_prompt_tokens, "cached_local": r.cached_tokens_local or 0,
                 "cached_remote": r.cached_tokens_remote or 0}
                for r, n, (computed, arrived) in zip(batch.requests, batch.num_new_tokens, before)
            ],
        }


class _LayerMissing(Exception):
    """A layer of an early-joined request's remote pages did not land (StepRunner._step_layerwise)."""

    def __init__(self, layer: int):
        super().__init__(f"layer {layer} did not land")
        self.layer = layer
