"""kvcache.launch.Daemon with no log path of its own: the temporary log goes once the daemon was
stopped cleanly (a bench that starts a node per run leaves no file behind) and stays, named in
the error, when the daemon could not start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcache.launch import Daemon, DaemonFailed


def test_a_temporary_log_is_removed_after_a_clean_stop():
    daemon = Daemon("node", ["--host", "127.0.0.1", "--port", "0", "--page-bytes", "1024", "--capacity", "64KiB"])
    try:
        log = daemon.log_path
        assert log.exists() and "listening on" in log.read_text()
    finally:
        code = daemon.stop()
    assert code == 0
    assert not log.exists()


def test_a_temporary_log_is_kept_and_named_when_the_daemon_cannot_start():
    with pytest.raises(DaemonFailed) as failed:
        Daemon("node", ["--port", "0", "--capacity", "not-a-size"], timeout_s=30.0)
    named = re.search(r"\(log: (\S+)\)", str(failed.value))
    assert named, str(failed.value)
    log = Path(named.group(1))
    try:
        assert log.exists() and "not-a-size" in log.read_text()
    finally:
        log.unlink(missing_ok=True)


def test_a_temporary_log_is_kept_when_the_work_around_the_daemon_failed():
    with pytest.raises(RuntimeError) as failed:
        with Daemon("node", ["--host", "127.0.0.1", "--port", "0", "--page-bytes", "1024",
                             "--capacity", "64KiB"]) as daemon:
            raise RuntimeError("the bench failed")
    try:
        assert daemon.log_path.exists() and "listening on" in daemon.log_path.read_text()
        if hasattr(failed.value, "__notes__"):
            assert str(daemon.log_path) in " ".join(failed.value.__notes__)
    finally:
        daemon.log_path.unlink(missing_ok=True)


def test_a_log_the_caller_named_is_left_to_the_caller(tmp_path):
    log = tmp_path / "node.log"
    with Daemon("node", ["--host", "127.0.0.1", "--port", "0", "--page-bytes", "1024", "--capacity", "64KiB"],
                log_path=log):
        pass
    assert "stopped" in log.read_text()
