"""Traces across hops: with the SDK's in-memory exporter (in a child process, tests/trace_scenario.py),
a client's call through an in-process coordinator, worker and kvnode is one trace, every span
parented on the hop that caused it: coordinator -> worker -> its queue wait, prefill, decode,
prefix lookup (-> the node's Lookup), write-back (-> both replicas' PutPages); a second worker's
fetch of those pages -> the node's GetPages. A call outside any trace starts one at the
coordinator; a call in an unsampled trace makes no span anywhere and its context goes on
unsampled; housekeeping calls (Register, Heartbeat, Info, Stats) make none. Without
--otlp-endpoint's packages a daemon says so; a sample ratio out of range is one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_helpers import kvcache_command

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def scenario():
    done = subprocess.run([sys.executable, str(HERE / "trace_scenario.py")], capture_output=True, text=True,
                          timeout=180, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def spans(scenario):
    return [record for record in scenario if "name" in record]


@pytest.fixture(scope="module")
def received(scenario):
    """(method, traceparent or None) of every call the scenario's servers took, in order."""
    return [(record["received"], record["traceparent"]) for record in scenario if "received" in record]


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
    # One span a write-back batch, over its writes to both replicas; none starts a trace of its own.
    assert max(sum(s["parent"] == back["id"] for s in trace) for back in named(trace, "worker.write_back")) == 2
    assert [s for s in spans if s["name"] == "worker.write_back" and s["parent"] is None] == []
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


def test_a_call_outside_any_trace_starts_one_at_the_coordinator(spans):
    roots = [s for s in spans if s["name"] == "kvcache.v1.Coordinator/Generate" and s["parent"] is None]
    assert len(roots) == 1
    trace = [s for s in spans if s["trace"] == roots[0]["trace"]]
    worker = named(trace, "kvcache.v1.Worker/Generate")[0]
    assert worker["parent"] == roots[0]["id"]
    for name in ("worker.queue_wait", "worker.decode", "worker.prefix_lookup"):
        assert named(trace, name)[0]["parent"] == worker["id"]


def test_an_unsampled_trace_makes_no_span_and_its_context_goes_on_unsampled(spans, received):
    unsampled = format(0x5EED, "032x")
    assert [s["name"] for s in spans if s["trace"] == unsampled] == []
    carried = [(method, parent) for method, parent in received if parent and parent.split("-")[1] == unsampled]
    # The client's context reached the coordinator and, through it, the worker, unsampled (flags 00).
    assert [method for method, _ in carried][:2] == ["/kvcache.v1.Coordinator/Generate", "/kvcache.v1.Worker/Generate"]
    assert {parent.split("-")[3] for _, parent in carried} == {"00"}


def test_housekeeping_calls_outside_a_trace_make_no_span_and_carry_no_context(spans, received):
    housekeeping = {"/kvcache.v1.Coordinator/Register", "/kvcache.v1.Coordinator/Heartbeat",
                    "/kvcache.v1.KVStore/Info", "/kvcache.v1.KVStore/Stats"}
    assert housekeeping <= {method for method, _ in received}
    assert [parent for method, parent in received if method in housekeeping] == \
        [None] * sum(method in housekeeping for method, _ in received)
    assert {s["name"] for s in spans} & {method[1:] for method in housekeeping} == set()
    # Every span the node made sits inside a request's trace started by a client or a coordinator.
    starts = {s["trace"] for s in spans if s["parent"] is None}
    assert all(s["trace"] in starts for s in spans if s["name"].startswith("kvcache.v1.KVStore/"))


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


@pytest.mark.parametrize("options, message", [
    (["--otlp-endpoint", "http://127.0.0.1:9/v1/traces", "--trace-sample-ratio", "1.5"],
     "--trace-sample-ratio must be between 0 and 1"),
    (["--trace-sample-ratio", "0.1"], "--trace-sample-ratio chooses which requests --otlp-endpoint exports"),
])
def test_a_sample_ratio_the_daemon_cannot_use_is_one_clear_line(options, message):
    done = subprocess.run(kvcache_command("node", "--port", "0", "--capacity", "1MiB", *options),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
