"""Statistics of a load-bench pass: percentiles, rates, and where prompt tokens came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times in seconds from the start of its pass."""

    kind: str
    family: str
    first_of_family: bool
    start_s: float
    first_token_s: float | None  # None: no token arrived (failed request)
    end_s: float
    prompt_tokens: int = 0
    cached_tokens_local: int = 0
    cached_tokens_remote: int = 0
    completion_tokens: int = 0
    server_ttft_ms: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_s - self.start_s) * 1000.0

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., ...} by linear interpolation between order statistics (NumPy's default); NaN when empty."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(data, q)) for q in qs}


def cache_shares(results: Sequence[RequestResult]) -> dict[str, float | int]:
    """Share of prompt tokens served from the worker's local cache, from kvnodes, and both."""
    prompt = sum(r.prompt_tokens for r in results)
    local = sum(r.cached_tokens_local for r in results)
    remote = sum(r.cached_tokens_remote for r in results)
    share = (lambda n: n / prompt) if prompt else (lambda n: 0.0)
    return {"requests": len(results), "prompt_tokens": prompt, "local": share(local), "remote": share(remote),
            "total": share(local + remote)}


def summarize_pass(results: Sequence[RequestResult], wall_s: float) -> dict:
    """Every figure of one pass; failed requests are counted, never averaged in."""
    done = [r for r in results if r.ok]
    generated = sum(r.completion_tokens for r in done)
    per_kind = {kind: cache_shares([r for r in done if r.kind == kind]) for kind in sorted({r.kind for r in done})}
    return {
        "requests": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft_ms for r in done if r.first_token_s is not None]),
        "server_ttft_ms": percentiles([r.server_ttft_ms for r in done]),
        "latency_ms": percentiles([r.latency_ms for r in done], (50, 99)),
        "cache": cache_shares(done),
        # Once warm: without each family's first request (so without every one-off prompt).
        "cache_once_warm": cache_shares([r for r in done if not r.first_of_family]),
        "cache_by_kind": per_kind,
    }


def gain(with_cache: float, without: float, lower_is_better: bool) -> float:
    """How many times better the cache pass is (> 1 is better); NaN when undefined."""
    a, b = (without, with_cache) if lower_is_better else (with_cache, without)
    if not (np.isfinite(a) and np.isfinite(b)) or b <= 0:
        return float("nan")
    return a / b


def gain_interval(with_cache: Sequence[float], without: Sequence[float], q: int = 50, level: float = 0.9,
                  rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the p`q` gain (lower is better, as TTFT): both passes' requests redrawn
    with replacement `rounds` times; the range holding `level` of the resulting gains. It shows how
    much a gain owes to which few requests ran (a p50 of 40 requests sits where warm ones give
    way to cold ones, so it moves a lot between runs). (NaN, NaN) when either pass is empty."""
    a, b = np.asarray(with_cache, dtype=np.float64), np.asarray(without, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    cached = np.percentile(a[rng.integers(0, a.size, (rounds, a.size))], q, axis=1)
    baseline = np.percentile(b[rng.integers(0, b.size, (rounds, b.size))], q, axis=1)
    gains = baseline / np.maximum(cached, np.finfo(np.float64).tiny)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(gains, [tail, 100 - tail])
    return float(low), float(high)
