"""`kvcache bench eviction`: the trace generator, and a tiny end-to-end run (figures are not asserted as timings)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys

import pytest

from kvcache.bench import eviction
from kvcache.bench.prefix_trace import TraceConfig, generate, working_set_pages
from kvcache.bench.report import progress
from kvnode.eviction import NODE_POLICIES, POLICIES

SMALL = TraceConfig(requests=120, seed=5)


def test_trace_is_the_same_for_a_seed_and_differs_across_seeds():
    assert generate(SMALL) == generate(SMALL)
    assert generate(SMALL) != generate(TraceConfig(requests=120, seed=6))


def test_trace_is_bounded_and_made_of_whole_pages():
    trace = generate(SMALL)
    assert len(trace) == SMALL.requests
    longest = max(SMALL.max_prompt_tokens, SMALL.system_tokens[1] + SMALL.user_tokens[1], SMALL.one_off_tokens[1])
    for request in trace:
        assert 0 < request.prompt_tokens <= longest
        assert len(request.keys) == request.prompt_tokens // SMALL.page_tokens
        assert all(len(k) == 16 for k in request.keys)
    assert working_set_pages(trace) <= sum(len(r.keys) for r in trace)


def test_trace_shares_prefixes_as_a_chat_service_sees_them():
    trace = generate(SMALL)
    kinds = {r.kind for r in trace}
    assert kinds == {"new", "turn", "one-off"}
    for n, request in enumerate(trace):
        earlier = trace[:n]
        if request.kind == "turn":  # extends an earlier turn of its conversation: all its full pages, then more
            assert any(len(e.keys) < len(request.keys) and request.keys[:len(e.keys)] == e.keys
                       for e in earlier if e.kind != "one-off")
        if request.kind == "one-off":  # shares nothing with any other request
            others = {k for other in trace if other is not request for k in other.keys}
            assert not others & set(request.keys)
    firsts = [r.keys[0] for r in trace if r.kind == "new"]
    assert len(set(firsts)) < len(firsts) <= len(set(firsts)) * 20  # popular system prompts repeat
    assert len(set(firsts)) <= SMALL.system_prompts


def run_bench(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "eviction", *options],
                          capture_output=True, text=True, timeout=120)


def test_short_run_reports_every_policy_and_capacity():
    result = run_bench("--requests", "80", "--seed", "2", "--capacities", "20,100", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["machine"]["cpus"] >= 1 and report["versions"]["kvcache"]
    assert report["options"]["requests"] == 80
    rows = {(r["capacity_percent"], r["policy"]): r for r in report["results"]}
    assert set(rows) == {(c, p) for c in (20, 100) for p in POLICIES}
    working_set = report["trace"]["working_set_pages"]
    for (percent, policy), row in rows.items():
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert row["capacity_pages"] == round(working_set * percent / 100)
    for percent in (20, 100):
        for policy in NODE_POLICIES:  # the node's policies never orphan a page
            assert rows[(percent, policy)]["orphans_peak"] == 0
    at_full = [rows[(100, p)] for p in POLICIES]
    assert all(r["evictions"] == 0 and r["orphans_peak"] == 0 for r in at_full)
    assert len({r["hit_rate"] for r in at_full}) == 1 and at_full[0]["hit_rate"] > 0
    assert rows[(20, "lru")]["evictions"] > 0  # the small pool was under pressure
    assert rows[(20, "prefix-lru")]["hit_rate"] <= at_full[0]["hit_rate"]


def test_table_shows_the_baseline_ratio():
    result = run_bench("--requests", "30", "--capacities", "50", "--policies", "prefix-aware,fifo")  # the old name
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("capacity"))
    assert "vs fifo" in header and "orphans peak" in header
    assert sum(1 for line in result.stdout.splitlines() if line.startswith("50%")) == 3  # and belady-min


@pytest.mark.parametrize("option, value", [
    ("--capacities", "0,50"), ("--capacities", "ten"), ("--capacities", "150"),
    ("--policies", "lru,mru"), ("--policies", "lru,lru"), ("--requests", "0"),
])
def test_bad_options_get_one_clear_line(option, value):
    result = run_bench(option, value)
    assert result.returncode == 2
    assert option in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def bench_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    eviction.add_arguments(parser)
    args = parser.parse_args(["--requests", "20", "--capacities", "50,100", "--json"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_plot_says_clearly_when_matplotlib_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert eviction.run(bench_args(plot=str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "[bench]" in err
    assert list(tmp_path.iterdir()) == []


def test_plot_draws_hit_rate_and_orphan_charts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert eviction.run(bench_args(plot=str(tmp_path / "charts"))) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in (tmp_path / "charts").iterdir()) == ["eviction_hit_rate.png", "eviction_orphans.png"]
    for path in report["charts"]:
        with open(path, "rb") as png:
            assert png.read(8) == b"\x89PNG\r\n\x1a\n"


def test_progress_yields_every_item_and_prints_a_line_each_off_a_terminal():
    out = io.StringIO()
    assert list(progress(["a", "b", "c"], "replaying", out=out)) == ["a", "b", "c"]
    assert out.getvalue().splitlines() == ["replaying: 1/3", "replaying: 2/3", "replaying: 3/3"]
