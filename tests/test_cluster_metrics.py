"""A real local cluster with metrics on every member (as `cluster up` starts it): scraped over
loopback with prometheus_client's parser, the workers' counters move by exactly what the
requests' usage reports (prompt tokens by source, generated tokens, and vLLM's names for them),
the kvnodes' bytes by exactly what the workers fetched and wrote back, and the coordinator's by
the requests it relayed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from base.generation import Finished
from coordinator.client import Client
from cluster_helpers import cluster_down
from kvcache.cluster import start_cluster, wait_healthy
from kvcache.prometheus import file_sd_targets
from metrics_helpers import scrape
from worker.client import WorkerClient

SYSTEM = "You are the support assistant of a small bakery. Be kind, be brief, and never invent prices. "
PAGE_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster")   # kvnodes with a disk tier: the dashboard shows theirs too
    with start_cluster(folder, nodes=2, workers=2, coordinators=1, replicas=2, node_capacity="16MiB",
                       worker_kv_cache="16MiB", metrics=True, data_dir=folder / "data") as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=2, workers=2)
        yield cluster


def finished(events) -> Finished:
    return [e for e in events if isinstance(e, Finished)][-1]


def scrape_all(cluster) -> dict[str, object]:
    return {d.address: scrape(d.metrics_url) for d in cluster.daemons}


def written_back(cluster) -> float:
    return sum(scrape(w.metrics_url).sum(name) for w in cluster.role("worker")
               for name in ("kvcache_worker_remote_written_pages_total", "kvcache_worker_remote_refused_pages_total",
                            "kvcache_worker_remote_dropped_pages_total"))


def settle_write_back(cluster, timeout_s: float = 20.0) -> None:
    """Until the workers' write-back counters stop moving (three equal scrapes), bounded."""
    deadline, last, same = time.monotonic() + timeout_s, None, 0
    while time.monotonic() < deadline and same < 3:
        now = written_back(cluster)
        same = same + 1 if now == last else 0
        last = now
        time.sleep(0.2)


def total_delta(after, before, daemons, name, **labels) -> float:
    return sum(after[d.address].sum(name, **labels) - before[d.address].sum(name, **labels) for d in daemons)


def test_every_member_serves_metrics_and_the_cluster_file_form_lists_them(cluster):
    for daemon in cluster.daemons:
        assert daemon.metrics_url and daemon.metrics_url.startswith("http://127.0.0.1:")
    members = [{"role": d.role, "metrics": d.metrics_url} for d in cluster.daemons]
    groups = {g["labels"]["role"]: g["targets"] for g in file_sd_targets({"members": members})}
    assert sorted(groups) == ["coordinator", "node", "worker"]
    assert len(groups["node"]) == 2 and len(groups["worker"]) == 2


def test_counters_move_by_exactly_what_the_usage_reports(cluster):
    workers, nodes = cluster.role("worker"), cluster.role("node")
    coordinator = cluster.role("coordinator")[0]
    settle_write_back(cluster)
    before = scrape_all(cluster)
    usages, reasons = [], []
    with Client(cluster.coordinator_addresses) as client:
        for question in ("When do you open?", "Do you deliver?", "When do you open?"):
            done = finished(client.generate(SYSTEM + question, max_tokens=5))
            usages.append(done.usage), reasons.append(done.finish_reason)
    settle_write_back(cluster)
    # The same prefix on the worker that has not served it: its pages come from the kvnodes.
    middle = scrape_all(cluster)
    served = {w.address: total_delta(middle, before, [w], "kvcache_worker_requests_total") for w in workers}
    other = min(workers, key=lambda w: served[w.address])
    with WorkerClient(other.address) as direct:
        events = list(direct.generate(SYSTEM + "Is there rye?", max_tokens=4, placement=[n.address for n in nodes]))
    usages.append(finished(events).usage), reasons.append(finished(events).finish_reason)
    settle_write_back(cluster)
    after = scrape_all(cluster)

    assert usages[-1].cached_tokens_remote > 0
    for source, field in (("local", "cached_tokens_local"), ("remote", "cached_tokens_remote"),
                          ("computed", "computed_tokens")):
        assert total_delta(after, before, workers, "kvcache_worker_prompt_tokens_total", source=source) == \
            sum(getattr(u, field) for u in usages), source
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert total_delta(after, before, workers, "kvcache_worker_generation_tokens_total") == generated
    for reason in set(reasons):
        assert total_delta(after, before, workers, "kvcache_worker_requests_total", finish_reason=reason) == \
            reasons.count(reason)
        assert total_delta(after, before, workers, "vllm:request_success_total", finished_reason=reason) == \
            reasons.count(reason)
    assert total_delta(after, before, workers, "kvcache_worker_requests_total") == 4
    assert total_delta(after, before, workers, "kvcache_worker_time_to_first_token_seconds_count") == 4
    # vLLM's names for the same numbers.
    assert total_delta(after, before, workers, "vllm:prompt_tokens_total") == prompt
    assert total_delta(after, before, workers, "vllm:generation_tokens_total") == generated
    assert total_delta(after, before, workers, "vllm:prefix_cache_queries_total") == prompt
    assert total_delta(after, before, workers, "vllm:prefix_cache_hits_total") == sum(u.cached_tokens_local for u in usages)
    assert total_delta(after, before, workers, "vllm:external_prefix_cache_hits_total") == \
        sum(u.cached_tokens_remote for u in usages)

    # Nodes: bytes sent are the pages the worker fetched; pages received are those written back.
    page_bytes = after[nodes[0].address].value("kvcache_node_page_bytes")
    # Pages come as bytes fetched, or are read where they lie in a node's pool (pinned: the node
    # counts them as sent too); which depends on whether the worker has mapped that pool yet.
    fetched = total_delta(after, before, workers, "kvcache_worker_remote_fetched_bytes_total")
    read_in_place = total_delta(after, before, workers, "kvcache_worker_remote_in_place_pages_total") * page_bytes
    assert fetched + read_in_place == usages[-1].cached_tokens_remote // PAGE_TOKENS * page_bytes
    assert total_delta(after, before, nodes, "kvcache_node_sent_bytes_total") == fetched + read_in_place
    offered = total_delta(after, before, workers, "kvcache_worker_remote_written_pages_total") + \
        total_delta(after, before, workers, "kvcache_worker_remote_refused_pages_total")
    assert offered > 0
    assert total_delta(after, before, nodes, "kvcache_node_put_pages_total") == offered
    assert total_delta(after, before, nodes, "kvcache_node_received_bytes_total") == offered * page_bytes
    assert total_delta(after, before, nodes, "kvcache_node_lookup_pages_total", result="hit") >= \
        usages[-1].cached_tokens_remote // PAGE_TOKENS

    # The coordinator relayed three requests, all finished, each routed once.
    c = coordinator.address
    assert after[c].value("kvcache_coordinator_requests_total", outcome="ok") - \
        before[c].value("kvcache_coordinator_requests_total", outcome="ok") == 3
    assert after[c].sum("kvcache_coordinator_route_affinity_total") - \
        before[c].sum("kvcache_coordinator_route_affinity_total") == 3
    assert after[c].value("kvcache_coordinator_members", role="node", state="alive") == 2
    assert after[c].value("kvcache_coordinator_members", role="worker", state="alive") == 2
    assert after[c].value("kvcache_coordinator_request_duration_seconds_count", method="Generate") - \
        before[c].value("kvcache_coordinator_request_duration_seconds_count", method="Generate") == 3


def test_cluster_up_records_each_members_metrics_and_prints_scrape_targets(tmp_path):
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "kvcache.cli", "cluster"]
    # The tiny model: the metrics are the same for any; `cluster up` of the default model is the README test's.
    up = subprocess.run([*cli, "up", "--run-dir", str(run_dir), "--model", "tiny", "--nodes", "1", "--workers", "1",
                         "--coordinators", "1", "--replicas", "1", "--detach"], capture_output=True, text=True,
                        timeout=180)
    members = []
    try:
        assert up.returncode == 0, up.stderr
        members = json.loads((run_dir / "cluster.json").read_text())["members"]
        assert sorted(m["role"] for m in members) == ["coordinator", "gateway", "node", "worker"]
        [gateway] = [m for m in members if m["role"] == "gateway"]
        assert json.loads((run_dir / "cluster.json").read_text())["gateway"] == gateway["address"]
        assert f"gateway: {gateway['address']} (OpenAI API at {gateway['address']}/v1)" in up.stdout
        printed = subprocess.run([*cli, "prometheus-config", "--run-dir", str(run_dir)], capture_output=True,
                                 text=True, timeout=60)
        assert printed.returncode == 0, printed.stderr
        targets = {g["labels"]["role"]: g["targets"] for g in json.loads(printed.stdout)}
        whole = subprocess.run([*cli, "prometheus-config", "--run-dir", str(run_dir), "--scrape-config"],
                               capture_output=True, text=True, timeout=60)
        assert whole.returncode == 0, whole.stderr
        jobs = json.loads(whole.stdout)["scrape_configs"]
        assert all("tls_config" not in job and "authorization" not in job for job in jobs)  # plaintext
        assert {g["labels"]["role"]: g["targets"] for job in jobs for g in job["static_configs"]} == targets
        for member in members:
            assert member["metrics"].startswith("http://127.0.0.1:")
            assert targets[member["role"]] == [member["metrics"][len("http://"):].split("/")[0]]
            names = scrape(member["metrics"]).names()
            assert any(name.startswith(f"kvcache_{member['role']}_") for name in names), member["role"]
    finally:
        down = cluster_down(cli, run_dir, members)
    assert down.returncode == 0, down.stderr


def test_every_dashboard_expression_names_a_metric_a_scrape_returns(cluster):
    dashboard = json.loads((Path(__file__).parent.parent / "deploy" / "grafana" / "kvcache-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    returned = set().union(*(scrape(d.metrics_url).names() for d in cluster.daemons))
    for expr in exprs:
        names = re.findall(r"\b(?:kvcache_|vllm:)[a-z0-9_:]+", expr)
        assert names, expr
        for name in names:
            assert name in returned, f"{name} (in {expr!r}) is not in any scrape"
