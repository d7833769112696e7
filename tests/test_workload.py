"""The load bench's workload generator and statistics: deterministic, bounded, skewed as asked."""

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from kvcache.bench.stats import RequestResult, cache_shares, gain, gain_interval, percentiles, summarize_pass
from kvcache.bench.workload import WorkloadConfig, all_requests, build_workload, zipf_weights


def test_same_seed_same_workload_other_seed_other_workload():
    config = WorkloadConfig(requests=50, seed=7)
    assert build_workload(config, "t ") == build_workload(config, "t ")
    assert all_requests(build_workload(config)) != all_requests(build_workload(replace(config, seed=8)))


@pytest.mark.parametrize("requests", [1, 3, 17, 100])
def test_exactly_the_requested_count_and_lengths_within_bounds(requests):
    config = WorkloadConfig(requests=requests, seed=1, session_turns=5)
    requests_ = all_requests(build_workload(config, "abcdef.12 "))
    assert len(requests_) == requests
    longest = config.longest_prompt_chars(reply_tokens=8) + len("abcdef.12 ")
    assert all(0 < len(r.prompt) <= longest for r in requests_)
    # A whole session turn: its opening, every message so far and the replies before it.
    for job in build_workload(config, "abcdef.12 "):
        if job.requests[0].kind == "session":
            assert sum(len(t.prompt) for t in job.requests) + 8 * (len(job.requests) - 1) <= longest
    for r in requests_:
        if r.kind == "unique":
            assert config.unique_chars[0] <= len(r.prompt) - len("abcdef.12 ") <= config.unique_chars[1]
        if r.kind == "shared":
            assert len(r.prompt) >= config.system_chars


def test_every_prompt_starts_with_the_tag():
    requests = all_requests(build_workload(WorkloadConfig(requests=30), "run42.1 "))
    assert all(r.prompt.startswith("run42.1 ") for r in requests if not r.follows_reply)
    assert all(r.session_id.startswith("run42.1 ") for r in requests if r.kind == "session")


def test_sessions_extend_their_previous_turn_in_order():
    jobs = build_workload(WorkloadConfig(requests=60, seed=3, mix=(0, 1, 0), session_turns=4))
    assert len(jobs) == 15
    for job in jobs:
        turns = job.requests
        assert len(turns) == 4
        assert len({t.session_id for t in turns}) == 1 and turns[0].session_id
        assert [t.first_of_family for t in turns] == [True, False, False, False]
        assert [t.follows_reply for t in turns] == [False, True, True, True]
        assert "conversation" in turns[0].prompt
        # Later turns hold only the next message: the client sends it after the last prompt and the reply.
        assert all(t.prompt.startswith("\nUser: ") for t in turns[1:])
        assert all(t.prompt.endswith("\nAssistant:") for t in turns)
    assert len({job.requests[0].session_id for job in jobs}) == 15


def test_the_last_session_is_cut_to_the_request_count():
    jobs = build_workload(WorkloadConfig(requests=10, mix=(0, 1, 0), session_turns=4))
    assert [len(job.requests) for job in jobs] == [4, 4, 2]


def test_mix_shares_are_followed_in_requests():
    requests = all_requests(build_workload(WorkloadConfig(requests=2000, seed=5, mix=(0.6, 0.0, 0.4))))
    kinds = Counter(r.kind for r in requests)
    assert kinds["session"] == 0
    assert 0.55 < kinds["shared"] / 2000 < 0.65
    # A session brings several requests at once; the shares still count requests.
    requests = all_requests(build_workload(WorkloadConfig(requests=4000, seed=6, mix=(0.5, 0.3, 0.2), session_turns=4)))
    kinds = Counter(r.kind for r in requests)
    assert 0.45 < kinds["shared"] / 4000 < 0.55 and 0.25 < kinds["session"] / 4000 < 0.35


def test_system_prompt_popularity_is_zipf_skewed():
    config = WorkloadConfig(requests=3000, seed=11, mix=(1, 0, 0), system_prompts=5, zipf_s=1.2)
    counts = Counter(r.family for r in all_requests(build_workload(config)))
    shares = np.array([counts[f"system-{i}"] for i in range(5)]) / 3000
    assert np.all(np.diff(shares) < 0), shares  # each less popular than the one before
    assert shares[0] > 3 * shares[4]
    assert np.allclose(shares, zipf_weights(5, 1.2), atol=0.03)


def test_shared_requests_share_their_system_prompt_and_families_share_no_first_page():
    requests = all_requests(build_workload(WorkloadConfig(requests=200, seed=2), "abcdef.4 "))
    by_family = {}
    for r in requests:
        by_family.setdefault(r.family, []).append(r)
    for family, members in by_family.items():
        if family.startswith("system-"):
            assert len({m.prompt[:512] for m in members}) == 1
        assert sum(m.first_of_family for m in members) == 1 and members[0].first_of_family
    first_pages = [members[0].prompt[:16] for members in by_family.values()]
    assert len(set(first_pages)) == len(first_pages)


def test_bad_configs_are_refused():
    for bad in (dict(requests=0), dict(mix=(0, 0, 0)), dict(mix=(1, -1, 1)), dict(question_chars=(10, 5)),
                dict(session_turns=0), dict(zipf_s=-1.0)):
        with pytest.raises(ValueError):
            build_workload(WorkloadConfig(**bad))


# ---- statistics -----------------------------------------------------------------------


def test_percentiles_on_known_data():
    values = list(range(1, 101))  # 1..100
    p = percentiles(values)
    assert p == {"p50": pytest.approx(50.5), "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert percentiles([3.0, 1.0, 2.0], (0, 50, 100)) == {"p0": 1.0, "p50": 2.0, "p100": 3.0}
    assert np.isnan(percentiles([])["p50"])


def _result(kind="shared", first=False, start=0.0, ttft=0.1, end=0.5, prompt=100, local=0, remote=0, tokens=8, error=""):
    return RequestResult(kind, f"{kind}-0", first, start, start + ttft, end, prompt, local, remote, tokens, 0.0, error)


def test_cache_shares_keep_local_and_remote_apart():
    shares = cache_shares([_result(prompt=100, local=50), _result(prompt=100, remote=30)])
    assert shares == {"requests": 2, "prompt_tokens": 200, "local": 0.25, "remote": 0.15, "total": pytest.approx(0.4)}
    assert cache_shares([])["total"] == 0.0


def test_summary_rates_once_warm_and_failures():
    results = [
        _result(first=True, start=0.0, ttft=1.0, end=2.0, prompt=100),
        _result(start=1.0, ttft=0.2, end=2.0, prompt=100, local=90),
        _result(start=2.0, ttft=0.2, end=4.0, prompt=100, remote=80),
        _result(start=3.0, end=3.5, prompt=0, tokens=0, error="UNAVAILABLE: gone"),
    ]
    s = summarize_pass(results, wall_s=4.0)
    assert (s["requests"], s["failed"], s["errors"]) == (3, 1, ["UNAVAILABLE: gone"])
    assert s["requests_per_s"] == 0.75 and s["generated_tokens_per_s"] == 6.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["latency_ms"]["p50"] == pytest.approx(2000.0)  # latencies 2 s, 1 s, 2 s
    assert s["cache"]["total"] == pytest.approx(170 / 300)
    assert s["cache_once_warm"] == {"requests": 2, "prompt_tokens": 200, "local": 0.45, "remote": 0.4,
                                    "total": pytest.approx(0.85)}


def test_gain_direction():
    assert gain(with_cache=100.0, without=500.0, lower_is_better=True) == 5.0
    assert gain(with_cache=4.0, without=2.0, lower_is_better=False) == 2.0
    assert np.isnan(gain(0.0, 1.0, lower_is_better=True))


def test_gain_interval_from_redrawn_requests():
    # Constant TTFTs: every redraw gives the same 5x.
    assert gain_interval([100.0] * 20, [500.0] * 20) == (pytest.approx(5.0), pytest.approx(5.0))
    # Half the cached requests fast, half slow: the p50 jumps between the two groups as requests
    # are redrawn, so the interval spans both gains (2000/200 = 10x and 2000/1000 = 2x).
    cached = [200.0] * 20 + [1000.0] * 20
    low, high = gain_interval(cached, [2000.0] * 40)
    assert low == pytest.approx(2.0) and high == pytest.approx(10.0)
    # Mostly fast: the interval narrows to the fast group's gain.
    assert gain_interval([200.0] * 36 + [1000.0] * 4, [2000.0] * 40) == (pytest.approx(10.0), pytest.approx(10.0))
    assert gain_interval(cached, [2000.0] * 40) == gain_interval(cached, [2000.0] * 40), "seeded: the same each time"
    assert all(np.isnan(x) for x in gain_interval([], [1.0]))
