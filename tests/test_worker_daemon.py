"""Workers and kvnodes as real processes: pages written back by one worker are served to
another, a dead kvnode costs hits and never a request, replicas, page-size mismatch,
cancellation and graceful drain."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from cluster_helpers import collect, wait_for
from base.generation import Finished, Piece
from kvcache.launch import Daemon
from kvnode.client import NodeClient
from worker.client import WorkerClient, WorkerError

PAGE_TOKENS = 16
SYSTEM = "You are a careful assistant. Answer briefly and precisely, citing the page you used. "


@contextlib.contextmanager
def daemons(tmp_path, *specs):
    """Start (role, name, args) daemons, all at once (none needs another's address); stop each by
    its pid at the end, whatever happened."""
    started = []
    try:
        for role, name, args in specs:
            started.append(Daemon(role, ["--port", "0", *args], log_path=tmp_path / f"{name}.log", wait=False))
        for daemon in started:
            daemon.started()
        yield started
    finally:
        for daemon in started:
            daemon.stop(timeout_s=10.0)


def node(name, *extra):
    return ("node", name, ["--model", "tiny", "--capacity", "16MiB", *extra])


def worker(name, *extra):
    return ("worker", name, ["--model", "tiny", "--kv-cache", "8MiB", "--grace", "5", *extra])


def run(client: WorkerClient, prompt: str, **options) -> tuple[list[int], Finished]:
    return collect(client.generate(prompt, **options))


def used_pages(address: str) -> int:
    with NodeClient(address) as client:
        return client.info().used_pages


def test_second_worker_gets_first_workers_pages_from_the_kvnode(tmp_path):
    with daemons(tmp_path, node("node"), worker("worker-a"), worker("worker-b")) as (kv, a, b):
        first_prompt = SYSTEM + "Question one?"
        pages = len(first_prompt.encode()) // PAGE_TOKENS  # the tiny model's tokens are bytes
        assert pages == 6
        with WorkerClient(a.address) as client_a, WorkerClient(b.address) as client_b:
            _, done = run(client_a, first_prompt, max_tokens=4, placement=[kv.address])
            assert done.usage.cached_tokens_remote == 0 and done.usage.prompt_tokens == len(first_prompt.encode())
            assert wait_for(lambda: used_pages(kv.address) >= pages, timeout_s=10.0)

            longer = first_prompt + " And a follow-up that is longer than the first question."
            warm_tokens, warm = run(client_b, longer, max_tokens=8, placement=[kv.address])
            cold_tokens, cold = run(client_b, longer, max_tokens=8, no_cache=True)
        assert warm.usage.cached_tokens_remote == pages * PAGE_TOKENS
        assert warm.usage.cached_tokens_local == 0
        assert warm.usage.computed_tokens == warm.usage.prompt_tokens - pages * PAGE_TOKENS
        assert cold.usage.cached_tokens_remote == cold.usage.cached_tokens_local == 0
        assert warm_tokens == cold_tokens and len(warm_tokens) == 8


def test_local_pages_are_written_to_a_new_placement_that_lacks_them(tmp_path):
    """Worker A holds a prefix locally (placed on node X); a request placed on node Y must leave
    the whole chain on Y, or Y refuses every later page for want of its parent."""
    with daemons(tmp_path, node("node-x"), node("node-y"), worker("worker-a"), worker("worker-b")) as (x, y, a, b):
        prompt = SYSTEM + "First question?"
        longer = prompt + " And the follow-up, placed elsewhere by its session."
        with WorkerClient(a.address) as client_a, WorkerClient(b.address) as client_b:
            run(client_a, prompt, max_tokens=2, placement=[x.address])
            _, local = run(client_a, longer, max_tokens=2, placement=[y.address])
            assert local.usage.cached_tokens_local >= (len(prompt.encode()) // PAGE_TOKENS) * PAGE_TOKENS
            full_pages = len(longer.encode()) // PAGE_TOKENS
            assert wait_for(lambda: used_pages(y.address) >= full_pages, timeout_s=10.0)
            tokens, remote = run(client_b, longer, max_tokens=4, placement=[y.address])
            cold, _ = run(client_b, longer, max_tokens=4, no_cache=True)
        assert remote.usage.cached_tokens_remote == full_pages * PAGE_TOKENS
        assert tokens == cold


def test_kvnode_killed_mid_run_fails_no_request(tmp_path):
    with daemons(tmp_path, node("node"), worker("worker")) as (kv, w):
        prompts = [SYSTEM + f"Question number {i}: what comes next?" for i in range(8)]
        with WorkerClient(w.address) as client:
            expected = [run(client, p, max_tokens=6, no_cache=True)[0] for p in prompts]
            results, errors = [None] * len(prompts), []

            def send(i):
                try:
                    results[i] = run(client, prompts[i], max_tokens=6, placement=[kv.address])[0]
                except Exception as exc:  # the assertion below reports it
                    errors.append(exc)

            threads = []
            for i in range(len(prompts)):
                threads.append(threading.Thread(target=send, args=(i,)))
                threads[-1].start()
                if i == 3:
                    kv.kill()
                time.sleep(0.05)
            for thread in threads:
                thread.join(timeout=120)
        assert not errors
        assert results == expected


def test_replica_serves_when_the_primary_is_dead(tmp_path):
    with daemons(tmp_path, node("primary"), node("replica"), worker("worker-a"), worker("worker-b")) as (p, r, a, b):
        prompt = SYSTEM + "Which replica answers?"
        pages = len(prompt.encode()) // PAGE_TOKENS
        placement = [p.address, r.address]
        with WorkerClient(a.address) as client_a, WorkerClient(b.address) as client_b:
            run(client_a, prompt, max_tokens=2, placement=placement)
            assert wait_for(lambda: used_pages(p.address) >= pages and used_pages(r.address) >= pages, timeout_s=10.0)
            p.kill()
            tokens, done = run(client_b, prompt + " Tell me.", max_tokens=4, placement=placement)
            cold, _ = run(client_b, prompt + " Tell me.", max_tokens=4, no_cache=True)
        assert done.usage.cached_tokens_remote == pages * PAGE_TOKENS
        assert tokens == cold


def test_node_with_another_page_size_is_refused_and_counts_as_a_miss(tmp_path):
    with daemons(tmp_path, node("node", "--kv-dtype", "float16"), worker("worker")) as (kv, w):
        with WorkerClient(w.address) as client:
            for _ in range(2):
                _, done = run(client, SYSTEM + "mismatch", max_tokens=2, placement=[kv.address])
                assert done.usage.cached_tokens_remote == 0
        assert used_pages(kv.address) == 0
        log = (tmp_path / "worker.log").read_text()
        assert log.count("refusing kvnode") == 1
        assert "(float16 KV of this model)" in log and "--kv-dtype float32)" in log   # one line names both
        assert "Traceback" not in log


def test_cancelled_request_frees_its_blocks(tmp_path):
    with daemons(tmp_path, worker("worker")) as (w,):
        with WorkerClient(w.address) as client:
            total = client.info().total_blocks
            events = client.generate(SYSTEM * 4, max_tokens=2000, ignore_eos=True)
            for _, event in zip(range(3), events):
                assert isinstance(event, Piece)
            assert client.info().running == 1
            events.close()  # cancels the call
            assert wait_for(lambda: client.info().running == 0, timeout_s=10.0)
            info = client.info()
            # Only the prompt's full pages may stay, as the local prefix cache (free to evict).
            assert info.free_blocks >= total - (len(SYSTEM * 4) // PAGE_TOKENS) - 1


def test_sigterm_drains_running_requests_then_exits(tmp_path):
    with daemons(tmp_path, worker("worker")) as (w,):
        with WorkerClient(w.address) as client:
            events = client.generate(SYSTEM, max_tokens=150, ignore_eos=True)
            first = next(events)
            assert isinstance(first, Piece)
            w.process.send_signal(signal.SIGTERM)
            rest = list(events)
        assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "length"
        assert rest[-1].usage.completion_tokens == 150
        assert w.process.wait(timeout=20) == 0
        with pytest.raises(WorkerError) as refused:
            with WorkerClient(w.address, timeout=5) as late:
                list(late.generate("too late", max_tokens=2))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_sigterm_with_a_kvnode_in_use_ends_every_worker_thread(tmp_path):
    """Lookups, loads, write-backs and probes ran against a kvnode: SIGTERM mid-request still
    exits 0 within a bounded wait, and the worker's last lines say no thread of its own is left."""
    with daemons(tmp_path, node("node"), worker("worker-a"), worker("worker-b")) as (kv, a, b):
        with WorkerClient(a.address) as client_a, WorkerClient(b.address) as client_b:
            run(client_a, SYSTEM + "Question one?", max_tokens=4, placement=[kv.address])
            assert wait_for(lambda: used_pages(kv.address) >= 6, timeout_s=10.0)
            _, warm = run(client_b, SYSTEM + "Question two?", max_tokens=4, placement=[kv.address])
            assert warm.usage.cached_tokens_remote > 0  # b's connector looked up and loaded pages
            events = client_b.generate(SYSTEM + "Question three?", max_tokens=60, ignore_eos=True,
                                       placement=[kv.address])
            assert isinstance(next(events), Piece)
            b.process.send_signal(signal.SIGTERM)
            rest = list(events)
        assert isinstance(rest[-1], Finished)
        assert b.process.wait(timeout=30) == 0
        log = (tmp_path / "worker-b.log").read_text()
        assert "worker INFO stopped" in log, log[-2000:]
        assert "threads still running at exit" not in log, log[-2000:]


@pytest.fixture(scope="module")
def shared_worker(tmp_path_factory):
    with daemons(tmp_path_factory.mktemp("shared"), worker("worker")) as (w,):
        yield w


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 5, "top_p": 1.5}, "top_p"),
        ({"max_tokens": 5, "placement": ["not an address"]}, "placement"),
        ({"max_tokens": 5, "placement": ["127.0.0.1:99999"]}, "placement"),
    ],
)
def test_bad_requests_get_invalid_argument_and_the_worker_goes_on(shared_worker, options, message):
    with WorkerClient(shared_worker.address) as client:
        with pytest.raises(WorkerError) as error:
            list(client.generate("hello", **options))
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details
        tokens, _ = run(client, "still serving", max_tokens=2)
        assert len(tokens) == 2


def test_empty_prompt_and_too_long_prompt_are_refused(shared_worker):
    with WorkerClient(shared_worker.address) as client:
        with pytest.raises(WorkerError) as empty:
            list(client.generate("", max_tokens=2))
        assert empty.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(WorkerError) as too_long:
            list(client.generate("x" * 5000, max_tokens=2))
        assert too_long.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "5000 tokens" in too_long.value.details


def test_a_chat_longer_than_the_worker_reads_and_ids_beyond_the_vocabulary_are_refused(shared_worker):
    """A chat is bounded in characters as a text prompt is, before it is rendered or tokenized."""
    with WorkerClient(shared_worker.address) as client:
        with pytest.raises(WorkerError) as long_chat:
            list(client.generate([{"role": "user", "content": "x" * 1_000_000}], max_tokens=2))
        assert long_chat.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "1000004 characters; this worker reads at most" in long_chat.value.details
        with pytest.raises(WorkerError) as beyond:
            list(client.generate([5, 2**32 - 1], max_tokens=2))
        assert beyond.value.code == grpc.StatusCode.INVALID_ARGUMENT and "token ids must be in" in beyond.value.details
        tokens, _ = run(client, "still serving", max_tokens=2)
        assert len(tokens) == 2


def test_info_describes_the_worker(shared_worker):
    with WorkerClient(shared_worker.address) as client:
        info = client.info()
    assert info.model == "tiny" and info.kv_dtype == "float32" and info.page_tokens == PAGE_TOKENS
    assert info.page_bytes == 131072 and len(info.fingerprint) == 32
    assert 0 < info.free_blocks <= info.total_blocks


@pytest.mark.parametrize("option", ["--max-prefill-tokens", "--alone-prefill-tokens"])
def test_a_prefill_chunk_below_one_token_is_refused_with_one_line(option):
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "worker", "--port", "0", option, "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"kvcache worker: error: {option} must be at least 1, got 0"]


def test_step_log_has_a_json_line_per_engine_step_and_prompts_come_in_chunks(tmp_path):
    steps = tmp_path / "steps.jsonl"
    with daemons(tmp_path, worker("w", "--step-log", str(steps), "--max-prefill-tokens", "8",
                                  "--alone-prefill-tokens", "16")) as (w,):
        with WorkerClient(w.address) as client:
            _, done = run(client, "Where does the time go? " * 3, max_tokens=4, request_id="traced")
    records = [json.loads(line) for line in steps.read_text().splitlines()]
    ours = [q for r in records for q in r["requests"] if q["id"] == "traced"]
    # Every prompt token and every generated one but the last went through a step exactly once.
    assert sum(q["new"] for q in ours) == done.usage.prompt_tokens + done.usage.completion_tokens - 1
    prefill = [q["new"] for q in ours if q["computed"] < q["prompt"]]
    assert done.usage.prompt_tokens == 72 and prefill == [16, 16, 16, 16, 8]  # alone: --alone-prefill-tokens 16
    assert "logging every engine step to" in (tmp_path / "w.log").read_text()


def test_a_step_log_that_cannot_be_opened_is_one_error_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "worker", "--port", "0",
                           "--step-log", str(tmp_path / "no-such-dir" / "steps.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("kvcache worker: error: --step-log ") and "No such file" in done.stderr
    assert "Traceback" not in done.stderr
