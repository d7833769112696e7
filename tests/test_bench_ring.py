"""`kvcache bench ring` on a small trace the test writes: every figure present and in range
(figures are not asserted as timings)."""

from __future__ import annotations

import json
import subprocess
import sys

from coordinator.ring import Ring
from kvcache.bench.ring import primary, ring_shares
from trace_helpers import write_trace


def run_bench(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "ring", *options],
                          capture_output=True, text=True, timeout=120)


def test_shares_cover_the_hash_space_and_primary_agrees_with_placement():
    ring = Ring({f"n{i}:1": 2**30 for i in range(5)})
    shares = ring_shares(ring)
    assert set(shares) == set(ring.nodes) and abs(sum(shares.values()) - 1) < 1e-9
    for n in range(2000):
        assert primary(ring, f"k{n}") == ring.primary(f"k{n}")


def test_a_small_cluster_with_churn_reports_every_figure(tmp_path):
    trace = write_trace(tmp_path / "small.jsonl", requests=300)  # 250 ms apart: 75 s, so one minute of churn
    result = run_bench("--trace", str(trace), "--nodes", "3,12", "--churn", "20", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert 0 < report["single_store_hit_rate"] <= 1
    rows = {r["nodes"]: r for r in report["results"]}
    assert sorted(rows) == [3, 12]
    assert rows[12]["joins"] == 2 and rows[3]["joins"] == 0  # 20% of 12 in the first minute; 0.6 of 3 owed
    for nodes, row in rows.items():
        assert 0 <= row["hit_rate"] <= 1 and 0 <= row["hit_rate_churn"] <= 1
        assert 0 < row["moved_join"] < 1 and row["ideal_join"] == 1 / (nodes + 1)
        assert row["share_max_mean"] >= 1 and row["place_us"] > 0 and row["build_ms"] > 0
    assert set(report["goals"]) == {"share_max_mean_le_1.15_at_100_plus", "moved_join_le_1.1_ideal",
                                    "churn_20pct_within_5pct_of_static"}
    assert report["goals"]["share_max_mean_le_1.15_at_100_plus"] is None  # no size of 100+


def test_bad_options_get_one_clear_line(tmp_path):
    trace = write_trace(tmp_path / "small.jsonl", requests=20)
    for option, value in [("--nodes", "0"), ("--nodes", "ten"), ("--churn", "-1"), ("--capacity", "0"),
                          ("--replicas", "0")]:
        result = run_bench("--trace", str(trace), option, value)
        assert result.returncode == 2 and option in result.stderr and "Traceback" not in result.stderr
