"""A worker's hops as trace spans, and the remote tier's fetch time as a histogram.

The service captures each request's trace context when it takes the request (the Generate call's
server span) and hands it to the placement; everything done for the request later, on the engine's
thread or the write-back thread, is parented on it. Only a sampled request's work makes spans
(base/observability.py's `sampled`): a request whose trace was not sampled is not tracked at all.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

from base.observability import current_context, sampled, tracer
from worker.remote.tier import Placement, RemoteTier

MAX_TRACKED = 4096  # requests or pages whose trace context is kept at once (bounded if a hook is missed)


class ObservedRemoteTier(RemoteTier):
    """RemoteTier with spans around its hooks (when `tracing`) and fetch times into `on_fetch`.

    `prefix_lookup` wraps a lookup (over the data plane, or the node's Lookup as its child span, the
    trace context going in the call's metadata), `remote_fetch` a fill (pages over the data plane, or
    the node's GetPages), `write_back` one batch of writes to every placed node (the nodes'
    PutPages). The data plane carries no trace context: what a node does for it has no span of its
    own, only the worker's around it."""

    def __init__(self, *args, tracing: bool = False, on_fetch: Callable[[float], None] | None = None, **kwargs):
        self.tracing = tracing
        self.on_fetch = on_fetch
        self._page_traces: OrderedDict[bytes, object] = OrderedDict()
        self._traces_lock = threading.Lock()  # pages become full on the engine thread, are written on the sender's
        super().__init__(*args, **kwargs)

    def lookup(self, keys: Sequence[bytes], placement: Placement) -> int:
        if not self.tracing or placement.trace is None:
            return super().lookup(keys, placement)
        with tracer().start_as_current_span("worker.prefix_lookup", context=placement.trace) as span:
            hits = super().lookup(keys, placement)
            span.set_attribute("kvcache.pages", len(keys))
            span.set_attribute("kvcache.hit_pages", hits)
            return hits

    def fill(self, keys: Sequence[bytes], block_ids: Sequence[int], placement: Placement) -> int:
        return self._observed(super().fill, keys, block_ids, placement)

    def fill_layerwise(self, keys: Sequence[bytes], block_ids: Sequence[int], placement: Placement,
                       landed: Callable[[int], None]) -> int:
        return self._observed(lambda *args: super(ObservedRemoteTier, self).fill_layerwise(*args, landed),
                              keys, block_ids, placement)

    def fill_in_place(self, keys: Sequence[bytes], block_ids: Sequence[int], placement: Placement):
        """Pinning in place in a span of its own (saying whether it pinned: when not, the fill that
        follows has its span too), its time to `on_fetch` only when it pinned."""
        started = time.perf_counter()
        if not self.tracing or placement.trace is None:
            pages = super().fill_in_place(keys, block_ids, placement)
        else:
            with tracer().start_as_current_span("worker.remote_fetch", context=placement.trace) as span:
                pages = super().fill_in_place(keys, block_ids, placement)
                span.set_attribute("kvcache.pages", len(keys))
                span.set_attribute("kvcache.fetched_pages", 0 if pages is None else len(pages))
                span.set_attribute("kvcache.in_place", pages is not None)
        if pages is not None and self.on_fetch is not None:
            self.on_fetch(time.perf_counter() - started)
        return pages

    def _observed(self, fill: Callable[..., int], keys: Sequence[bytes], block_ids: Sequence[int],
                  placement: Placement) -> int:
        """A fill (either kind) in a span, its time to `on_fetch`."""
        started = time.perf_counter()
        try:
            if not self.tracing or placement.trace is None:
                return fill(keys, block_ids, placement)
            with tracer().start_as_current_span("worker.remote_fetch", context=placement.trace) as span:
                fetched = fill(keys, block_ids, placement)
                span.set_attribute("kvcache.pages", len(keys))
                span.set_attribute("kvcache.fetched_pages", fetched)
                return fetched
        finally:
            if self.on_fetch is not None and keys:
                self.on_fetch(time.perf_counter() - started)

    def on_page_full(self, key: bytes, parent: bytes, block_id: int, placement: Placement) -> None:
        if self.tracing and placement.trace is not None:
            with self._traces_lock:
                self._page_traces[key] = placement.trace
                while len(self._page_traces) > MAX_TRACKED:
                    self._page_traces.popitem(last=False)
        super().on_page_full(key, parent, block_id, placement)

    def _send(self, batch: list) -> None:
        if not self.tracing or not batch:
            return super()._send(batch)
        with self._traces_lock:
            parents = [self._page_traces.pop(item[1], None) for item in batch]  # (addresses, key, parent, page)
        # A batch mixes requests: its one span is parented on the first page of a sampled request.
        parent = next((p for p in parents if p is not None), None)
        if parent is None:  # no sampled request's page in this batch: no span
            return super()._send(batch)
        with tracer().start_as_current_span("worker.write_back", context=parent) as span:
            span.set_attribute("kvcache.pages", len(batch))
            return super()._send(batch)


class RequestSpans:
    """Queue wait, prefill chunk and decode spans of each request, read from the engine's step records
    (`on_step`) and its completion (`on_finish`) and written with their measured start and end times:
    nothing is timed twice, and the engine's steps carry no tracing code. Only with tracing on."""

    def __init__(self):
        self._requests: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()  # begin() runs on gRPC threads, the rest on the engine's

    def begin(self, request_id: str, placement: Placement) -> None:
        """On the Generate call's thread, before the request is queued: capture its context, when
        its trace is sampled (a request not sampled is not tracked at all)."""
        context = current_context()
        if not sampled(context):
            return
        placement.trace = context
        with self._lock:
            if request_id in self._requests:  # a duplicate id, refused: the running request keeps its context
                return
            self._requests[request_id] = {"context": context, "seen": False, "first": None}
            while len(self._requests) > MAX_TRACKED:
                self._requests.popitem(last=False)

    def on_step(self, record: dict) -> None:
        start = record["time"]
        end = start + (record["schedule_ms"] + record["forward_ms"]) / 1000.0
        for request in record["requests"]:
            state = self._requests.get(request["id"])
            if state is None:
                continue
            context = state["context"]
            if not state["seen"]:
                state["seen"] = True
                _span("worker.queue_wait", context, request["arrived"], start)
            if request["computed"] < request["prompt"]:
                _span("worker.prefill_chunk", context, start, end, {
                    "kvcache.tokens": request["new"], "kvcache.cached_local": request["cached_local"],
                    "kvcache.cached_remote": request["cached_remote"]})
            if state["first"] is None and request["computed"] + request["new"] >= request["prompt"]:
                state["first"] = end  # its first token came out of this step

    def on_finish(self, completion) -> None:
        with self._lock:
            state = self._requests.pop(completion.request_id, None)
        if state is None or state["first"] is None:
            return
        usage = completion.usage
        _span("worker.decode", state["context"], state["first"], time.time(), {
            "kvcache.completion_tokens": usage.completion_tokens, "kvcache.finish_reason": completion.finish_reason})


def _span(name: str, context, start_s: float, end_s: float, attributes: dict | None = None) -> None:
    span = tracer().start_span(name, context=context, start_time=int(start_s * 1e9), attributes=attributes)
    span.end(end_time=int(max(start_s, end_s) * 1e9))


def chain(*hooks: Callable | None) -> Callable | None:
    """One hook that calls each of `hooks` that is set (on_step and on_finish have one slot each)."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def call(value) -> None:
        for hook in hooks:
            hook(value)

    return call



def attach(service, tier: ObservedRemoteTier, metrics=None, tracing: bool = False) -> None:
    """Hook `metrics` (worker.metrics.WorkerMetrics) and, when `tracing`, request spans into a
    worker's service, engine and observed tier; hooks already set (a step log) are kept."""
    engine = service.engine
    spans = RequestSpans() if tracing else None
    service.metrics, service.spans = metrics, spans
    engine.on_finish = chain(engine.on_finish, metrics and metrics.on_finish, spans and spans.on_finish)
    engine.on_step = chain(engine.on_step, spans and spans.on_step)
    if metrics is not None:
        tier.on_fetch = metrics.remote_fetch.observe
