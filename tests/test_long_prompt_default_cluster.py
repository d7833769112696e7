"""A long prompt on the cluster a new user starts: `kvcache cluster up` with every default (the
default model, smollm2-135m, whose context is 8,192 tokens) takes a 6,000-token prompt through the
gateway, and a second request with the same prefix, on a worker that has no local copy of it (the
first one's worker is stopped), gets all 6,000 cached tokens from a kvnode: the pools are sized to
the model (base/pool_sizes.py), so one kvnode leases the whole prompt's pages. Real processes on
loopback, every one stopped by its own pid at the end, also on failure.

Slow on purpose: computing 6,000 tokens of the default model takes ~50 s on one core here (each of
the two workers gets one BLAS thread of this 2-core machine)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx2
import pytest

from cluster_helpers import cluster_down, kvcache_command, wait_for
from coordinator.client import Client
from kvnode.client import NodeClient
from worker.model.named import DEFAULT_MODEL, named_model_installed

pytestmark = pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL),
                                reason="the default model's package is not installed (`make install` installs it)")

PROMPT_TOKENS = 6000
PAGE_TOKENS = 16
CLI = kvcache_command()


def env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("KVCACHE_COORDINATORS", "KVCACHE_TOKEN")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`kvcache cluster up --detach` with no option but its run directory: what it printed, and its cluster file."""
    folder = tmp_path_factory.mktemp("long-prompt")
    run_dir = folder / "run"
    members = []
    try:
        up = subprocess.run([*CLI, "cluster", "up", "--detach", "--run-dir", str(run_dir)], capture_output=True,
                            text=True, cwd=folder, env=env(), timeout=300, stdin=subprocess.DEVNULL)
        if (run_dir / "cluster.json").exists():
            members = json.loads((run_dir / "cluster.json").read_text())["members"]
        assert up.returncode == 0, up.stderr
        yield up.stdout, json.loads((run_dir / "cluster.json").read_text())
    finally:
        cluster_down([*CLI, "cluster"], run_dir, members)


def role(cluster_file: dict, name: str) -> list[dict]:
    return [m for m in cluster_file["members"] if m["role"] == name]


def test_cluster_up_says_its_pools_sized_to_the_model_in_one_line(cluster):
    stdout, cluster_file = cluster
    [line] = [line for line in stdout.splitlines() if line.startswith("pools for ")]
    assert line.startswith(f"pools for {DEFAULT_MODEL} (float32 KV, 45KiB a token): each worker 360MiB, 512 blocks "
                           "of 16 tokens, one full 8192-token context; each kvnode 720MiB, 1024 pages, 512 leasable "
                           "at once, a whole 8192-token prompt; 2.8GiB in all"), line
    for worker in role(cluster_file, "worker"):
        assert "512 blocks, 360.0 MiB: one full 8192-token context of the model)" in Path(worker["log"]).read_text()
    for node in role(cluster_file, "node"):
        log = Path(node["log"]).read_text()
        assert "1024 pages of 737280 bytes, 720.0 MiB" in log and "leases at most 512 pages at once" in log


def complete(gateway: str, prompt: list[int]) -> dict:
    reply = httpx2.post(f"{gateway}/v1/completions", timeout=600.0,
                        json={"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def long_prompt(gateway: str) -> list[int]:
    """PROMPT_TOKENS token ids of real text (the model's own tokenizer, through the gateway's /tokenize)."""
    text = " ".join(f"Paragraph {i}: the reading room of the town library opened at {7 + i % 5} o'clock, and "
                    f"the {i}th visitor asked for a book about rivers, bread or the stars." for i in range(400))
    reply = httpx2.post(f"{gateway}/tokenize", json={"model": DEFAULT_MODEL, "prompt": text}, timeout=120.0)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]
    assert len(tokens) >= PROMPT_TOKENS
    return tokens[:PROMPT_TOKENS]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx2.get(url, timeout=10.0).text
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_6000_token_prompt_comes_back_whole_from_a_kvnode_to_a_worker_without_a_local_copy(cluster):
    _, cluster_file = cluster
    gateway = cluster_file["gateway"]
    coordinators = [m["address"] for m in role(cluster_file, "coordinator")]
    prompt = long_prompt(gateway)

    started = time.monotonic()
    first = complete(gateway, prompt)
    computed_s = time.monotonic() - started
    assert first["prompt_tokens"] == PROMPT_TOKENS and first["kvcache"]["computed_tokens"] == PROMPT_TOKENS, first

    # The worker that computed it; its pages written back to their kvnodes (two replicas) before it goes.
    computed = '_total{source="computed"}'
    [served] = [w for w in role(cluster_file, "worker") if metric(w["metrics"], "kvcache_worker_prompt_tokens", computed)]
    pages = PROMPT_TOKENS // PAGE_TOKENS

    def replicas_holding() -> int:
        held = 0
        for node in role(cluster_file, "node"):
            with NodeClient(node["address"]) as client:
                held += client.info().used_pages >= pages
        return held

    assert wait_for(lambda: replicas_holding() >= 2, timeout_s=60.0, interval_s=0.5)
    os.kill(served["pid"], signal.SIGTERM)  # it drains and leaves the coordinators: its local cache goes with it
    [other] = [w for w in role(cluster_file, "worker") if w["address"] != served["address"]]
    with Client(coordinators) as client:
        assert wait_for(lambda: [m.address for m in client.status().members if m.role == "worker" and m.alive]
                        == [other["address"]], timeout_s=60.0, interval_s=0.5)

    started = time.monotonic()
    second = complete(gateway, prompt + prompt[:24])  # the same 6,000 tokens and a few more
    fetched_s = time.monotonic() - started
    ours = second["kvcache"]
    assert ours["cached_tokens_local"] == 0 and ours["cached_tokens_remote"] == PROMPT_TOKENS, second
    assert ours["computed_tokens"] == 24, second
    assert metric(other["metrics"], "kvcache_worker_prompt_tokens", '_total{source="remote"}') == PROMPT_TOKENS
    moved = sum(metric(other["metrics"], f"kvcache_worker_remote_{kind}_pages", "_total")
                for kind in ("fetched", "in_place"))
    assert moved >= pages
    print(f"\n6000 tokens computed in {computed_s:.1f}s; fetched from a kvnode in {fetched_s:.1f}s")
