"""Whole clusters of real processes (coordinators, kvnodes, workers) on loopback: routing,
cache hits through the cluster, and every kind of member dying."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from cluster_helpers import cluster_down, collect, wait_for
from base.generation import Finished, Piece
from coordinator.client import Client, ClusterError
from coordinator.ring import Ring, placement_key
from kvcache import launch
from kvcache.cluster import add_worker, default_blas_threads, disk_tier_args, start_cluster, wait_healthy
from kvnode.client import NodeClient
from worker.client import WorkerClient
from worker.engine.engine import Engine

PAGE_TOKENS = 16
SYSTEM = "You are the support assistant of a small bakery. Be kind, be brief, and never invent prices. "


def ask(client: Client, prompt: str, **options) -> tuple[list[int], Finished]:
    return collect(client.generate(prompt, **options))


def used_pages(address: str) -> int:
    with NodeClient(address) as node:
        return node.info().used_pages


def alive(client: Client, role: str) -> list[str]:
    return sorted(m.address for m in client.status().members if m.role == role and m.alive)


def test_an_interrupt_while_the_cluster_starts_stops_every_daemon_already_started(tmp_path):
    """A SIGTERM handler raising SystemExit (as `kvcache bench load` has) mid-start must not
    leave the daemons started so far running."""
    started = []

    def interrupt_at_the_first_node(cluster):
        started[:] = list(cluster.daemons)
        if cluster.daemons[-1].role == "node":
            raise SystemExit(143)

    with pytest.raises(SystemExit):
        start_cluster(tmp_path, nodes=2, workers=1, coordinators=2, on_start=interrupt_at_the_first_node)
    assert [d.role for d in started] == ["coordinator", "coordinator", "node"]
    assert not any(d.alive() for d in started)


def test_an_interrupt_while_a_daemon_starts_stops_that_daemon(tmp_path, monkeypatch):
    """Ctrl-C while waiting for a child's address: the child, not yet known to any caller, is stopped."""
    children = []

    def interrupted(daemon, _timeout_s):
        children.append(daemon.process)
        raise KeyboardInterrupt

    monkeypatch.setattr(launch.Daemon, "_wait_for_address", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch.Daemon("coordinator", ["--port", "0"], log_path=tmp_path / "coordinator.log")
    assert len(children) == 1 and children[0].poll() is not None


@pytest.fixture(scope="module")
def engine():
    return Engine.load("tiny")


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    with start_cluster(tmp_path_factory.mktemp("cluster"), nodes=2, workers=2, coordinators=2, replicas=2,
                       node_capacity="16MiB", worker_kv_cache="16MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=2, workers=2)
        yield cluster


def test_workers_share_the_cores_blas_threads(shared_cluster):
    threads = default_blas_threads(2)
    for worker in shared_cluster.role("worker"):
        assert f"BLAS capped at {threads} thread(s)" in worker.log_path.read_text()


def test_tokens_through_the_cluster_equal_the_engine_alone(shared_cluster, engine):
    prompt = SYSTEM + "Do you sell rye bread?"
    expected = engine.generate(prompt, max_new_tokens=12)[0].token_ids
    with Client(shared_cluster.coordinator_addresses) as client:
        tokens, done = ask(client, prompt, max_tokens=12)
    assert tokens == expected
    assert done.usage.completion_tokens == 12 and done.finish_reason == "length"


def test_a_shared_prefix_is_served_from_the_cluster(shared_cluster, engine):
    first, second = SYSTEM + "When do you open?", SYSTEM + "Do you deliver on Sundays?"
    pages = len(SYSTEM.encode()) // PAGE_TOKENS
    with Client(shared_cluster.coordinator_addresses) as client:
        ask(client, first, max_tokens=4)
        tokens, done = ask(client, second, max_tokens=6)
    cached = done.usage.cached_tokens_local + done.usage.cached_tokens_remote
    assert cached >= pages * PAGE_TOKENS
    assert done.usage.computed_tokens == done.usage.prompt_tokens - cached
    assert tokens == engine.generate(second, max_new_tokens=6)[0].token_ids


def test_status_shows_members_and_an_epoch_both_coordinators_share(shared_cluster):
    epochs = []
    for address in shared_cluster.coordinator_addresses:
        with Client([address]) as client:
            status = client.status()
        assert len([m for m in status.members if m.role == "node" and m.alive]) == 2
        assert len([m for m in status.members if m.role == "worker" and m.alive]) == 2
        epochs.append(status.epoch)
    assert epochs[0] == epochs[1]


def test_bad_request_is_refused_with_its_reason(shared_cluster):
    with Client(shared_cluster.coordinator_addresses) as client:
        with pytest.raises(ClusterError) as error:
            ask(client, "hello", max_tokens=0)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in error.value.details
        with pytest.raises(ClusterError) as empty:
            ask(client, "", max_tokens=3)
        assert empty.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_killed_kvnode_leaves_the_ring_and_no_request_fails(tmp_path, engine):
    prompts = [SYSTEM + f"Question {i}: which cake is best?" for i in range(10)]
    expected = [engine.generate(p, max_new_tokens=4)[0].token_ids for p in prompts]
    with start_cluster(tmp_path, nodes=3, workers=1, coordinators=1, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=3, workers=1)
        with Client(cluster.coordinator_addresses) as client:
            epoch = client.status().epoch
            results = []
            for i, prompt in enumerate(prompts):
                if i == 3:
                    victim = cluster.role("node")[0]
                    victim.kill()
                results.append(ask(client, prompt, max_tokens=4)[0])
            assert results == expected
            assert wait_for(lambda: victim.address not in alive(client, "node"), timeout_s=5.0)
            assert client.status().epoch != epoch


def test_killing_the_primary_keeps_the_hit_with_two_replicas(tmp_path, engine):
    prompt = SYSTEM + "Is the croissant vegan?"
    pages = len(prompt.encode()) // PAGE_TOKENS
    with start_cluster(tmp_path, nodes=3, workers=1, coordinators=1, replicas=2, node_capacity="16MiB",
                       worker_kv_cache="16MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=3, workers=1)
        with Client(cluster.coordinator_addresses) as client:
            ask(client, prompt, max_tokens=2)
            status = client.status()
            ring = Ring({m.address: m.capacity_bytes for m in status.members if m.role == "node" and m.alive})
            primary, replica = ring.placement(placement_key(prompt), 2)
            assert wait_for(lambda: used_pages(primary) >= pages and used_pages(replica) >= pages, timeout_s=10.0)
            nodes = {d.address: d for d in cluster.role("node")}
            nodes[primary].kill()
            # A fresh worker has no local copy: the pages can only come from the replica.
            cluster.role("worker")[0].kill()
            fresh = add_worker(cluster, tmp_path, "worker-fresh", kv_cache="16MiB")
            # The fresh worker alone: the killed one counts as alive until its heartbeats are missed.
            assert wait_for(lambda: alive(client, "worker") == [fresh.address] and primary not in alive(client, "node"),
                            timeout_s=30.0)
            tokens, done = ask(client, prompt + " Thanks!", max_tokens=4)
    assert done.usage.cached_tokens_remote == pages * PAGE_TOKENS
    assert tokens == engine.generate(prompt + " Thanks!", max_new_tokens=4)[0].token_ids


# Long enough that the worker is still generating when the test, having read 10 tokens, looks for
# it (with 120 a busy machine's worker had sometimes finished by then).
LONG_STORY = 400


def test_worker_killed_mid_stream_is_resumed_without_a_lost_or_repeated_token(tmp_path, engine):
    prompt = SYSTEM + "Tell me a long story about bread."
    expected = engine.generate(prompt, max_new_tokens=LONG_STORY, ignore_eos=True)[0].token_ids
    with start_cluster(tmp_path, nodes=1, workers=2, coordinators=1, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=2)
        with Client(cluster.coordinator_addresses) as client:
            tokens, finished = [], None
            killed = None
            for event in client.generate(prompt, max_tokens=LONG_STORY, ignore_eos=True):
                if isinstance(event, Piece):
                    tokens.extend(event.token_ids)
                    if killed is None and len(tokens) >= 10:
                        killed = _busy_worker(cluster)
                        killed.kill()
                else:
                    finished = event
    assert killed is not None
    assert tokens == expected
    assert finished.usage.completion_tokens == LONG_STORY


def test_worker_dead_before_its_first_token_is_invisible(tmp_path, engine):
    prompt = SYSTEM + "Is there bread left?"
    expected = engine.generate(prompt, max_new_tokens=5, ignore_eos=True)[0].token_ids
    with start_cluster(tmp_path, nodes=1, workers=2, coordinators=1, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=2)
        # Among idle workers the router picks the first address: kill that one, and ask at once,
        # before the coordinator has missed any heartbeat.
        first = min(cluster.role("worker"), key=lambda d: d.address)
        first.kill()
        with Client(cluster.coordinator_addresses) as client:
            tokens, done = ask(client, prompt, max_tokens=5, ignore_eos=True)
            assert tokens == expected and done.usage.completion_tokens == 5
            assert first.address not in alive(client, "worker")  # marked dead on the failed call


def test_sampled_request_without_seed_gets_unavailable_when_its_worker_dies(tmp_path):
    with start_cluster(tmp_path, nodes=1, workers=2, coordinators=1, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=2)
        with Client(cluster.coordinator_addresses) as client:
            with pytest.raises(ClusterError) as error:
                received, killed = 0, False
                # Long enough to still run when the client has read 10 tokens on a loaded machine.
                for event in client.generate(SYSTEM, max_tokens=800, temperature=1.0, ignore_eos=True):
                    received += len(getattr(event, "token_ids", []))
                    if received >= 10 and not killed:
                        _busy_worker(cluster).kill()
                        killed = True
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert "retry" in error.value.details


def test_either_coordinator_can_die(tmp_path, engine):
    prompt = SYSTEM + "Are you open today?"
    expected = engine.generate(prompt, max_new_tokens=5)[0].token_ids
    with start_cluster(tmp_path, nodes=1, workers=1, coordinators=2, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=1)
        first, second = cluster.role("coordinator")
        with Client(cluster.coordinator_addresses) as client:
            assert ask(client, prompt, max_tokens=5)[0] == expected
            first.kill()
            assert ask(client, prompt, max_tokens=5)[0] == expected
            assert client.status().coordinator_id == "coordinator-1"


def _busy_worker(cluster):
    """The worker running a request right now (bounded wait)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for daemon in cluster.role("worker"):
            if daemon.alive():
                with WorkerClient(daemon.address) as client:
                    if client.info().running:
                        return daemon
        time.sleep(0.01)
    raise AssertionError("no worker is running a request")


@pytest.mark.parametrize("option, message", [
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be at least 1, got 0"),
    (["--alone-prefill-tokens", "0"], "--alone-prefill-tokens must be at least 1, got 0"),
    (["--replicas", "4"], "--replicas 4 exceeds --nodes 3"),
    (["--gateway-port", "70000"], "--gateway-port must be between 0 and 65535, got 70000"),
    (["--disk-check", "always"],
     "--disk-check needs --data-dir: without a data folder the kvnodes have no disk tier"),
    (["--flush-interval", "0", "--disk-check", "start"], "--flush-interval and --disk-check need --data-dir"),
    (["--data-dir", "DATA", "--flush-interval", "-1"],
     "--flush-interval must be a finite number of seconds, 0 or more, got -1.0"),
    (["--data-dir", "DATA", "--flush-interval", "nan"],
     "--flush-interval must be a finite number of seconds, 0 or more, got nan"),
])
def test_cluster_up_refuses_bad_options_in_one_line_before_starting_anything(tmp_path, option, message):
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "cluster", "up", "--run-dir", str(tmp_path / "run"),
                           *option], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "cluster.json").exists()


def test_cluster_up_passes_the_disk_tier_options_to_every_kvnode_and_only_those_given(tmp_path):
    run_dir, data_dir = tmp_path / "run", tmp_path / "data"
    cli = [sys.executable, "-m", "kvcache.cli", "cluster"]
    up = subprocess.run([*cli, "up", "--run-dir", str(run_dir), "--model", "tiny", "--nodes", "2", "--workers", "1",
                         "--coordinators", "1", "--replicas", "1", "--no-gateway", "--no-metrics", "--data-dir",
                         str(data_dir), "--flush-interval", "0", "--disk-check", "always", "--detach"],
                        capture_output=True, text=True, timeout=180)
    members = []
    try:
        assert up.returncode == 0, up.stderr
        members = json.loads((run_dir / "cluster.json").read_text())["members"]
        nodes = [m for m in members if m["role"] == "node"]
        assert len(nodes) == 2
        for node in nodes:
            assert "disk check always; leases at most" in Path(node["log"]).read_text()
            with NodeClient(node["address"]) as client:  # --flush-interval 0: on disk before the put is answered
                page = bytes(client.info().page_bytes)
                assert client.put_pages([b"k" * 16], [b""], [page]).stored == 1
                info = client.info()
                assert (info.disk_used_pages, info.dirty_pages) == (1, 0)
    finally:
        down = cluster_down(cli, run_dir, members)
    assert down.returncode == 0, down.stderr
    assert sorted(p.name for p in data_dir.iterdir()) == ["node-0", "node-1"]
    assert disk_tier_args(data_dir, None, None) == []  # the kvnode's own defaults


def test_a_kvnode_killed_and_restarted_on_its_data_dir_and_port_serves_its_pages_again(tmp_path):
    """cluster --data-dir: the restarted node keeps its ring position (same address) and its pages."""
    prompt = SYSTEM + "Do you bake on Sundays?"
    pages = len(prompt.encode()) // PAGE_TOKENS
    with start_cluster(tmp_path / "logs", nodes=1, workers=1, coordinators=1, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB", data_dir=tmp_path / "data") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=1)
        with Client(cluster.coordinator_addresses) as client:
            ask(client, prompt, max_tokens=2)
            [node] = cluster.role("node")

            def on_disk() -> int:
                with NodeClient(node.address) as c:
                    info = c.info()
                    return info.disk_used_pages if info.dirty_pages == 0 else 0

            assert wait_for(lambda: on_disk() >= pages, timeout_s=10.0)
            node.kill()
            cluster.role("worker")[0].kill()  # a fresh worker has no local copy
            again = cluster.restart(node)
            assert again.address == node.address
            fresh = add_worker(cluster, tmp_path / "logs", "worker-fresh", kv_cache="16MiB")
            # The fresh worker alone: the killed one counts as alive until its heartbeats are missed.
            assert wait_for(lambda: alive(client, "worker") == [fresh.address] and alive(client, "node") == [node.address],
                            timeout_s=30.0)
            _, done = ask(client, prompt + " Thanks!", max_tokens=2)
    assert done.usage.cached_tokens_remote == pages * PAGE_TOKENS
    assert (tmp_path / "data" / "node-0" / "pages.slots").exists()
