"""`kvcache bench node` runs end to end (tiny sizes) and reports what it promises; figures are not asserted."""

import json
import subprocess
import sys


def test_bench_node_short_run_reports_both_sides():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "node", "--batches", "3", "--warmup", "1",
         "--pages-per-batch", "3", "--page-bytes", "5000", "--index-sizes", "64,640", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    transfer = report["transfer"]
    assert transfer["page_bytes"] == 5000 and transfer["batch_bytes"] == 15000
    for side in ("node_shared", "node_unix", "node", "node_grpc", "socket"):  # "node": over its data plane by TCP
        for op in ("get", "put"):
            figures = transfer[side][op]
            assert figures["gb_per_s"] > 0 and 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert [r["cached_pages"] for r in report["lookup"]] == [64, 640]
    assert report["machine"]["cpus"] >= 1


def test_bench_node_rejects_bad_options():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "node", "--index-sizes", "many"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--index-sizes" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
