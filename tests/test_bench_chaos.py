"""`kvcache bench chaos`: a short run with a worker SIGKILLed mid-load on a real local cluster, and the
counting beneath its table (differences, excused deaths, log lines) on made-up outcomes."""

import json
import signal
import time
from pathlib import Path

import pytest

import cluster_helpers

from coordinator.client import Client
from kvcache.bench.chaosload import ChaosRequest, Outcome, first_difference
from kvcache.bench.chaosreport import count_outcomes, print_report
from kvcache.bench.chaoswatch import DeadSighting, Downtime, log_sightings, resumed_streams, wrongly_dead
from kvcache.cluster import start_cluster, wait_healthy

SHORT = ["--nodes", "2", "--workers", "2", "--replicas", "1", "--node-capacity", "16MiB", "--worker-kv-cache",
         "16MiB", "--prompts", "6", "--max-tokens", "128", "--concurrency", "4", "--duration", "12",
         "--faults", "worker-kill", "--fault-interval", "8", "--request-timeout", "30", "--json", "--no-progress",
         "--eviction", "prefix-s3fifo"]  # a counting policy: a small pool makes it evict under the load


def run_bench(args, timeout=150):
    return cluster_helpers.run_bench("chaos", args, timeout)


def running(pid: int) -> bool:
    try:
        return b"kvcache.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    code, out, err = run_bench(SHORT + ["--logs", str(tmp_path_factory.mktemp("chaos") / "logs")])
    assert code == 0, err
    return json.loads(out)


def test_short_run_counts_add_up_and_stops_everything(short_run):
    r = short_run
    assert r["bench"] == "chaos" and r["reference"]["completed"] == r["reference"]["requests"] == 12
    assert r["faults"]["injected"] == {"worker-kill": r["faults"]["total"]} and r["faults"]["total"] >= 1
    first = r["faults"]["list"][0]
    assert first["exit_code"] == -signal.SIGKILL and first["in_flight"] >= 1, first  # killed mid-load
    assert first["back_after_s"] is not None and first["new_address"] == first["address"], first  # same port
    for kind, row in r["load"]["by_kind"].items():
        assert row["sent"] == row["completed"] + row["failed"] and row["sent"] > 0, (kind, row)
        assert row["differing"] + row["unchecked"] <= row["completed"] and row["refusals"] >= row["refused_and_retried"]
    assert r["load"]["by_kind"]["all"]["sent"] == sum(r["load"]["by_kind"][k]["sent"] for k in ("greedy", "seeded"))
    assert r["goal"]["met"] == (r["goal"]["failed"] == 0 and r["goal"]["differing"] == 0)
    assert r["status_polls"] > 0 and r["resumed_by_coordinators"] >= 0
    assert len(r["pids"]) == 4 + 2 + r["faults"]["total"], "2 coordinators, 2 kvnodes, 2 workers, each restart"
    assert r["processes_left"] == [] and not any(running(pid) for pid in r["pids"])
    assert "eviction prefix-s3fifo" in (Path(r["cluster"]["logs"]) / "node-0.log").read_text()


def test_worker_sigkill_mid_load_fails_no_greedy_request(short_run):
    greedy = short_run["load"]["by_kind"]["greedy"]
    assert greedy["failed"] == 0, short_run["load"]["first_failures"]
    assert greedy["differing"] == 0, short_run["load"]["first_differences"]


def test_table_and_goal_line(short_run, capsys):
    print_report(short_run)
    out = capsys.readouterr().out
    assert "requests sent" in out and "differing from the reference" in out and "members wrongly marked dead" in out
    assert "worker-kill" in out and "faults injected: worker-kill" in out and "eviction prefix-s3fifo" in out
    goal = "PASS" if short_run["goal"]["met"] else "FAIL"
    assert out.rstrip().splitlines()[-1].startswith(f"goal: failed 0, differing 0: {goal} (failed ")


def test_bad_option_is_refused_in_one_line():
    code, out, err = run_bench(["--faults", "worker-kill,disk-fill"], timeout=30)
    assert code == 2 and "--faults takes kinds among worker-kill" in err and "Traceback" not in err


def test_restart_brings_a_member_back_on_its_port(tmp_path):
    with start_cluster(tmp_path / "logs", nodes=1, workers=0, coordinators=1, replicas=1,
                       node_capacity="4MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, 1, 0, timeout_s=30.0)
        [node] = cluster.role("node")
        node.kill()
        again = cluster.restart(node)
        assert again.address == node.address and again.pid != node.pid and cluster.role("node") == [again]

        def seen_alive() -> bool:
            with Client(cluster.coordinator_addresses) as client:
                return any(m.alive and m.address == again.address for m in client.status().members)

        deadline = time.monotonic() + 15.0
        while not seen_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert seen_alive()
    assert not running(again.pid)


# ---- the counting, on made-up outcomes ---------------------------------------------------


def test_differences_are_found_at_their_first_position():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    greedy, seeded = ChaosRequest("a greedy", "greedy", "p", None), ChaosRequest("a seeded", "seeded", "p", 1)
    reference = {"a greedy": Outcome(greedy, [1, 2, 3], "length"), "a seeded": Outcome(seeded, [4, 5, 6], "length")}
    outcomes = [Outcome(greedy, [1, 2, 3], "length"), Outcome(seeded, [4, 5, 7], "length"),
                Outcome(seeded, [], error="UNAVAILABLE: no live worker", refusals=2),
                Outcome(greedy, [1, 2, 3], "stop")]
    counts = count_outcomes(outcomes, reference)
    assert counts["by_kind"]["seeded"] == {"sent": 2, "completed": 1, "refused_and_retried": 1, "refusals": 2,
                                           "failed": 1, "differing": 1, "unchecked": 0}
    assert counts["by_kind"]["greedy"]["differing"] == 1, "a different finish reason is a different answer"
    assert counts["by_kind"]["all"]["differing"] == 2
    [seeded_diff, greedy_diff] = sorted(counts["first_differences"], key=lambda d: d["request"], reverse=True)
    assert (seeded_diff["position"], seeded_diff["got"], seeded_diff["expected"]) == (2, 7, 6)
    assert greedy_diff["position"] == 3 and greedy_diff["finish_reason"] == "stop"
    assert counts["first_failures"] == ["a seeded: UNAVAILABLE: no live worker"]


def test_only_members_the_bench_had_down_are_excused():
    down = [Downtime("127.0.0.1:1", 100.0, 110.0)]
    sightings = [DeadSighting(105.0, "c0", "worker", "127.0.0.1:1", "status"),
                 DeadSighting(120.0, "c0", "worker", "127.0.0.1:1", "status"),
                 DeadSighting(105.0, "c1", "node", "127.0.0.1:2", "log")]
    assert [(s.address, s.at) for s in wrongly_dead(sightings, down)] == [("127.0.0.1:2", 105.0),
                                                                         ("127.0.0.1:1", 120.0)]


def test_missed_heartbeat_lines_are_read_from_the_coordinator_logs(tmp_path):
    log = tmp_path / "coordinator-0.log"
    log.write_text("2020-01-01 00:00:00,000 coordinator WARNING node 127.0.0.1:5 missed its heartbeats: left the ring\n"
                   "2999-01-01 00:00:00,250 coordinator WARNING worker 127.0.0.1:7 missed its heartbeats: no longer "
                   "gets requests (epoch 3)\n2999-01-01 00:00:01,000 coordinator INFO worker 127.0.0.1:7 joined\n")
    [sighting] = log_sightings([log], since=time.time())
    assert (sighting.role, sighting.address, sighting.coordinator, sighting.source) == (
        "worker", "127.0.0.1:7", "coordinator-0", "log")
    assert sighting.at == pytest.approx(time.mktime(time.strptime("2999-01-01", "%Y-%m-%d")) + 0.25)


def test_streams_resumed_mid_stream_are_counted_from_the_coordinator_logs(tmp_path):
    log = tmp_path / "coordinator-1.log"
    log.write_text("2999-01-01 00:00:00,000 coordinator WARNING worker 127.0.0.1:7 failed: UNAVAILABLE: gone "
                   "(request 1a2b, 64 tokens sent)\n2999-01-01 00:00:00,000 coordinator WARNING worker 127.0.0.1:7 "
                   "failed: UNAVAILABLE: gone (request 3c4d, 0 tokens sent)\n")
    assert resumed_streams([log], since=time.time()) == 1


def test_busy_processes_run_beside_and_are_killed_by_pid_or_end_by_themselves():
    from kvcache.bench.busy import busy_processes, running as busy

    with busy_processes(2, 60.0) as pids:
        deadline = time.monotonic() + 10
        while busy(pids) != pids and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) == 2 and busy(pids) == pids
    assert busy(pids) == []
    with busy_processes(1, 0.3) as pids:
        deadline = time.monotonic() + 20
        while busy(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert busy(pids) == [], "a busy process ends by itself after its bound"


def test_load_is_bounded():
    code, _, err = run_bench(["--load", "-1"], timeout=60)
    assert code == 2 and "--load" in err and err.count("\n") == 1
