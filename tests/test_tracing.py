"""Traces across hops: with the SDK's in-memory exporter (in a child process, tests/trace_scenario.py),
a client's call through an in-process coordinator, worker and kvnode is one trace, every span
parented on the hop that caused it: coordinator -> worker -> its queue wait, prefill, decode,
prefix lookup (-> the node's Lookup), write-back (-> the node's PutPages); a second worker's
fetch of those pages -> the node's GetPages. Without --otlp-endpoint's packages a daemon says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_helpers import kvcache_command

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def spans():
    done = subprocess.run([sys.executable, str(HERE / "trace_scenario.py")], capture_output=True, text=True,
                          timeout=180, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def one_trace(spans, root_name):
    root = next(s for s in spans if s["name"] == root_name)
    return root, [s for s in spans if s["trace"] == root["trace"]]


def parent_of(trace, span):
    return next(s for s in trace if s["id"] == span["parent"])


def named(trace, name):
    found = [s for s in trace if s["name"] == name]
    assert found, f"no {name} span in {sorted({s['name'] for s in trace})}"
    return found


def test_one_trace_from_the_client_through_coordinator_worker_and_node(spans):
    root, trace = one_trace(spans, "client.first")
    assert root["parent"] is None
    coordinator = named(trace, "kvcache.v1.Coordinator/Generate")[0]
    worker = named(trace, "kvcache.v1.Worker/Generate")[0]
    assert coordinator["parent"] == root["id"]
    assert worker["parent"] == coordinator["id"]
    for name in ("worker.queue_wait", "worker.prefill_chunk", "worker.decode", "worker.prefix_lookup",
                 "worker.write_back"):
        for span in named(trace, name):
            assert span["parent"] == worker["id"], name
    for lookup in named(trace, "kvcache.v1.KVStore/Lookup"):
        assert parent_of(trace, lookup)["name"] == "worker.prefix_lookup"
    for put in named(trace, "kvcache.v1.KVStore/PutPages"):
        assert parent_of(trace, put)["name"] == "worker.write_back"
    # Children lie within their parents' time (the engine's spans are rebuilt from its records). A
    # streaming server span may end just after its caller's: the caller stops at the final message,
    # the server when its stream is closed after sending it.
    for span in trace:
        if span["parent"] and span["name"].startswith("kvcache.v1."):
            parent = parent_of(trace, span)
            ends_inside = span["end"] <= parent["end"] or span["name"].endswith("/Generate")
            assert parent["start"] <= span["start"] and ends_inside or \
                parent["name"] == "worker.write_back", span["name"]


def test_a_fetch_from_the_node_is_in_the_requests_trace(spans):
    root, trace = one_trace(spans, "client.second")
    worker = named(trace, "kvcache.v1.Worker/Generate")[0]
    assert worker["parent"] == root["id"]
    fetch = named(trace, "worker.remote_fetch")[0]
    assert fetch["parent"] == worker["id"]
    assert [parent_of(trace, s)["name"] for s in named(trace, "kvcache.v1.KVStore/GetPages")] == ["worker.remote_fetch"]
    first_root, _ = one_trace(spans, "client.first")
    assert first_root["trace"] != root["trace"]


def test_a_call_through_the_gateway_continues_the_callers_trace(spans):
    root, trace = one_trace(spans, "client.third")
    gateway = named(trace, "POST /v1/completions")[0]
    assert gateway["parent"] == root["id"]          # the caller's traceparent header
    coordinator = named(trace, "kvcache.v1.Coordinator/Generate")[0]
    assert coordinator["parent"] == gateway["id"]   # carried on by the gateway's grpc.aio call
    worker = named(trace, "kvcache.v1.Worker/Generate")[0]
    assert worker["parent"] == coordinator["id"]
    # Inside the gateway's time; the coordinator's streaming span may end just after it (as above:
    # the gateway's ends with the response, the coordinator's when its stream is closed).
    assert gateway["start"] <= coordinator["start"] <= gateway["end"]


def test_otlp_endpoint_without_the_otel_extra_is_one_clear_line():
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        pytest.skip("the otel extra is installed here")
    except ImportError:
        pass
    done = subprocess.run(kvcache_command("coordinator", "--port", "0", "--otlp-endpoint", "http://127.0.0.1:9/v1/traces"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pip install 'kvcache[otel]'" in done.stderr and "Traceback" not in done.stderr
