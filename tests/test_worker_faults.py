"""A real worker process under faults and misuse (issue: no client or crash breaks the cluster
for others): duplicate ids, a request that breaks the model, an engine that stalls, more
streams than it serves, and a drain that runs out of time. Faults are injected by
tests/fault_injection/sitecustomize.py, loaded through PYTHONPATH by the worker alone."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster_helpers import collect, started, wait_for
from base.generation import Finished, Piece
from coordinator.client import Client
from kvcache.launch import Daemon
from worker.client import WorkerClient, WorkerError
from worker.engine.engine import Engine
from worker.service import WorkerService

FAULTS = Path(__file__).parent / "fault_injection"
POISON, STALL = 7, 8  # control characters: no prompt of these tests holds them by chance
PROMPT = "The baker opens at seven and closes at noon. "


@pytest.fixture(scope="module")
def engine():
    return Engine.load("tiny")


def faulty_env(**faults) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({f"KVCACHE_TEST_{name.upper()}_TOKEN": str(token) for name, token in faults.items()})
    return env


def worker_args(*extra: str) -> list[str]:
    return ["--model", "tiny", "--kv-cache", "8MiB", *extra]


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0).status


def tokens_of(engine, prompt, **options) -> list[int]:
    return engine.generate(list(prompt) if not isinstance(prompt, str) else prompt, **options)[0].token_ids


def test_concurrent_duplicate_ids_are_refused_and_the_worker_serves_on(tmp_path, engine):
    expected = tokens_of(engine, PROMPT, max_new_tokens=24, ignore_eos=True)
    outcomes: list[str] = []
    with started(tmp_path, "worker", "worker", *worker_args()) as w, WorkerClient(w.address, timeout=30) as client:

        def call():
            try:
                tokens, done = collect(client.generate(PROMPT, max_tokens=24, ignore_eos=True, request_id="same"))
                outcomes.append("ok" if tokens == expected and done.finish_reason == "length" else "wrong")
            except WorkerError as exc:
                outcomes.append(exc.code.name)

        for _ in range(5):
            threads = [threading.Thread(target=call) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30.0)
        assert len(outcomes) == 30 and set(outcomes) <= {"ok", "ALREADY_EXISTS"}
        assert "ALREADY_EXISTS" in outcomes and outcomes.count("ok") >= 5
        assert collect(client.generate(PROMPT, max_tokens=24, ignore_eos=True, request_id="same"))[0] == expected
        info = client.info()
        assert (info.running, info.waiting) == (0, 0)
        assert health(w.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_request_that_breaks_the_model_fails_alone_with_internal(tmp_path, engine):
    others = [PROMPT, PROMPT + "Is there rye today?", "Bread!"]
    results: dict[str, object] = {}
    with started(tmp_path, "worker", "worker", *worker_args(), env=faulty_env(poison=POISON)) as w, \
            WorkerClient(w.address, timeout=30) as client:

        def call(name, prompt):
            try:
                results[name] = collect(client.generate(prompt, max_tokens=20, ignore_eos=True))[0]
            except WorkerError as exc:
                results[name] = exc

        poisoned = list(PROMPT.encode()) + [POISON] + list(b" and then?")
        threads = [threading.Thread(target=call, args=(str(i), p)) for i, p in enumerate(others)]
        threads.append(threading.Thread(target=call, args=("poisoned", poisoned)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        error = results.pop("poisoned")
        assert isinstance(error, WorkerError) and error.code == grpc.StatusCode.INTERNAL
        assert "injected fault" in error.details
        for i, prompt in enumerate(others):
            assert results[str(i)] == tokens_of(engine, prompt, max_new_tokens=20, ignore_eos=True)
        assert health(w.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_stalled_engine_turns_not_serving_and_ends_its_calls_unavailable(tmp_path):
    with started(tmp_path, "worker", "worker", *worker_args("--step-timeout", "2"), env=faulty_env(stall=STALL)) as w, \
            WorkerClient(w.address, timeout=30) as client:
        started_at = time.monotonic()
        with pytest.raises(WorkerError) as stalled:
            collect(client.generate([STALL, 97, 98], max_tokens=5))
        assert stalled.value.code == grpc.StatusCode.UNAVAILABLE and "cannot serve" in stalled.value.details
        assert time.monotonic() - started_at < 20
        assert health(w.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(WorkerError) as later:
            collect(client.generate(PROMPT, max_tokens=5))
        assert later.value.code == grpc.StatusCode.UNAVAILABLE
        w.kill()  # its step never ends; how a SIGTERM stops a stalled worker is the coordinator test's
    assert "worker cannot serve: an engine step has run for over 2s" in (tmp_path / "worker.log").read_text()


def test_stopping_says_whether_the_engine_loop_left_its_step():
    """The daemon closes the remote tier (unmapping node pools a step may read) only if it did."""
    class StuckEngine:
        def __init__(self):
            self.inside, self.release = threading.Event(), threading.Event()

        def wait_for_work(self, timeout=None):
            return True

        def step(self):
            self.inside.set()
            self.release.wait(30.0)  # bounded; released below

    stuck = StuckEngine()
    service = WorkerService(stuck)
    service.start()
    try:
        assert stuck.inside.wait(5.0)
        assert service.stop(timeout_s=0.2) is False
    finally:
        stuck.release.set()
    assert service.stop(timeout_s=5.0) is True


def test_through_a_coordinator_requests_on_a_stalled_worker_finish_elsewhere(tmp_path, engine):
    prompts = [[STALL] + list(f"question {i}: when do you open?".encode()) for i in range(6)]
    with started(tmp_path, "coordinator", "coordinator") as c:
        join = ["--coordinators", c.address]
        with started(tmp_path, "worker", "stalling", *worker_args("--step-timeout", "2", *join),
                     env=faulty_env(stall=STALL)) as bad, \
                started(tmp_path, "worker", "good", *worker_args(*join)), Client([c.address]) as client:
            assert wait_for(lambda: sum(m.alive for m in client.status().members) == 2, timeout_s=15.0)
            results: list = [None] * len(prompts)

            def ask(i):
                results[i] = collect(client.generate(prompts[i], max_tokens=8, ignore_eos=True))[0]

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60.0)
            for prompt, tokens in zip(prompts, results):
                assert tokens == tokens_of(engine, prompt, max_new_tokens=8, ignore_eos=True)
            assert wait_for(lambda: not any(m.alive for m in client.status().members if m.address == bad.address),
                            timeout_s=10.0)
        log = (tmp_path / "stalling.log").read_text()
        assert "cannot serve" in log
        # Stopped (SIGTERM) with its step still stalled: it waits --step-timeout for it, not 10 s, then exits.
        assert "still inside a step after 2s; exiting without closing the remote tier" in log
        assert log.rstrip().endswith("stopped")


def test_streams_past_the_limit_are_refused_at_once_and_health_still_answers(tmp_path):
    with started(tmp_path, "worker", "worker", *worker_args("--max-streams", "2")) as w, \
            WorkerClient(w.address, timeout=30) as client:
        streams = [client.generate(PROMPT, max_tokens=2000, ignore_eos=True) for _ in range(2)]
        for stream in streams:
            assert isinstance(next(stream), Piece)
        with pytest.raises(WorkerError) as refused:
            collect(client.generate("one more", max_tokens=4))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 2 streams" in refused.value.details
        assert health(w.address) == health_pb2.HealthCheckResponse.SERVING
        assert client.info().running == 2
        for stream in streams:
            stream.close()
        assert wait_for(lambda: client.info().running == 0, timeout_s=10.0)
        assert collect(client.generate("now there is room", max_tokens=4))[1].finish_reason in ("length", "stop")


def test_a_drain_out_of_time_hands_requests_back_and_a_coordinator_resumes_them(tmp_path, engine):
    prompt = PROMPT + "Tell me everything about sourdough."
    expected = tokens_of(engine, prompt, max_new_tokens=900, ignore_eos=True)
    with started(tmp_path, "coordinator", "coordinator") as c:
        join = ["--coordinators", c.address]
        with started(tmp_path, "worker", "one", *worker_args("--drain-timeout", "0", *join)) as one, \
                started(tmp_path, "worker", "two", *worker_args("--drain-timeout", "0", *join)) as two, \
                Client([c.address]) as client:
            assert wait_for(lambda: sum(m.alive for m in client.status().members) == 2, timeout_s=15.0)
            tokens, finished, stopped = [], None, None
            for event in client.generate(prompt, max_tokens=900, ignore_eos=True):
                if isinstance(event, Piece):
                    tokens.extend(event.token_ids)
                    if stopped is None and len(tokens) >= 5:
                        stopped = next(d for d in (one, two) if client_busy(d))
                        os.kill(stopped.pid, signal.SIGTERM)
                else:
                    finished = event
            assert stopped is not None and stopped.process.wait(timeout=20) == 0
    assert tokens == expected
    assert finished.finish_reason == "length" and finished.usage.completion_tokens == 900
    log = (tmp_path / ("one.log" if stopped is one else "two.log")).read_text()
    assert "handed 1 requests back" in log and f"deregistered from coordinator {c.address}" in log
    assert f"worker {stopped.address} left (deregistered" in (tmp_path / "coordinator.log").read_text()


def client_busy(daemon: Daemon) -> bool:
    with WorkerClient(daemon.address) as client:
        return client.info().running > 0
