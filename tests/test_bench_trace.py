"""The trace reader (Mooncake's format) and Belady's MIN, the bound beside the eviction bench's policies."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.bench.belady import belady
from kvcache.bench.mooncake_trace import TraceError, TraceRequest, infinite_cache_hits, page_key, read_trace, unique_pages
from kvnode.eviction import NODE_POLICIES, POLICIES
from trace_helpers import write_trace


def test_reads_blocks_keys_and_the_partial_last_block(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]}\n\n'
                    '{"timestamp": 40, "input_length": 512, "output_length": 1, "hash_ids": [7]}\n')
    first, second = read_trace(path)
    assert first == TraceRequest(0, (page_key(7), page_key(8), page_key(9)), (512, 512, 76), 1100)
    assert second.keys == (page_key(7),) and second.block_tokens == (512,)
    assert len(page_key(7)) == 16
    assert unique_pages([first, second]) == 3
    assert infinite_cache_hits([first, second]) == (1, 512)


@pytest.mark.parametrize("line, complaint", [
    ("not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"timestamp": 0, "input_length": 10}', "no 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": []}', "non-empty list"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [-1]}', "non-negative"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1, 1]}', "repeats"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1, 2]}', "does not fill 2 blocks"),
    ('{"timestamp": -5, "input_length": 10, "hash_ids": [1]}', "timestamp"),
])
def test_a_bad_line_is_named_with_its_number(tmp_path, line, complaint):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{complaint}"):
        read_trace(path)


def test_an_empty_or_missing_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no request"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")


# ---- Belady's MIN against every choice, on small traces ----------------------------------


def best_hits(uses: tuple[bytes, ...], capacity: int) -> int:
    """The most hits any cache of `capacity` gets on `uses`: every choice tried (keep or not, which to evict)."""

    @functools.lru_cache(maxsize=None)
    def best(position: int, cached: frozenset) -> int:
        if position == len(uses):
            return 0
        key = uses[position]
        if key in cached:
            return 1 + best(position + 1, cached)
        options = [best(position + 1, cached)]  # not stored
        if len(cached) < capacity:
            options.append(best(position + 1, cached | {key}))
        else:
            options += [best(position + 1, (cached - {victim}) | {key}) for victim in cached]
        return max(options)

    return best(0, frozenset())


def tree_requests(chains: list[list[int]]) -> list[TraceRequest]:
    """Requests whose ids name their whole prefix: id = the path's tuple, numbered."""
    numbers: dict[tuple, int] = {}
    requests = []
    for chain in chains:
        path, keys = (), []
        for step in chain:
            path += (step,)
            keys.append(page_key(numbers.setdefault(path, len(numbers))))
        requests.append(TraceRequest(0, tuple(keys), (512,) * len(keys), 512 * len(keys)))
    return requests


@settings(max_examples=150, deadline=None)
@given(chains=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=3), min_size=1, max_size=6),
       capacity=st.integers(1, 3))
def test_belady_hits_as_many_blocks_as_the_best_choices_and_as_prefixes(chains, capacity):
    requests = tree_requests(chains)
    found = belady(requests, capacity)
    uses = tuple(key for request in requests for key in request.keys)
    assert found["any_hit_blocks"] == best_hits(uses, capacity)
    assert found["hit_blocks"] == found["any_hit_blocks"]  # ids name their prefix (belady.py's docstring)
    assert found["hit_tokens"] == 512 * found["hit_blocks"]


# ---- the bench on a trace the test writes ---------------------------------------------------


def run_bench(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "eviction", *options],
                          capture_output=True, text=True, timeout=120)


def test_trace_replay_reports_every_policy_under_its_bound(tmp_path):
    trace = write_trace(tmp_path / "small.jsonl", requests=300)
    result = run_bench("--trace", str(trace), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["trace"]["file"] == "small.jsonl" and report["trace"]["requests"] == 300
    infinite = report["trace"]["infinite_block_hit_rate"]
    assert 0 < infinite < 1
    bounds = {b["capacity_percent"]: b for b in report["bounds"]}
    assert sorted(bounds) == [5, 10, 20, 40]
    rows = {(r["capacity_percent"], r["policy"]): r for r in report["results"]}
    assert set(rows) == {(c, p) for c in bounds for p in POLICIES}
    for (percent, policy), row in rows.items():
        assert row["capacity_pages"] == round(report["trace"]["working_set_pages"] * percent / 100)
        assert 0 <= row["block_hit_rate"] <= bounds[percent]["block_hit_rate"] <= infinite  # no policy passes MIN
        assert 0 <= row["of_belady"] <= 1 and 0 <= row["of_infinite"] <= 1
        assert 0 <= row["hit_rate"] <= 1
        if policy in NODE_POLICIES:
            assert row["orphans_peak"] == 0
    assert report["goal"]["best"] in NODE_POLICIES and isinstance(report["goal"]["met"], bool)


def test_trace_table_shows_the_bound_and_the_goal(tmp_path):
    trace = write_trace(tmp_path / "small.jsonl", requests=120, seed=3)
    result = run_bench("--trace", str(trace), "--capacities", "10", "--policies", "prefix-lru,prefix-arc")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any("belady-min (offline)" in line for line in lines)
    assert any(line.startswith("goal: ") and "prefix-arc" in line for line in lines)
    assert "of MIN" in next(line for line in lines if line.startswith("capacity"))


def test_a_bad_trace_gets_one_clear_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    result = run_bench("--trace", str(bad))
    assert result.returncode == 2
    assert "--trace" in result.stderr and "bad.jsonl:1" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cost_times_every_policy_at_each_size():
    quick = ["--cost", "--cost-pages", "40,400", "--cost-requests", "2000"]
    result = run_bench(*quick, "--policies", "prefix-lru,prefix-lfu", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["results"]
    assert {(r["policy"], r["pages"]) for r in rows} == {(p, n) for p in ("prefix-lru", "prefix-lfu") for n in (40, 400)}
    assert all(r["us_per_page_op"] > 0 and r["us_per_page_op_gc_paused"] > 0 for r in rows)
    assert report["options"]["timed_requests"] == 2000
    table = run_bench(*quick, "--policies", "prefix-lru")
    assert table.returncode == 0 and "gc paused at 400" in table.stdout, table.stderr
    bad = run_bench("--cost", "--cost-pages", "ten")
    assert bad.returncode == 2 and "--cost-pages" in bad.stderr
    bad = run_bench("--cost", "--cost-requests", "0")
    assert bad.returncode == 2 and "--cost-requests" in bad.stderr
