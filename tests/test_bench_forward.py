"""`kvcache bench forward` runs on the tiny model, with the engine's threads and forced ones; figures are not asserted."""

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("threads", [[], ["--threads", "2"]])
def test_bench_forward_reports_each_row_count(threads):
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "forward", "--model", "tiny", "--context", "64",
         "--rows", "1,16", "--repeats", "2", "--json", *threads],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert set(report["ms"]) == {"1", "16"}
    assert all(v["thread_cpu"] > 0 and v["wall"] > 0 for v in report["ms"].values())
    assert report["blas_threads"] == (2 if threads else "engine")


@pytest.mark.parametrize("option", [["--rows", "0"], ["--rows", "a"], ["--context", "16", "--rows", "16"],
                                    ["--threads", "0"]])
def test_bench_forward_refuses_bad_options_with_one_line(option):
    result = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "forward", "--model", "tiny", *option],
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert "error:" in result.stderr and "Traceback" not in result.stderr
