"""A worker's Prometheus metrics, and their vLLM-named aliases so vLLM dashboards light up.

Token counts come from each request's completion, so they equal what its usage reports
(`WorkerMetrics.on_finish`); queue lengths, the pool's use and the remote tier's counters are read
when scraped (`_EngineCollector`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from base.observability import DURATION_BUCKETS
from worker.engine.engine import Completion, Engine

SOURCES = ("local", "remote", "computed")
FINISH_REASONS = ("stop", "length", "abort", "error")


class WorkerMetrics:
    def __init__(self, engine: Engine, tier=None, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        model = engine.model.name
        r.register(_EngineCollector(engine, tier, model))
        self.prompt_tokens = Counter("kvcache_worker_prompt_tokens", "Prompt tokens of finished requests, by where "
                                     "their KV came from", ["source"], registry=r)
        self.generation_tokens = Counter("kvcache_worker_generation_tokens", "Tokens generated (usage's "
                                         "completion_tokens)", registry=r)
        self.requests = Counter("kvcache_worker_requests", "Requests finished, by finish reason", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram("kvcache_worker_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=DURATION_BUCKETS)
        self.remote_fetch = Histogram("kvcache_worker_remote_fetch_seconds", "Seconds a fetch of pages from kvnodes "
                                      "took (lookups of replicas, transfer, writing into the pool)", registry=r,
                                      buckets=DURATION_BUCKETS)
        self.step = Histogram("kvcache_worker_step_seconds", "Seconds an engine step took (schedule, forward, "
                              "sampling)", registry=r, buckets=DURATION_BUCKETS)
        self.request_duration = Histogram("kvcache_worker_request_duration_seconds",
                                          "Seconds a Worker gRPC call took, by method", ["method"], registry=r,
                                          buckets=DURATION_BUCKETS)
        # vLLM's names, labelled with model_name as vLLM's are (counted in on_finish).
        self.vllm_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed", ["model_name"], registry=r)
        self.vllm_generation = Counter("vllm:generation_tokens", "Generation tokens processed", ["model_name"],
                                       registry=r)
        self.vllm_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", ["model_name"],
                                    registry=r)
        self.vllm_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", ["model_name"], registry=r)
        self.vllm_external_queries = Counter("vllm:external_prefix_cache_queries",
                                             "External (kvnode) prefix cache queries, in tokens", ["model_name"],
                                             registry=r)
        self.vllm_external_hits = Counter("vllm:external_prefix_cache_hits",
                                          "External (kvnode) prefix cache hits, in tokens", ["model_name"], registry=r)
        self.vllm_success = Counter("vllm:request_success", "Requests finished, by finish reason",
                                    ["model_name", "finished_reason"], registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds",
                                   ["model_name"], registry=r, buckets=DURATION_BUCKETS)
        for source in SOURCES:  # every series present from the first scrape
            self.prompt_tokens.labels(source)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self._by_source = {source: self.prompt_tokens.labels(source) for source in SOURCES}
        self._vllm = [m.labels(model) for m in (self.vllm_prompt, self.vllm_generation, self.vllm_queries,
                                                self.vllm_hits, self.vllm_external_queries, self.vllm_external_hits)]
        self._vllm_ttft = self.vllm_ttft.labels(model)
        self._model = model

    def on_finish(self, completion: Completion) -> None:
        """Count a finished request from its usage (`Engine.on_finish`): prompt tokens by source as
        decided at its first admission, generation tokens as its completion_tokens (a resumed
        request's replayed tokens included, as in its usage); nothing is counted per token or page.

        The vLLM aliases count as vLLM counts its own prefix cache and its KV connector's: the
        local cache's queries are prompt tokens, its hits those found locally; the kvnodes'
        (external) queries are prompt tokens not found locally, their hits those fetched. Unlike
        vLLM, a request is counted once, when it finishes, not again after a preemption."""
        usage = completion.usage
        self._by_source["local"].inc(usage.cached_tokens_local)
        self._by_source["remote"].inc(usage.cached_tokens_remote)
        self._by_source["computed"].inc(usage.computed_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.requests.labels(completion.finish_reason).inc()
        prompt, generation, queries, hits, external_queries, external_hits = self._vllm
        prompt.inc(usage.prompt_tokens)
        generation.inc(usage.completion_tokens)
        queries.inc(usage.prompt_tokens)
        hits.inc(usage.cached_tokens_local)
        external_queries.inc(usage.prompt_tokens - usage.cached_tokens_local)
        external_hits.inc(usage.cached_tokens_remote)
        self.vllm_success.labels(self._model, completion.finish_reason).inc()
        if usage.completion_tokens and usage.ttft_ms > 0:
            self.ttft.observe(usage.ttft_ms / 1000.0)
            self._vllm_ttft.observe(usage.ttft_ms / 1000.0)


class _EngineCollector(Collector):
    """Queues, the pool's use and the remote tier's counters, read at scrape time."""

    def __init__(self, engine: Engine, tier, model: str):
        self.engine, self.tier, self.model = engine, tier, model

    def collect(self):
        engine = self.engine
        running, waiting = engine.num_running(), engine.num_waiting()
        total = engine.pool.num_blocks
        usage = 1.0 - engine.get_num_free_blocks() / total if total else 0.0
        yield GaugeMetricFamily("kvcache_worker_requests_running", "Requests being computed or decoded", value=running)
        yield GaugeMetricFamily("kvcache_worker_requests_waiting", "Requests waiting to be scheduled", value=waiting)
        yield GaugeMetricFamily("kvcache_worker_kv_cache_usage_ratio", "Share of the local KV pool held by running "
                                "requests (cached idle blocks count as free)", value=usage)
        yield GaugeMetricFamily("kvcache_worker_kv_cache_blocks", "Blocks of the local KV pool", value=total)
        for name, value in (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting),
                            ("vllm:kv_cache_usage_perc", usage)):
            gauge = GaugeMetricFamily(name, f"vLLM's {name[5:]}", labels=["model_name"])
            gauge.add_metric([self.model], value)
            yield gauge
        if self.tier is None:
            return
        stats = self.tier.stats
        for name, value, what in (
            ("kvcache_worker_remote_lookups", stats.lookups, "Lookups of a request's pages on kvnodes"),
            ("kvcache_worker_remote_fetched_pages", stats.pages_fetched, "Pages fetched from kvnodes"),
            ("kvcache_worker_remote_fetched_bytes", stats.bytes_fetched, "Bytes fetched from kvnodes"),
            ("kvcache_worker_remote_in_place_pages", stats.pages_in_place, "Pages read where they lay in the "
                                                                             "shared pool of a kvnode on this host"),
            ("kvcache_worker_remote_written_pages", stats.pages_written, "Pages written back to kvnodes (stored or "
                                                                          "already there)"),
            ("kvcache_worker_remote_refused_pages", stats.pages_refused, "Pages kvnodes refused to store"),
            ("kvcache_worker_remote_dropped_pages", stats.pages_dropped, "Pages not written back (queue full, node "
                                                                           "down)"),
            ("kvcache_worker_remote_node_failures", stats.node_failures, "Calls to kvnodes that failed"),
            ("kvcache_worker_remote_fetches_not_found", stats.fetches_not_found,
             "Fetches a kvnode answered NOT_FOUND: pages gone since the lookup (computed instead)"),
            ("kvcache_worker_remote_rejected_pages", stats.pages_rejected, "Pages fetched from kvnodes whose bytes did "
                                                                             "not match their checksums (computed instead)"),
        ):
            yield CounterMetricFamily(name, what, value=value)
