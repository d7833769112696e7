"""`kvcache bench engine` runs end to end (tiny model, short prompts) and reports both sides; figures are not asserted."""

import json
import subprocess
import sys


def test_bench_engine_short_run_reports_engine_and_dense():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "engine", "--model", "tiny", "--prompt-tokens", "48",
         "--decode-context", "16", "--decode-tokens", "2", "--batch", "2", "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"] == "tiny"
    assert report["prefill"]["engine_tokens_per_s"] > 0 and report["prefill"]["dense_tokens_per_s"] > 0
    assert [d["batch"] for d in report["decode"]] == [1, 2]
    assert all(d["engine_tokens_per_s"] > 0 and d["dense_tokens_per_s"] > 0 for d in report["decode"])
    ttft = report["ttft"]
    assert ttft["cached_tokens"] == 32 and ttft["cold_ms"] > 0 and ttft["warm_ms"] > 0


def test_bench_engine_rejects_bad_options():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "engine", "--model", "tiny", "--prompt-tokens", "4000"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "exceed the model's 1024 positions" in result.stderr
