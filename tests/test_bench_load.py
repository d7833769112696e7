"""`kvcache bench load` end to end on a small local cluster (tiny model, a few requests): both passes
are reported with their ratios; the figures themselves are never asserted as timings."""

import importlib.util
import json
import math
import os
import statistics
import subprocess

import pytest

import cluster_helpers

SMALL = ["--model", "tiny", "--nodes", "2", "--workers", "1", "--replicas", "1", "--node-capacity", "16MiB",
         "--worker-kv-cache", "16MiB", "--requests", "6", "--concurrency", "2", "--max-tokens", "2",
         "--duration", "60", "--warmup", "1", "--system-chars", "96", "--session-context-chars", "48",
         "--unique-chars", "40,80", "--session-turns", "2"]


def run_bench(args, timeout=240):
    return cluster_helpers.run_bench("load", args, timeout)


def test_short_run_reports_both_passes_and_ratios(tmp_path):
    plots = importlib.util.find_spec("matplotlib") is not None
    extra = ["--plot", str(tmp_path / "charts")] if plots else []
    code, out, err = run_bench(SMALL + ["--json", "--logs", str(tmp_path / "logs"), "--step-logs",
                                        "--max-prefill-tokens", "24", "--alone-prefill-tokens", "24", *extra])
    assert code == 0, err
    report = json.loads(out)
    assert report["bench"] == "load" and report["cluster"]["started_here"]
    assert report["cluster"]["blas_threads_per_worker"] == max(1, (os.cpu_count() or 1) // 1)  # one worker
    assert report["machine"]["cpus"] and report["versions"]["kvcache"] != "absent"
    assert report["options"]["requests"] == 6 and "no-cache pass" in report["order"]
    [level] = report["levels"]
    assert level["concurrency"] == 2 and sum(level["requests_by_kind"].values()) == 6
    base, cache = level["passes"]["no_cache"], level["passes"]["cache"]
    for p in (base, cache):
        s = p["summary"]
        assert s["requests"] + s["failed"] <= 6 and s["failed"] == 0, s["errors"]
        assert s["requests"] == 6 and s["generated_tokens"] == 6 * 2
        assert s["requests_per_s"] > 0 and s["ttft_ms"]["p50"] > 0 and s["latency_ms"]["p99"] >= s["ttft_ms"]["p50"]
        assert set(s["ttft_ms"]) == {"p50", "p90", "p99"} and len(p["ttft_ms_all"]) == 6
        assert len(p["nodes"]) == 2 and len(p["workers"]) == 1
    # Without the cache nothing is served from it nor written to the kvnodes.
    assert base["summary"]["cache"]["total"] == 0
    assert all(n["puts"] == 0 and n["lookups"] == 0 for n in base["nodes"].values())
    # With it, full pages are written back and the warm requests reuse their prefix.
    assert sum(n["stored_pages"] for n in cache["nodes"].values()) > 0
    assert cache["summary"]["cache_once_warm"]["total"] > 0
    gains = level["gains"]
    assert {"requests_per_s", "generated_tokens_per_s", "ttft_p50", "ttft_p90", "ttft_p99", "latency_p50",
            "latency_p99"} <= set(gains)
    assert all(math.isfinite(g) and g > 0 for g in gains.values())
    interval = level["ttft_p50_gain_interval"]
    assert interval["level"] == 0.9 and 0 < interval["low"] <= interval["high"]
    steps = [json.loads(line) for line in (tmp_path / "logs" / "worker-0.steps.jsonl").read_text().splitlines()]
    first_tokens = sum(1 for s in steps for q in s["requests"] if q["computed"] < q["prompt"] <= q["computed"] + q["new"])
    assert first_tokens == 1 + 2 * 6, "the warm-up request and both passes' requests each got a first token"
    chunks = [q["new"] for s in steps for q in s["requests"]]
    assert max(chunks) == 24, "the workers computed prompts in chunks of --max-prefill-tokens, alone too"
    assert level["pages_evicted"] >= 0 and set(level["goals_met"]) == {"ttft_p50_gain", "cached_share_once_warm"}
    if plots:
        assert [p.rsplit("/", 1)[-1] for p in report["plots"]] == ["load_ttft_c2.png"]
        assert (tmp_path / "charts" / "load_ttft_c2.png").stat().st_size > 0


def test_observability_cost_alternates_off_and_on_clusters_and_reports_each_pairs_ratio_and_the_median(tmp_path):
    code, out, err = run_bench(SMALL + ["--observability-cost", "--repeat", "2", "--json", "--logs",
                                        str(tmp_path / "logs")], timeout=420)
    assert code == 0, err
    report = json.loads(out)
    assert report["bench"] == "load-observability-cost" and len(report["pairs"]) == 2
    # Interleaved: each pair ran off, then on (the progress lines say so in order).
    arms = [line.split()[2].rstrip(":") for line in err.splitlines() if line.startswith("pair ")]
    assert arms == ["off", "on", "off", "on"], err
    [level] = report["summary"]
    for name in ("no_cache", "cache"):
        ratios = []
        for pair in report["pairs"]:
            off, on = (pair[arm]["levels"][0][name] for arm in ("off", "on"))
            assert off["requests"] == on["requests"] == 6 and off["failed"] == on["failed"] == 0
            ratios.append(on["requests_per_s"] / off["requests_per_s"])
        assert level["ratios_on_off"][name] == ratios
        assert level["median"][name] == statistics.median(ratios)
    cpu = [pair["on"]["cpu_ms_per_request"] / pair["off"]["cpu_ms_per_request"] for pair in report["pairs"]]
    assert all(pair[arm]["cpu_ms_per_request"] > 0 for pair in report["pairs"] for arm in ("off", "on"))
    assert report["cpu_per_request_on_off"] == {"ratios": cpu, "median": statistics.median(cpu)}
    # Only the "on" cluster served metrics and, with the otel extra, exported spans.
    on_logs = " ".join(p.read_text() for p in (tmp_path / "logs" / "on").glob("*.log"))
    off_logs = " ".join(p.read_text() for p in (tmp_path / "logs" / "off").glob("*.log"))
    assert "metrics on http://" in on_logs and "metrics on" not in off_logs
    if report["tracing_measured"]:
        assert report["spans_exported"]["exports"] > 0 and "OTLP" not in off_logs
        # Spans per request by role: each request's Generate on coordinator and worker, no heartbeat.
        per_request = report["spans_exported"]["per_request"]
        assert per_request["coordinator"]["kvcache.v1.Coordinator/Generate"] >= 1
        assert per_request["worker"]["kvcache.v1.Worker/Generate"] >= 1
        assert "kvcache.v1.Coordinator/Heartbeat" not in per_request["coordinator"]
    scrapes = [line for line in err.splitlines() if line.startswith("metrics: ")]
    assert len(scrapes) == 2 and all(line.endswith(" scrapes, 0 failed") for line in scrapes), scrapes  # each on arm


def test_observability_cost_side_by_side_runs_both_arms_at_once_and_counts_the_common_window(tmp_path):
    # One run for two things (each costs two clusters): side by side, and a sample ratio of 0.
    code, out, err = run_bench(SMALL + ["--observability-cost", "--side-by-side", "--repeat", "1", "--json",
                                        "--requests", "400", "--duration", "4", "--trace-sample-ratio", "0",
                                        "--logs", str(tmp_path / "logs")], timeout=420)
    assert code == 0, err
    report = json.loads(out)
    if report["tracing_measured"]:
        assert "spans of 0 of the requests" in report["arms"]["on"]
        assert report["spans_exported"]["per_request"] == {}  # no request sampled, and nothing else makes spans
        on_logs = " ".join(p.read_text() for p in (tmp_path / "logs" / "on").glob("*.log"))
        assert "TraceIdRatioBased{0.0}" in on_logs  # each daemon logs its sampler
    assert report["order"].startswith("side by side") and len(report["pairs"]) == 1
    [pair] = report["pairs"]
    [level] = report["summary"]
    for name in ("no_cache", "cache"):
        off, on = (pair[arm]["levels"][0][name] for arm in ("off", "on"))
        # Duration-bound: both arms ran out of time, not of prompts, and share one window.
        assert 0 < off["window_s"] == on["window_s"] <= 4.0
        # At once, not one after the other (a pass lasts about --duration).
        assert off["arms_started_apart_s"] == on["arms_started_apart_s"] < 1.0
        assert off["requests"] < 400 and on["requests"] < 400 and off["failed"] == on["failed"] == 0
        assert level["ratios_on_off"][name] == [on["requests_per_s"] / off["requests_per_s"]]
    lines = [line for line in err.splitlines() if line.startswith("pair ")]
    assert [line.split()[2] for line in lines] == ["off:", "on:"] and all("side by side" in line for line in lines)


def test_requests_in_window_counts_a_running_request_by_its_share_and_no_failed_one():
    from kvcache.bench.observability_cost import requests_in_window
    from kvcache.bench.stats import RequestResult

    def result(start, end, error=""):
        return RequestResult("one-off", "f", True, start, start + 0.1, end, error=error)

    results = [result(0.0, 1.0), result(1.0, 3.0), result(2.0, 6.0), result(4.5, 5.0), result(0.5, 1.5, "boom")]
    # Whole, whole (it ends at the edge), half of the third (2 of its 4 s), nothing started after it.
    assert requests_in_window(results, 4.0) == 2.5


@pytest.mark.parametrize("args, message", [
    (["--observability-cost", "--metrics"], "--observability-cost starts its own two local clusters"),
    (["--trace-sample-ratio", "0.5"], "--trace-sample-ratio is for --observability-cost"),
    (["--side-by-side"], "--side-by-side is for --observability-cost"),
    (["--observability-cost", "--trace-sample-ratio", "2"], "--trace-sample-ratio must be between 0 and 1"),
    (["--concurrency", "0"], "--concurrency needs positive counts"),
    (["--mix", "1,1"], "--mix needs three shares"),
    (["--question-chars", "9,3"], "question_chars must satisfy"),
    (["--model", "tiny", "--system-chars", "2000"], "exceed the model's 1024 positions"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--blas-threads", "0"], "--blas-threads must be at least 1"),
    (["--step-logs"], "--step-logs needs --logs DIR"),
    (["--step-logs", "--logs", "x", "--coordinators", "127.0.0.1:1"], "--step-logs is for the local cluster"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be at least 1"),
    (["--max-prefill-tokens", "8", "--coordinators", "127.0.0.1:1"], "--max-prefill-tokens is for the local cluster"),
    (["--alone-prefill-tokens", "0"], "--alone-prefill-tokens must be at least 1"),
    (["--alone-prefill-tokens", "8", "--coordinators", "127.0.0.1:1"],
     "--alone-prefill-tokens is for the local cluster"),
])
def test_bad_options_are_one_line_and_exit_2(args, message):
    code, out, err = run_bench(args, timeout=60)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_plot_without_matplotlib_says_so(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "matplotlib.py").write_text("raise ImportError('hidden for this test')\n")
    process = subprocess.run(cluster_helpers.kvcache_command("bench", "load") + ["--model", "tiny", "--plot", str(tmp_path / "charts")], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(hide)})
    assert process.returncode == 2 and "pip install -e '.[bench]'" in process.stderr
    assert not (tmp_path / "charts").exists()


def test_gateway_pass_and_paired_requests(tmp_path):
    """--gateway local: a third pass through the HTTP gateway beside the gRPC ones, and the pairs of
    back-to-back requests that measure what the hop adds (figures reported, never asserted)."""
    code, out, err = run_bench(SMALL + ["--json", "--gateway", "local", "--gateway-pairs", "4"])
    assert code == 0, err
    report = json.loads(out)
    assert report["cluster"]["gateway"].startswith("http://")
    [level] = report["levels"]
    http = level["passes"]["gateway"]["summary"]
    assert http["requests"] == 6 and http["failed"] == 0, http["errors"]
    assert http["generated_tokens"] == 6 * 2 and http["ttft_ms"]["p50"] > 0
    assert http["cache_once_warm"]["total"] > 0   # the HTTP pass reports the cache like the gRPC ones
    assert level["gateway"]["ttft_p50_ms"] == http["ttft_ms"]["p50"]
    paired = report["gateway_paired"]
    assert paired["pairs"] == 4 and len(paired["added_ms_all"]) == 4
    assert paired["grpc_ttft_p50_ms"] > 0 and paired["http_ttft_p50_ms"] > 0
    assert all(math.isfinite(a) for a in paired["added_ms_all"]) and paired["goal_met"] in (True, False)
