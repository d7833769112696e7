"""`kvcache bench determinism`: a short run gives its counts and the cost table, and a greedy
request resumed after k tokens answers as the uninterrupted one (a broken resume would differ)."""

import json
import subprocess
import sys


def test_a_short_run_reports_every_comparison_and_the_cost_of_row_invariant_products():
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "determinism", "--tokens", "12", "--cuts",
                           "2", "--json"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    answers = {(a["mode"], a["run"]): a for a in result["answers"]}
    assert set(answers) == {(m, r) for m in ("seeded", "greedy") for r in ("resumed after k tokens", "in batches of 6")}
    assert answers[("greedy", "resumed after k tokens")] == {"mode": "greedy", "run": "resumed after k tokens",
                                                             "requests": 12, "differing": 0}
    assert all(0 <= a["differing"] <= a["requests"] for a in answers.values())
    assert [c["rows"] for c in result["row_invariant_products"]] == [1, 4, 16, 128]


def test_bad_options_are_one_line():
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "determinism", "--tokens", "1"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--tokens" in done.stderr
