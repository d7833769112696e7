"""`kvcache bench remote` runs end to end on the tiny model and reports all three paths; figures are not asserted."""

import json
import subprocess
import sys

import pytest


def test_bench_remote_short_run_reports_cold_remote_and_local():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "remote", "--model", "tiny", "--prompt-tokens", "100",
         "--repeats", "1", "--layerwise-fill", "--json"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert set(report["ttft_ms"]) == {"cold", "warm_remote", "warm_local"}
    assert all(v > 0 for v in report["ttft_ms"].values())
    assert report["cached_tokens_remote"] == 96  # six full pages of 16; the last is computed for its logits
    assert report["kv_bytes_fetched"] == 6 * report["page_bytes"]
    assert 0 < report["fill_ms"] <= report["ttft_ms"]["warm_remote"]  # the fill is part of that TTFT
    # The breakdown: only the remote run has a fill, and every phase lies inside the TTFT it is part of.
    remote, local = report["phases_ms"]["warm_remote"], report["phases_ms"]["warm_local"]
    assert set(remote) == {"lookup", "to_fill", "fill", "to_forward", "forward", "to_token", "ttft"}
    assert set(local) == {"lookup", "to_forward", "forward", "to_token", "ttft"}
    for phases in (remote, local):
        assert all(phases[key] <= phases["ttft"] for key in phases)
        assert phases["forward"] > 0
    assert report["options"]["layerwise_fill"] is True  # asked for: the overlapped path runs end to end
    assert set(report["layerwise"]) == {"early_joins", "unjoined", "layer_waits", "discarded"}


@pytest.mark.parametrize("tokens, message", [("5000", "exceeds the model's"), ("16", "leaves no full page to fetch"),
                                             ("8", "leaves no full page to fetch")])
def test_bench_remote_refuses_a_prompt_too_long_for_the_model_or_too_short_to_fetch(tokens, message):
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "remote", "--model", "tiny", "--prompt-tokens", tokens],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "--prompt-tokens" in result.stderr and message in result.stderr and "Traceback" not in result.stderr
