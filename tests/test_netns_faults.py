"""One seeded load through every fault, past one machine: two coordinators, three kvnodes
(--replicas 2), two workers and a client, each on a host (network namespace) of its own
(tests/netns_helpers.py). While the load runs, a kvnode is partitioned and healed, then a worker,
then the coordinator the client uses: no request fails, every answer equals the undisturbed
run's, and once everything healed the prompts' cached prefixes are found again.

The workers' local caches are kept small (--kv-cache) so that a pass over the prompts finds its
prefixes on the kvnodes rather than in the worker: cached tokens after healing show the remote
tier came back, not only the local one."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from netns_helpers import Hosts, members, started, starter, wait_until, why_no_namespaces
from netns_programs import CLIENT, LOAD

_NO_NAMESPACES = why_no_namespaces()
pytestmark = pytest.mark.skipif(_NO_NAMESPACES is not None, reason=f"multi-host tests: {_NO_NAMESPACES}")

STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a book "
         "that nobody else ever read, until a storm brought a visitor to the door. ")
# Each prompt begins differently (its own placement key, so the prompts spread over the kvnodes
# and workers) and is about 190 tokens of the tiny model's bytes: 11 full pages of 16.
# 64 tokens each (a tenth of a second or more), so a partition often catches a request mid-stream.
REQUESTS = [{"prompt": f"Conversation {i:02d}. {STORY}", "temperature": 0.8, "seed": 100 + i, "max_tokens": 64,
             "ignore_eos": True} for i in range(12)]
HOSTS = ["coordinator-1", "coordinator-2", "node-a", "node-b", "node-c", "worker-a", "worker-b", "client"]
MAX_LOAD_REQUESTS = 600  # the load under faults stops long before: bounded all the same
MAX_LOAD_SECONDS = 240.0


def read_answers(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is left out


def cached_share(answers: list[dict]) -> float:
    usages = [a["usage"] for a in answers]
    cached = sum(u["cached_tokens_local"] + u["cached_tokens_remote"] for u in usages)
    return cached / sum(u["prompt_tokens"] for u in usages)


def test_a_seeded_load_through_a_kvnode_a_worker_and_a_coordinator_partitioned_and_healed(tmp_path):
    with Hosts(HOSTS) as hosts, contextlib.ExitStack() as running:
        start = starter(hosts, running, tmp_path)  # each daemon stopped by its pid, also when the test fails

        coordinators = [d.address for d in started(*(start(c, "coordinator", "--port", "50050", "--replicas", "2",
                                                           wait=False) for c in ("coordinator-1", "coordinator-2")))]
        joined = ",".join(coordinators)  # members beat to both; the client tries coordinator-1 first
        node_hosts = {start(h, "node", "--port", "50051", "--capacity", "32MiB", "--coordinators", joined,
                            wait=False): h for h in ("node-a", "node-b", "node-c")}
        # 6 MiB: 48 of the tiny model's float32 pages, fewer than one pass over the prompts needs.
        worker_hosts = {start(h, "worker", "--port", "50061", "--model", "tiny", "--kv-cache", "6MiB",
                              "--blas-threads", "1", "--coordinators", joined, wait=False): h
                        for h in ("worker-a", "worker-b")}
        started(*node_hosts, *worker_hosts)
        nodes = {d.address: h for d, h in node_hosts.items()}
        workers = {d.address: h for d, h in worker_hosts.items()}
        everyone = set(nodes) | set(workers)

        def all_alive(coordinator: str) -> bool:
            seen = members(hosts, coordinator)
            return all(seen.get(address) is True for address in everyone)

        assert all(wait_until(lambda c=c: all_alive(c), 30.0) for c in coordinators), "members did not join"

        def load(name: str, max_requests: int, pause_s: float, max_seconds: float):
            """The LOAD client on its host, writing its answers to tmp_path/NAME.jsonl; stopped by
            closing its stdin (or killed by its pid when the test ends)."""
            output = tmp_path / f"{name}.jsonl"
            with output.open("w") as out, (tmp_path / f"{name}.err").open("w") as err:  # the child keeps its own
                process = hosts.start_python("client", LOAD, joined, json.dumps(REQUESTS), "2", str(pause_s),
                                             str(max_requests), str(max_seconds), stdin=subprocess.PIPE,
                                             stdout=out, stderr=err)
            running.callback(lambda: process.poll() is None and process.kill())
            return process, output

        def one_pass(name: str) -> list[dict]:
            """Every request once, two at a time; the answers by their request's index."""
            process, output = load(name, len(REQUESTS), 0.0, 120.0)
            process.wait(timeout=150.0)  # it ends after one pass, its stdin left open
            process.stdin.close()
            answers = sorted(read_answers(output), key=lambda a: a["index"])
            assert [a.get("error") for a in answers] == [None] * len(REQUESTS), answers
            return answers

        cold = one_pass("cold")
        expected = {a["index"]: a["tokens"] for a in cold}
        warm = one_pass("warm")  # undisturbed, the prefixes cached: the hits to recover
        assert {a["index"]: a["tokens"] for a in warm} == expected
        warm_share = cached_share(warm)
        assert sum(a["usage"]["cached_tokens_remote"] for a in warm) > 0, "the warm pass found nothing on the kvnodes"

        # The load under faults, run until every fault was made and healed.
        process, output = load("faults", MAX_LOAD_REQUESTS, 0.2, MAX_LOAD_SECONDS)
        windows: dict[str, tuple[float, float]] = {}

        def answered_since(moment: float, count: int, timeout_s: float) -> bool:
            return wait_until(lambda: sum(a["ended"] > moment for a in read_answers(output)) >= count, timeout_s)

        def busy_worker(coordinator: str) -> str:
            """A worker `coordinator` has a request on (the load's), "" if none within 60 s."""
            return hosts.run_python("client", CLIENT, "busy", coordinator, timeout_s=90.0).stdout.strip()

        def fault(name: str, host: str, address: str) -> None:
            """Partition `host` under load, see the coordinators mark it dead (a member) while answers
            go on (a coordinator: through the other one), heal it, see it alive again everywhere."""
            began = time.time()
            hosts.partition(host)
            if address not in coordinators:
                assert all(wait_until(lambda c=c: members(hosts, c).get(address) is False, 30.0)
                           for c in coordinators), f"{name}: {address} was not marked dead"
            assert answered_since(began, 4, 60.0), f"{name}: no answers while {host} was partitioned"
            hosts.heal(host)
            if address in coordinators:
                assert wait_until(lambda: all_alive(address), 30.0), f"{name}: the members did not return to it"
            else:
                assert all(wait_until(lambda c=c: members(hosts, c).get(address) is True, 30.0)
                           for c in coordinators), f"{name}: {address} did not rejoin"
            windows[name] = (began, time.time())

        assert answered_since(0.0, 4, 60.0), "the load did not start"
        node = next(iter(nodes))
        fault("kvnode", nodes[node], node)
        worker = busy_worker(coordinators[0])
        assert worker in workers, "no worker was seen running a request of the load"
        fault("worker", workers[worker], worker)
        assert busy_worker(coordinators[0]), "the load's requests do not go through coordinator-1"
        fault("coordinator", "coordinator-1", coordinators[0])
        assert answered_since(time.time(), 4, 60.0), "no answers after every heal"

        process.stdin.close()  # the load ends after the requests it has in flight
        process.wait(timeout=90.0)
        during = read_answers(output)
        errors = [a for a in during if "error" in a]
        assert errors == [], f"{len(errors)} of {len(during)} requests failed, the first: {errors[0]}"
        assert [a["index"] for a in during if a["tokens"] != expected[a["index"]]] == []
        for name, (began, healed) in windows.items():
            assert sum(began < a["ended"] < healed for a in during) >= 4, f"no load while the {name} was out"
        began, healed = windows["kvnode"]
        assert sum(a["usage"]["cached_tokens_remote"] for a in during if began < a["started"] < healed) > 0, \
            "no prefix came from the kvnodes left while one was partitioned"
        caught = {name: sum(a["started"] < began < a["ended"] for a in during) for name, (began, _) in windows.items()}

        after = one_pass("healed")
        assert {a["index"]: a["tokens"] for a in after} == expected
        healed_share = cached_share(after)
        print(f"\n{len(during)} requests under faults, 0 failed; prompt tokens from cache: {warm_share:.0%} warm "
              f"undisturbed, {healed_share:.0%} after healing; windows (s): "
              + ", ".join(f"{n} {h - b:.0f}" for n, (b, h) in windows.items())
              + "; requests in flight when each was partitioned: " + ", ".join(f"{n} {c}" for n, c in caught.items()))
        assert sum(a["usage"]["cached_tokens_remote"] for a in after) > 0, "no prefix came from a kvnode after healing"
        assert healed_share >= 0.8 * warm_share, f"hits did not recover: {healed_share:.0%} of prompt tokens cached " \
                                                 f"after healing, {warm_share:.0%} before the faults"
