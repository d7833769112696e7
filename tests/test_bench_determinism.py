"""`kvcache bench determinism`: a short run covers every way of computing a request, with and
without invariant numerics; with them no answer's logits differ in any bit, and the cost table
compares both engines."""

import json
import subprocess
import sys


def test_a_short_run_reports_every_comparison_and_the_cost():
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "determinism", "--tokens", "6", "--prompts",
                           "1", "--cuts", "1", "--chunks", "16", "--batches", "3", "--cost-repeats", "1",
                           "--cost-prompt-tokens", "64", "--json"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    runs = {"resumed after k tokens", "prompt in chunks of 16", "beside 2 random neighbours",
            "prefix from the local cache", "prefix from a kvnode"}
    answers = {(a["numerics"], a["kv_dtype"], a["mode"], a["run"]): a for a in result["answers"]}
    assert set(answers) == {(n, kv, m, r) for n in ("invariant", "fast") for kv in ("float32", "float16")
                            for m in ("greedy", "seeded") for r in runs}
    for (numerics, *_), a in answers.items():
        assert a["requests"] == 1
        if numerics == "invariant":
            assert a["tokens_differing"] == a["logits_differing"] == 0 and a["max_logit_difference"] == 0, a
    assert [d["batch"] for d in result["cost"]["decode"]] == [1, 8]
    assert result["cost"]["prefill"]["prompt_tokens"] == 64 and result["cost"]["prefill"]["cost"] > 0


def test_bad_options_are_one_line():
    for bad in (["--tokens", "1"], ["--chunks", "a,b"], ["--batches", "0"]):
        done = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "determinism", *bad],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and bad[0] in done.stderr, done.stderr
