"""The chaos bench's requests and the clients that send them.

A fixed set of prompts in families that share a long prefix (so pages get written back, cached
and fetched), each sent twice: greedy, and sampled (temperature 0.8) with a seed. Both kinds
must come out of a disturbed cluster token for token as out of an undisturbed one.

A client that is refused with RESOURCE_EXHAUSTED (a busy cluster saying so) sends the request
again after a bounded backoff; every other error fails the request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from base.generation import Finished, Piece
from coordinator.client import Client, ClusterError
from kvcache.bench import workload as wl

SEEDED_TEMPERATURE = 0.8
RETRY_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.6)  # one refusal more than this fails the request


@dataclass(frozen=True)
class ChaosRequest:
    label: str           # "system-1/3 greedy": family, prompt number, kind
    kind: str            # "greedy" or "seeded"
    prompt: str
    seed: int | None


@dataclass
class Outcome:
    request: ChaosRequest
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    refusals: int = 0    # RESOURCE_EXHAUSTED answers, each followed by a retry (or the failure)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def build_requests(prompts: int, seed: int, tag: str) -> list[ChaosRequest]:
    """`prompts` prompts (shared system prompts with questions, a few one-offs), each greedy and seeded."""
    config = wl.WorkloadConfig(requests=prompts, seed=seed, mix=(0.8, 0.0, 0.2), system_prompts=3,
                               system_chars=200, question_chars=(24, 64), unique_chars=(64, 160))
    requests = []
    for i, request in enumerate(wl.all_requests(wl.build_workload(config, tag))):
        requests.append(ChaosRequest(f"{request.family}/{i} greedy", "greedy", request.prompt, None))
        requests.append(ChaosRequest(f"{request.family}/{i} seeded", "seeded", request.prompt, 1000 + i))
    return requests


def send(client: Client, request: ChaosRequest, max_tokens: int, stopping: threading.Event) -> Outcome:
    """One request to its end, retried after each RESOURCE_EXHAUSTED refusal (bounded)."""
    outcome = Outcome(request)
    options = {"max_tokens": max_tokens, "ignore_eos": True}
    if request.kind == "seeded":
        options.update(temperature=SEEDED_TEMPERATURE, seed=request.seed)
    while True:
        outcome.tokens, finished = [], None
        try:
            for event in client.generate(request.prompt, **options):
                if isinstance(event, Piece):
                    outcome.tokens.extend(event.token_ids)
                elif isinstance(event, Finished):
                    finished = event
        except ClusterError as exc:
            refused = exc.code.name == "RESOURCE_EXHAUSTED"
            if refused and outcome.refusals < len(RETRY_BACKOFF_S) and not stopping.is_set():
                stopping.wait(RETRY_BACKOFF_S[outcome.refusals])
                outcome.refusals += 1
                continue
            outcome.refusals += refused
            outcome.error = str(exc) + (f" (after {outcome.refusals} refusals)" if refused else "")
            return outcome
        if finished is None:
            outcome.error = f"the stream ended without a final message after {len(outcome.tokens)} tokens"
        elif finished.finish_reason == "abort":
            outcome.error = f"finished with 'abort' after {len(outcome.tokens)} tokens, no error status"
        else:
            outcome.finish_reason = finished.finish_reason
        return outcome


def run_clients(coordinators: list[str], requests: list[ChaosRequest], concurrency: int, max_tokens: int,
                timeout_s: float, until: float | None, stopping: threading.Event) -> list[Outcome]:
    """Send the requests from `concurrency` clients: each once (until=None), or round and round until
    time.monotonic() passes `until`; requests in flight then finish, each bounded by timeout_s."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    next_index = iter(range(len(requests) if until is None else 10**9))

    def loop() -> None:
        with Client(coordinators, timeout=timeout_s) as client:
            while not stopping.is_set() and (until is None or time.monotonic() < until):
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                outcome = send(client, requests[i % len(requests)], max_tokens, stopping)
                with lock:
                    outcomes.append(outcome)

    threads = [threading.Thread(target=loop, name=f"chaos-client-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    budget = (until - time.monotonic() if until else 0.0) + timeout_s * (len(RETRY_BACKOFF_S) + 1) + 10.0
    deadline = time.monotonic() + budget
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"chaos clients still running {budget:.0f}s after the load ended")
        return list(outcomes)


def first_difference(got: list[int], expected: list[int]) -> int | None:
    """The first position where two answers differ (a length difference counts), None when equal."""
    for position, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return position
    return None if len(got) == len(expected) else min(len(got), len(expected))
