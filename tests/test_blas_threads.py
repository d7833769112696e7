"""Workers that share a machine cap their BLAS threads (`--blas-threads`; the local cluster gives
each cores / workers)."""

import os
import subprocess
import sys

import pytest
from threadpoolctl import ThreadpoolController

from kvcache.cluster import default_blas_threads
from kvcache.launch import Daemon
from worker.model import blas


def _blas_threads() -> set[int]:
    return {lib.num_threads for lib in ThreadpoolController().select(user_api="blas").lib_controllers}


@pytest.fixture
def restore_blas_threads():
    before = _blas_threads()
    yield
    if before:
        blas.cap_threads(max(before))


def test_cap_holds_across_single_thread_forwards(restore_blas_threads):
    if not _blas_threads():
        pytest.skip("NumPy here links no BLAS that threadpoolctl can control")
    blas.cap_threads(3)
    assert _blas_threads() == {3}
    with blas.single_thread():
        assert _blas_threads() == {1}
    assert _blas_threads() == {3}  # back to the cap, not to BLAS's own default


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        blas.cap_threads(0)


def test_workers_share_the_cores():
    cores = default_blas_threads(1)
    assert cores >= 1
    assert default_blas_threads(2) == max(1, cores // 2)
    assert default_blas_threads(10 * cores) == 1  # (the local cluster passing it on: tests/test_cluster.py)


def test_worker_logs_its_cap(tmp_path):
    worker = Daemon("worker", ["--port", "0", "--blas-threads", "1"], log_path=tmp_path / "worker.log")
    try:
        assert "BLAS capped at 1 thread(s)" in (tmp_path / "worker.log").read_text()
    finally:
        worker.stop()


@pytest.mark.parametrize("command", [["worker", "--port", "0"], ["cluster", "up", "--run-dir", "RUN"]])
def test_zero_threads_is_refused_with_one_line(tmp_path, command):
    command = [str(tmp_path / "run") if part == "RUN" else part for part in command]
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", *command, "--blas-threads", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--blas-threads must be at least 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "cluster.json").exists()


def test_forced_threads_hold_for_small_forwards_too(restore_blas_threads):
    if not _blas_threads():
        pytest.skip("NumPy here links no BLAS that threadpoolctl can control")
    blas.cap_threads(1)
    with blas.forced_threads(2):
        with blas.threads_for_rows(1), blas.attention_threads(1000):
            assert _blas_threads() == {2}  # neither a small forward nor attention drops to one
    assert _blas_threads() == {1}
    with blas.threads_for_rows(1):
        assert _blas_threads() == {1}


def test_the_command_line_quiets_openblas_idle_threads_before_numpy_loads():
    """`kvcache` sets OpenBLAS's thread timeout for itself and the daemons it starts (a value
    given in the environment wins), and numpy is not loaded before it does."""
    probe = ("import os, sys\nfrom kvcache import cli\nassert 'numpy' not in sys.modules\n"
             "try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
             "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    quiet = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    given = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                           env={**env, "OPENBLAS_THREAD_TIMEOUT": "20"})
    assert quiet.returncode == 0 and given.returncode == 0, quiet.stderr + given.stderr
    assert quiet.stdout.split()[-1] == "4" and given.stdout.split()[-1] == "20"
