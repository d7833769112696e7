"""Start a kvcache daemon as a child process and learn its address from the line it prints.

Every daemon prints "... listening on HOST:PORT ..." once it serves; with --port 0 that
line is the only way to know the port. Used by benches, `cluster up` and tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

_LISTENING = re.compile(r"listening on (\S+:\d+)")
_METRICS = re.compile(r"metrics on (https?://\S+/metrics)")  # logged before the listening line (--metrics-port)


class DaemonFailed(RuntimeError):
    pass


class Daemon:
    """A running `kvcache <role> ...` child; `stop()` ends it by its own pid.

    Its stdout and stderr go to `log_path` (a temporary file when not given), never to a
    pipe, so the child keeps running safely after this process is gone (cluster --detach).
    A temporary log is removed once the daemon was stopped and exited cleanly, and kept (its
    path in the error) when the daemon failed to start, exited with an error, or the `with`
    block around it raised: a bench that starts a node per run leaves nothing behind unless
    there is something to read.
    """

    def __init__(self, role: str, args: Sequence[str], log_path: Path | None = None, timeout_s: float = 60.0, env=None,
                 prefix: Sequence[str] = (), cwd: Path | None = None, wait: bool = True):
        """`prefix`: a command that runs the daemon and execs it, keeping its pid (tests' `ip netns
        exec NAME`, so a member runs on a host address of its own); `cwd`: the folder it runs in
        (default this process's). `wait=False` returns once the child runs, its address None until
        `started()`: several daemons then start at once."""
        self.role = role
        self.args = list(args)  # so a member can be started again as it was (LocalCluster.restart)
        self._temporary_log = log_path is None
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix=f"kvcache-{role}-", suffix=".log")
            os.close(handle)
            log_path = Path(name)
        self.log_path = Path(log_path)
        with open(self.log_path, "ab") as log:
            self._start_offset = log.tell()
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kvcache.cli", role, *args],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,  # Ctrl-C in the parent's terminal does not reach it; we stop it ourselves
            )
        self.pid = self.process.pid
        self.metrics_url: str | None = None  # http://HOST:PORT/metrics when started with --metrics-port
        self.address: str | None = None
        self._deadline = time.monotonic() + timeout_s
        if wait:
            try:
                self.started()
            except BaseException:  # an interrupt while it starts: nobody else knows this child yet
                self.stop()
                raise

    def started(self) -> str:
        """Its address, once it serves (at once after the first time); DaemonFailed, the child
        stopped, if it exits or the start's timeout passes first."""
        if self.address is None:
            self.address = self._wait_for_address(max(0.0, self._deadline - time.monotonic()))
        return self.address

    def _wait_for_address(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log_path, "rb") as log:
                log.seek(self._start_offset)
                text = log.read().decode(errors="replace")
            match = _LISTENING.search(text)
            if match:
                metrics = _METRICS.search(text)
                self.metrics_url = metrics.group(1) if metrics else None
                return match.group(1)
            if self.process.poll() is not None or time.monotonic() > deadline:
                self._temporary_log = False  # the error below sends the reader to it
                self.stop()
                tail = " | ".join(text.strip().splitlines()[-3:])
                raise DaemonFailed(
                    f"kvcache {self.role} did not start (exit code {self.process.returncode}): {tail or 'no output'} "
                    f"(log: {self.log_path})"
                )
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; returns the exit code."""
        if self.process.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(5.0)
            except ProcessLookupError:
                pass
        if self.process.returncode == 0:
            self._remove_temporary_log()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the way tests make a member die without a goodbye."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait(5.0)
            self._remove_temporary_log()  # killed on purpose: nothing went wrong to read about

    def _remove_temporary_log(self) -> None:
        if self._temporary_log:
            self._temporary_log = False
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is not None and self._temporary_log:  # whatever failed, its log may say why: kept, and named
            self._temporary_log = False
            if hasattr(exc, "add_note"):  # Python 3.11
                exc.add_note(f"kvcache {self.role}'s log: {self.log_path}")
        self.stop()
