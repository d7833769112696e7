"""`kvcache bench overlap` runs end to end on the tiny model and reports both modes; figures are not asserted."""

import json
import subprocess
import sys


def test_bench_overlap_short_run_reports_both_modes():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "overlap", "--model", "tiny", "--prompt-tokens", "100",
         "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert set(report["ms"]) == {"sequential", "at_once"}
    for mode in report["ms"].values():
        assert set(mode) == {"wall", "fill", "forward", "forward_cpu", "fill_cpu", "node_cpu"}
        assert mode["fill"] > 0 and mode["forward"] > 0
    sequential = report["ms"]["sequential"]
    assert sequential["wall"] >= sequential["fill"] + sequential["forward"]  # one after the other: they add up


def test_bench_overlap_refuses_a_prompt_of_one_page():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "overlap", "--model", "tiny", "--prompt-tokens", "16"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "more than a page" in result.stderr
