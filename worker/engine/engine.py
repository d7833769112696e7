"""The engine: a model, its paged KV pool and a scheduler, stepped by one loop thread while
other threads add requests, stream their tokens and abort them.

`add_request` may be called from any thread: it validates, tokenizes and queues the request, and
returns a handle whose queue receives a `StreamDelta` per new token (and a final one). Only
`step()` touches the scheduler and the pool, under the engine's lock, and hands each scheduled
step to a StepRunner (worker/engine/step_runner.py). `generate` and `stream` step the engine
themselves, for a caller with no loop thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from base.pages import DEFAULT_PAGE_TOKENS
from worker.kv.block_pool import BlockPool
from worker.connector.connector import KVConnector, Tier
from worker.kv.quant import storage_dtype
from worker.model import KV_DTYPES, kv_block_shape, load_model
from worker.kv.pages import tenant_root
from worker.engine.request import Request, RequestStatus
from worker.engine.logprobs import log_softmax, token_logprob
from worker.engine.sampling import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, SamplingParams, StopChecker, sample
from worker.engine.scheduler import ALONE_PREFILL_TOKENS, PREFILL_TOKENS_PER_STEP, Scheduler
from worker.engine.delivery import Delivery
from worker.engine.outputs import Completion, RequestHandle, RequestIdInUse, StreamDelta
from worker.engine.step_runner import StepRunner
from worker.kv.window import release_window

log = logging.getLogger("worker.engine")

DEFAULT_KV_CACHE_BYTES = 256 * 2**20
IDLE_WAIT_S = 0.05  # a step with nothing to run waits this long at most for remote KV or a new request


class Engine:
    def __init__(self, model, kv_dtype: str = "float32", num_blocks: int | None = None, page_tokens: int = DEFAULT_PAGE_TOKENS,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 1024, remote_tier: Tier | None = None,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, seed: int | None = None,
                 max_prefill_tokens: int = PREFILL_TOKENS_PER_STEP, alone_prefill_tokens: int = ALONE_PREFILL_TOKENS):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        cfg = model.config
        self.model = model
        self.tokenizer = model.tokenizer
        self.kv_dtype = kv_dtype
        self.page_tokens = page_tokens
        self.fingerprint = model.fingerprint(kv_dtype, page_tokens)
        block_shape = kv_block_shape(cfg, kv_dtype, page_tokens)
        # The pool is in the KV dtype: with float16 KV a block holds a page exactly as it goes on the
        # wire, so a fetched page lands without a cast, a full page is sent as it is, and
        # kv_cache_bytes holds twice the blocks; attention converts what it reads
        # (worker/model/attention.py: why the pool is converted a page at a time). With int8 or int4
        # KV a block is a page's bytes, K/V encoded as computed (worker/kv/quant.py).
        dtype = storage_dtype(kv_dtype)  # the pool holds KV as stored and sent
        if num_blocks is None:
            num_blocks = max(1, kv_cache_bytes // (int(np.prod(block_shape)) * dtype.itemsize))
        self.pool = BlockPool(num_blocks, block_shape, dtype, arena=True)  # arena: pages read in place
        self._work = threading.Event()  # set by add_request, cancel and the connector's finished work
        self.scheduler = Scheduler(self.pool, page_tokens, max_num_seqs, max_num_batched_tokens,
                                   self._connector_for(remote_tier), max_prefill_tokens=max_prefill_tokens,
                                   alone_prefill_tokens=alone_prefill_tokens,
                                   release_window=release_window(cfg.layer_windows()))
        self.max_total_tokens = min(cfg.max_positions, num_blocks * page_tokens)
        self.eos_token_ids = (self.tokenizer.eos_token_id, *cfg.extra_eos_token_ids)  # any of them stops
        self._rng = np.random.default_rng(seed)
        self._live: dict[str, Delivery] = {}
        self._inbox: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._cancelled: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._ids_in_use: set[str] = set()  # added and not finished: inbox and _live (add_request)
        self._ids_lock = threading.Lock()
        self._ids = itertools.count()
        self.on_step: Callable[[dict], None] | None = None  # called after every step with its record (the loop thread)
        self.on_finish: Callable[[Completion], None] | None = None  # called with each request's completion (metrics)
        self._runner = StepRunner(model, self.pool, kv_dtype, self.scheduler, self)

    @classmethod
    def load(cls, model: str, invariant: bool | None = None, **options) -> "Engine":
        """`model` as load_model takes it; `invariant`: batch-invariant numerics (default on, worker/model/invariant.py)."""
        return cls(load_model(model, invariant=invariant), **options)

    @property
    def kv_pool(self) -> np.ndarray:
        """The pool array `[num_blocks, n_layers, 2, n_kv_heads, page_tokens, head_dim]`, KV dtype (for tiers);
        with int8 or int4 KV, bytes `[num_blocks, n_layers, n_kv_heads, page_tokens, token bytes]`."""
        return self.pool.kv

    def attach_remote_tier(self, tier: Tier | None) -> None:
        """Plug in (or, with None, remove) the remote tier, reached through a KVConnector (worker/connector/connector.py);
        after construction (a tier needs `kv_pool`), before a request waits on the old one."""
        with self._lock:
            old = self.scheduler.connector
            if self.scheduler.parked or (old is not None and old.num_pending() > 0):
                raise RuntimeError("a remote tier is attached while no request waits for one: finish them first")
            self.scheduler.set_connector(self._connector_for(tier))
        if old is not None:
            old.close()

    def _connector_for(self, tier: Tier | None) -> KVConnector | None:
        return None if tier is None else KVConnector(tier, wake=self._work.set)

    @property
    def connector(self) -> KVConnector | None:
        return self.scheduler.connector

    # ---- any thread ----------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, tier_context: Any = None, bypass_cache: bool = False,
                    resumed_token_ids: Sequence[int] = (), namespace: str = "", priority: int = 0,
                    **sampling) -> RequestHandle:
        """Queue a request (text or token ids); sampling options go in `params` or as keywords.
        `resumed_token_ids`: tokens another worker generated for it before it died. The request
        goes on as if it had generated them itself: they are replayed through its stop checker,
        count in `max_new_tokens`, and their text is not handed out again (nor their logprobs: the
        first worker sent them); if they already end it, it finishes at once, as it would have there.
        `namespace`: the caller's tenant namespace, mixed into the root of its page keys (worker/kv/pages.py).
        `priority`: lower is scheduled first (worker/engine/priority.py)."""
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            raise ValueError("give sampling options either as params or as keywords, not both")
        token_ids = self._prompt_token_ids(prompt)
        resumed = self._checked_token_ids(resumed_token_ids, "resumed token ids")
        if len(token_ids) + len(resumed) > self.max_total_tokens:
            raise ValueError(f"the prompt and resumed tokens are {len(token_ids) + len(resumed)} tokens; this engine "
                             f"takes at most {self.max_total_tokens}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(request_id, token_ids, params, tenant_root(self.fingerprint, namespace), self.page_tokens,
                          tier_context, bypass_cache, priority=int(priority))
        checker = StopChecker(self.tokenizer, params, token_ids, self.eos_token_ids, self.max_total_tokens)
        for token in resumed:
            if checker.finish_reason is not None:
                raise ValueError(f"the resumed tokens go on after the request ended ({checker.finish_reason})")
            request.token_ids.append(token)
            checker.append(token, len(request.output_token_ids), request.num_tokens)
        live = Delivery(request, RequestHandle(request_id), checker, arrival=time.monotonic(),
                        num_sent_tokens=len(resumed),
                        logprobs=[None] * len(resumed) if params.logprobs is not None else None)
        checker.take_text_delta()  # what the first worker already handed out
        connector = self.scheduler.connector
        keys = None if connector is None else request.page_keys(request.num_reusable_pages())
        # An id is the request's from here until it finishes, checked and taken under one lock, so a
        # duplicate (running, or still in the inbox) is refused before anything is queued.
        with self._ids_lock:
            if request_id in self._ids_in_use:
                raise RequestIdInUse(f"request id {request_id!r} is already in use by a request not yet finished: "
                                     f"give each request its own id")
            self._ids_in_use.add(request_id)
            if keys:
                connector.lookups.start(request, keys)  # prefetch on arrival (TierLookups.start)
            self._inbox.put(live)
        self._work.set()
        return live.handle

    def abort(self, request_id: str) -> bool:
        """Stop a request and release its blocks now, waiting for the engine's lock (held through a
        forward); False if it is unknown or already finished."""
        with self._lock:
            self._take_inbox()
            live = self._live.get(request_id)
            if live is None:
                return False
            live.checker.finish(FINISH_ABORT)
            self._finish(live)
            return True

    def cancel(self, handle: RequestHandle) -> None:
        """Abort the request without waiting for the engine: the loop thread aborts it before its next
        step; a finished one is left alone. For a caller that must not block: gRPC runs end-of-call
        callbacks on the server's one event thread, and an `abort` waiting there for the lock
        stalls every stream."""
        if handle.completion is None:
            self._cancelled.put(handle)
            self._work.set()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """For a loop thread: block until a request may be waiting (True) or the timeout passes."""
        if self.has_unfinished():
            return True
        self._work.clear()
        return self.has_unfinished() or self._work.wait(timeout)

    def live_request_ids(self) -> list[str]:
        """Ids of requests added and not finished yet (queued ones included)."""
        with self._lock:
            self._take_inbox()
            return list(self._live)

    def has_unfinished(self) -> bool:
        """Requests to run, pages read in place to cache, or a given-up load's blocks to release (on an idle
        worker the loader's wake may come before wait_for_work clears the event: nothing else would step)."""
        return (bool(self._live) or not self._inbox.empty() or self.scheduler.in_place.has_landings()
                or (self.connector is not None and self.connector.has_releases()))

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        """Requests queued or waiting for their remote KV."""
        return len(self.scheduler.waiting) + len(self.scheduler.parked) + self._inbox.qsize()

    # ---- the loop thread -----------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Run one forward pass over the scheduled requests; the deltas it produced (newcomers'
        too). With nothing to run while requests wait for remote KV, it waits for the connector
        (at most IDLE_WAIT_S, outside the lock) and returns no deltas."""
        with self._lock:
            self._work.clear()  # what arrives from here on wakes the wait below
            self._take_inbox()
            self._take_cancelled()
            started = time.monotonic()
            batch = self.scheduler.schedule()
            if batch.requests:
                return self._runner.run(batch, started)
        if self.scheduler.has_unfinished():
            self._work.wait(IDLE_WAIT_S)
        return []

    # ---- single-threaded helpers ----------------------------------------------

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], params: SamplingParams | None = None,
                 **options) -> list[Completion]:
        """Run prompts together to completion; one Completion per prompt, in order."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        handles = []
        try:
            for prompt in prompts:
                handles.append(self.add_request(prompt, params, **options))
        except ValueError:
            for handle in handles:  # all or nothing: a refused prompt leaves no request behind
                self.abort(handle.request_id)
            raise
        while any(h.completion is None for h in handles):
            self.step()
        while self.scheduler.in_place.has_landings():  # pages read in place, cached now rather than at the next call
            self.step()
        return [h.completion for h in handles]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **options) -> Iterator[StreamDelta]:
        """Yield deltas of one request as they are produced (steps the engine; aborts if closed early)."""
        handle = self.add_request(prompt, params, **options)
        try:
            while True:
                while not handle.queue.empty():
                    delta = handle.queue.get()
                    yield delta
                    if delta.finished:
                        return
                self.step()
        finally:
            if handle.completion is None:
                self.abort(handle.request_id)

    # ---- internals -----------------------------------------------------------

    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = self._checked_token_ids(prompt, "token ids")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) > self.max_total_tokens:
            cfg = self.model.config
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this engine takes at most {self.max_total_tokens} "
                             f"(model max positions {cfg.max_positions}, pool {self.pool.num_blocks} blocks "
                             f"of {self.page_tokens} tokens)")
        return token_ids

    def _checked_token_ids(self, tokens: Sequence[int], what: str) -> list[int]:
        token_ids = [int(t) for t in tokens]
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} must be in [0, {vocab}): got {bad[:5]}")
        return token_ids

    def _take_inbox(self) -> None:
        for live in _drained(self._inbox):
            self._live[live.request.request_id] = live
            if live.checker.finish_reason is not None:  # resumed after its end (add_request)
                live.request.status = RequestStatus.FINISHED  # never scheduled
                self._finish(live)
                continue
            try:
                self.scheduler.add(live.request)
            except ValueError as exc:
                live.request.status = RequestStatus.FINISHED
                self.fail(live.request, str(exc))

    def _take_cancelled(self) -> None:
        for handle in _drained(self._cancelled):
            live = self._live.get(handle.request_id)
            if live is None:  # added after this step took the inbox, then cancelled: in the inbox now
                self._take_inbox()
                live = self._live.get(handle.request_id)
            if live is not None and live.handle is handle:  # not a later request reusing the id
                live.checker.finish(FINISH_ABORT)
                self._finish(live)

    # ---- the step runner's view of the requests (worker/engine/step_runner.py's LiveRequests) ----

    def take_arrivals(self) -> bool:
        if self._inbox.empty():
            return False
        self._take_inbox()
        return True

    def arrival(self, request: Request) -> float:
        return self._live[request.request_id].arrival

    def take_prompt_logits(self, request: Request, start: int, logits: np.ndarray) -> None:
        logprobs, k = log_softmax(logits), request.params.prompt_logprobs
        for offset in range(min(len(logprobs), request.num_prompt_tokens - 1 - start)):
            position = start + offset  # its logits predict the token after it
            request.prompt_logprobs[position] = token_logprob(logprobs[offset], request.token_ids[position + 1], k,
                                                              self.tokenizer.token_bytes)

    def append_token(self, request: Request, logits: np.ndarray) -> StreamDelta:
        live = self._live[request.request_id]
        request.prompt_computed = True
        if request.params.max_new_tokens == 0:  # the prompt alone (echo, prompt_logprobs): "length", no token
            live.checker.finish(FINISH_LENGTH)
            return self._finish(live)
        token = sample(logits, request.params, request.num_tokens, self._rng)
        if live.logprobs is not None:
            live.logprobs.append(token_logprob(log_softmax(logits), token, request.params.logprobs,
                                               self.tokenizer.token_bytes))
        request.token_ids.append(token)
        if live.first_token_time is None:
            live.first_token_time = time.monotonic()
        live.checker.append(token, len(request.output_token_ids), request.num_tokens)
        if live.checker.finish_reason is not None:
            return self._finish(live)
        return live.send(self.tokenizer)

    def fail(self, request: Request, message: str) -> list[StreamDelta]:
        """Finish one request with an error; the rest of the engine goes on (StepRunner._run_isolated)."""
        live = self._live.get(request.request_id)
        if live is None:
            return []
        live.checker.finish_reason = FINISH_ERROR  # not finish(): decoding its text may be what failed
        return [self._finish(live, error=message)]

    def _finish(self, live: Delivery, error: str | None = None) -> StreamDelta:
        request = live.request
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.finish(request)
        if self.connector is not None:
            self.connector.drop(request)  # its prefetch, if it never reached the scheduler
        del self._live[request.request_id]
        with self._ids_lock:
            self._ids_in_use.discard(request.request_id)
        completion = live.completion(self.tokenizer, error)
        live.handle.completion = completion
        if self.on_finish is not None:
            try:
                self.on_finish(completion)
            except Exception as exc:  # metrics that fail must not fail the request
                log.warning("on_finish failed: %r", exc)
        return live.send(self.tokenizer, completion)


def _drained(items: queue.SimpleQueue) -> Iterator:
    """What another thread has put in `items` so far, taken out in order."""
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return
