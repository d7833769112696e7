"""`make demo`'s program runs end to end, shows cache hits, and leaves no process behind."""

import re
import subprocess
import sys
from pathlib import Path


def test_demo_runs_shows_cache_hits_and_stops_everything():
    result = subprocess.run([sys.executable, "-m", "kvcache.demo"], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "from kvnodes" in out and "chat turn 3" in out and out.rstrip().endswith("done")
    rows = [line.split() for line in out.splitlines() if line.startswith(("system prompt", "chat turn"))]
    assert len(rows) == 8
    local_and_remote = [int(r[-3]) + int(r[-2]) for r in rows[1:]]
    assert all(n > 0 for n in local_and_remote), out
    logs = Path(re.search(r"logs in (\S+)", out).group(1))
    daemon_logs = sorted(logs.glob("*.log"))
    assert len(daemon_logs) == 7
    for log in daemon_logs:  # every daemon got to its orderly end
        assert log.read_text().rstrip().endswith("stopped"), log
