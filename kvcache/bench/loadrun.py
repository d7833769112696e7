"""One pass of the load bench: N client threads work through the jobs while a sampler polls
each worker's load; each kvnode's counters are read before and after.

Bounds: a pass sends at most the workload's requests, and starts none after `duration_s`
(requests in flight then finish, each bounded by the client's deadline).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import grpc

from base.generation import Finished, Piece
from coordinator.client import Client, ClusterError
from kvcache.bench.gateway_client import GatewayClient
from kvcache.bench.report import Progress
from kvcache.bench.stats import RequestResult
from kvcache.bench.workload import Job, Request
from kvnode.client import NodeClient, NodeError
from worker.client import WorkerClient, WorkerError
from worker.model.tokenizer import Tokenizer

SAMPLE_INTERVAL_S = 0.25
NODE_COUNTERS = ("lookups", "hit_pages", "miss_pages", "get_pages", "puts", "stored_pages", "evictions",
                 "bytes_in", "bytes_out")


@dataclass(frozen=True)
class PassRun:
    coordinators: list[str]
    nodes: list[str]
    workers: list[str]
    concurrency: int
    no_cache: bool
    max_tokens: int
    duration_s: float
    tokenizer: Tokenizer          # the cluster's model's: sessions go as token ids (workload.Request.follows_reply)
    progress: bool = True
    gateway: str | None = None    # http://HOST:PORT: send through `kvcache gateway` (OpenAI API) instead of gRPC
    model: str = ""               # the model name the gateway's requests give

    @property
    def request_timeout_s(self) -> float:
        return self.duration_s + 120.0


def run_pass(run: PassRun, jobs: list[Job], label: str) -> tuple[list[RequestResult], float, dict, dict]:
    """(results, wall seconds, per-kvnode counter deltas, per-worker load) of one pass."""
    total = sum(len(job.requests) for job in jobs)
    queue = iter(jobs)
    queue_lock = threading.Lock()
    results: list[RequestResult] = []
    nodes_before = _node_counters(run.nodes)
    sampler = _WorkerSampler(run.workers)
    start = time.perf_counter()
    deadline = start + run.duration_s

    def client_loop(bar: Progress) -> None:
        if run.gateway:
            connect = GatewayClient(run.gateway, run.model, timeout=run.request_timeout_s)
        else:
            connect = Client(run.coordinators, timeout=run.request_timeout_s)
        with connect as client:
            while True:
                with queue_lock:
                    job = next(queue, None)
                if job is None:
                    return
                history: list[int] = []  # a session's last prompt and reply, as token ids
                for request in job.requests:
                    if time.perf_counter() >= deadline:
                        return
                    prompt = _prompt(request, history, run.tokenizer)
                    result, reply = _send(client, prompt, request, run, start)
                    if not isinstance(prompt, str):
                        history = prompt + reply
                    with queue_lock:
                        results.append(result)
                        bar.advance()
                    if not result.ok:
                        break  # the rest of a session would extend a turn that never happened

    with Progress(label, total, enabled=run.progress) as bar:
        sampler.start()
        threads = [threading.Thread(target=client_loop, args=(bar,), daemon=True) for _ in range(run.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(run.duration_s + run.request_timeout_s + 10.0)
        wall_s = time.perf_counter() - start
        sampler.stop()
    nodes_after = _node_counters(run.nodes)
    deltas = {address: {name: nodes_after[address][name] - nodes_before[address][name] for name in NODE_COUNTERS}
              for address in run.nodes if address in nodes_before and address in nodes_after}
    with queue_lock:
        return list(results), wall_s, deltas, sampler.summary()


def warm_up(coordinators: list[str], count: int, max_tokens: int, run_id: str) -> None:
    """Uncached requests on prompts no pass uses: warms the daemons' code paths, fills no cache."""
    if count < 1:
        return
    with Client(coordinators, timeout=300.0) as client:
        def one(i: int) -> None:
            prompt = f"warm-up {run_id} {i}: " + "a quick look at the service before measuring it. " * 4
            try:
                for _ in client.generate(prompt, max_tokens=max_tokens, no_cache=True, ignore_eos=True):
                    pass
            except ClusterError:
                pass  # a cluster that cannot serve shows in the passes' failed counts and errors

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300.0)


def paired_ttft(coordinators: list[str], gateway: str, model: str, prompt: str, pairs: int,
                max_tokens: int) -> dict:
    """What the HTTP hop adds, measured in pairs: one prompt (cached after the first, uncounted,
    request on each path) sent `pairs` times over gRPC and through the gateway back to back, the
    first path alternating; each request's TTFT is the time to its first token, the same on both
    paths. The median of the pairs' differences is robust to load that drifts during a run, which
    two passes run a minute apart are not."""
    grpc_ms, http_ms = [], []
    with Client(coordinators, timeout=120.0) as grpc_client, GatewayClient(gateway, model, timeout=120.0) as http:
        def ttft_ms(client) -> float:
            start, first = time.perf_counter(), None
            for event in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
                if isinstance(event, Piece) and first is None:
                    first = time.perf_counter() - start
            if first is None:
                raise ClusterError(grpc.StatusCode.UNKNOWN, "a paired request generated no token")
            return first * 1000

        ttft_ms(grpc_client), ttft_ms(http)   # the prompt's pages cached, both connections open
        for i in range(pairs):
            if i % 2:
                http_ms.append(ttft_ms(http))
                grpc_ms.append(ttft_ms(grpc_client))
            else:
                grpc_ms.append(ttft_ms(grpc_client))
                http_ms.append(ttft_ms(http))
    added = [h - g for g, h in zip(grpc_ms, http_ms)]
    return {"pairs": pairs, "grpc_ttft_p50_ms": statistics.median(grpc_ms), "http_ttft_p50_ms": statistics.median(http_ms),
            "added_ms_p50": statistics.median(added), "added_ms_all": [round(a, 3) for a in added]}


def _prompt(request: Request, history: list[int], tokenizer: Tokenizer) -> str | list[int]:
    """What to send: the text, or a session turn's token ids, which carry the model's replies."""
    if request.kind != "session":
        return request.prompt
    if request.follows_reply:
        return history + tokenizer.encode(request.prompt, add_special_tokens=False)
    return tokenizer.encode(request.prompt)


def _send(client: Client, prompt: str | list[int], request: Request, run: PassRun,
          pass_start: float) -> tuple[RequestResult, list[int]]:
    """The request's result, and the token ids it generated."""
    sent = time.perf_counter() - pass_start
    first = None
    finished: Finished | None = None
    error = ""
    reply: list[int] = []
    try:
        for event in client.generate(prompt, session_id=request.session_id, max_tokens=run.max_tokens,
                                     no_cache=run.no_cache, ignore_eos=True):
            if isinstance(event, Piece):
                reply.extend(event.token_ids)
                if first is None:
                    first = time.perf_counter() - pass_start
            elif isinstance(event, Finished):
                finished = event
    except ClusterError as exc:
        error = str(exc)
    end = time.perf_counter() - pass_start
    if finished is None and not error:
        error = "the stream ended without a final message"
    usage = finished.usage if finished else None
    return RequestResult(
        kind=request.kind, family=request.family, first_of_family=request.first_of_family, start_s=sent,
        first_token_s=first if first is not None else (end if usage else None), end_s=end,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        cached_tokens_local=usage.cached_tokens_local if usage else 0,
        cached_tokens_remote=usage.cached_tokens_remote if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        server_ttft_ms=usage.ttft_ms if usage else 0.0, error=error,
    ), reply


def _node_counters(nodes: list[str]) -> dict[str, dict[str, int]]:
    counters = {}
    for address in nodes:
        try:
            with NodeClient(address) as node:
                counters[address] = node.stats()
        except NodeError:
            pass  # a node that does not answer is left out of the per-node table
    return counters


class _WorkerSampler:
    """Polls each worker's Info (running and waiting requests) until stopped."""

    def __init__(self, workers: list[str]):
        self.workers = workers
        self.samples: dict[str, list[int]] = {w: [] for w in workers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def _loop(self) -> None:
        clients = {w: WorkerClient(w) for w in self.workers}
        try:
            while not self._stop.wait(SAMPLE_INTERVAL_S):
                for address, client in clients.items():
                    try:
                        info = client.info(timeout=1.0)
                    except WorkerError:
                        continue
                    self.samples[address].append(info.running + info.waiting)
        finally:
            for client in clients.values():
                client.close()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per worker: mean and peak requests in flight, and the share of samples with any."""
        out = {}
        for address, samples in self.samples.items():
            n = len(samples)
            out[address] = {"samples": n, "mean_in_flight": sum(samples) / n if n else 0.0,
                            "peak_in_flight": max(samples, default=0),
                            "busy_share": sum(1 for s in samples if s) / n if n else 0.0}
        return out
