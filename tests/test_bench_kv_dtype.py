"""`kvcache bench kv-dtype` on the tiny model: every part in one short run, and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcache.bench import kv_dtype
from trace_helpers import write_trace


def run_bench(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "kv-dtype", *options],
                          capture_output=True, text=True, timeout=600)


def test_a_short_run_reports_every_dtype_and_part(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", requests=120)
    result = run_bench("--model", "tiny", "--text-tokens", "96", "--trace", str(trace), "--prompt-tokens", "48",
                       "--decode-tokens", "4", "--repeats", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {row["kv_dtype"]: row for row in report["results"]}
    assert list(rows) == ["float32", "float16", "int8", "int4"]
    assert report["text_tokens"] == 96
    for row in rows.values():
        assert row["perplexity"] > 1 and 0 <= row["trace_hit_rate"] <= 1
        assert row["fill_ms"] > 0 and row["fill_socket_ms"] > 0
        assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
    ratios = report["ratios"]
    assert ratios["float32"]["perplexity_vs_float32"] == 0
    assert ratios["int8"]["pages_vs_float16"] >= 1.9 and ratios["int4"]["pages_vs_float16"] >= 3.0
    # one byte budget: more pages of a smaller dtype, never fewer hits
    assert rows["int4"]["trace_capacity_blocks"] > rows["int8"]["trace_capacity_blocks"] > rows["float16"]["trace_capacity_blocks"]
    assert rows["int4"]["trace_hit_rate"] >= rows["float16"]["trace_hit_rate"] >= rows["float32"]["trace_hit_rate"]
    assert set(report["goals"]) >= {"int8_perplexity_within_0.5%", "int4_pages_at_least_3.0x_float16",
                                    "int4_hit_rate_5_points_over_float16"}


def test_the_fixed_part_of_a_fill_is_the_intercept_of_a_line_through_float16_and_the_smaller_dtypes():
    rows = {d: {"page_bytes": b, "fill_ms": 0.5 + b / 100_000} for d, b in
            (("float32", 800_000), ("float16", 400_000), ("int8", 200_000), ("int4", 100_000))}
    rows["float32"]["fill_ms"] = 20.0  # above float16's bytes: not in the fit
    assert kv_dtype.fixed_fill_ms(rows, "fill_ms") == pytest.approx(0.5)
    assert kv_dtype.fixed_fill_ms({d: rows[d] for d in ("float16", "int4")}, "fill_ms") is None  # two points fit any line
    for d, row in rows.items():
        row.update(pages_per_gib=2**30 // row["page_bytes"])
    ratios = kv_dtype.ratios(rows)
    assert ratios["int4"]["fill_beyond_fixed_vs_float16"] == pytest.approx(0.25)
    goals = kv_dtype.goals(ratios)
    assert goals["int4_fill_beyond_fixed_in_proportion_to_bytes"] and goals["int8_fill_beyond_fixed_in_proportion_to_bytes"]
    rows["int4"]["fill_ms"] += 1.0  # int4 slower than its bytes: off the line, the goal missed
    assert not kv_dtype.goals(kv_dtype.ratios(rows))["int4_fill_beyond_fixed_in_proportion_to_bytes"]


@pytest.mark.parametrize("option,value", [("--dtypes", "int2"), ("--skip", "everything")])
def test_bad_options_get_one_clear_line(option, value):
    result = run_bench("--model", "tiny", option, value)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "kvcache bench kv-dtype: error:" in result.stderr
