"""The chaos bench's faults: on a schedule, take one member of the local cluster down and bring it back.

Kinds: worker-kill, node-kill, coordinator-kill (SIGKILL, no goodbye) and worker-term (SIGTERM: the
worker drains, then exits). Targets rotate over the members of each role. A worker is killed while
it has requests in flight when it gets any within a few seconds. The member is started again with
its arguments on the same port (a worker or kvnode on a new port if that port cannot be had), and
the fault ends when every coordinator sees it back; one fault at a time.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from coordinator.client import Client, ClusterError
from kvcache.bench.chaoswatch import EXCUSE_AFTER_BACK_S, Downtime
from kvcache.cluster import LocalCluster
from kvcache.launch import Daemon, DaemonFailed
from worker.client import WorkerClient, WorkerError

KINDS = ("worker-kill", "node-kill", "coordinator-kill", "worker-term")
BUSY_WAIT_S = 3.0       # how long a worker fault waits for the target to have requests in flight
TERM_EXIT_S = 30.0      # a SIGTERMed worker's drain (its --grace, 10 s) plus margin; then SIGKILL
RESTART_TRIES = 3       # on the same port, before a worker or kvnode takes a new one
BACK_TIMEOUT_S = 30.0   # for every coordinator to see the restarted member


@dataclass
class Fault:
    kind: str
    target: str                  # the member's name: "worker-0"
    address: str
    at: float                    # time.time() of the signal
    in_flight: int | None = None  # a worker's running + waiting requests when signalled
    exit_code: int | None = None
    new_address: str = ""
    back_at: float | None = None  # when every coordinator saw it back
    error: str = ""              # what went wrong taking it down or bringing it back

    def downtime(self) -> Downtime:
        """While the bench excuses the coordinators for calling this member dead."""
        if self.back_at is None or self.new_address != self.address:
            return Downtime(self.address, self.at, math.inf)
        return Downtime(self.address, self.at, self.back_at + EXCUSE_AFTER_BACK_S)


class FaultInjector:
    """Runs the schedule in its own thread: the first fault after half an interval, then one per interval."""

    def __init__(self, cluster: LocalCluster, kinds: list[str], interval_s: float, down_s: float, until: float,
                 say=lambda message: None):
        self.cluster = cluster
        self.kinds = kinds
        self.interval_s = interval_s
        self.down_s = down_s
        self.until = until            # time.monotonic() after which no fault starts
        self.say = say
        self.faults: list[Fault] = []
        self.pids = [d.pid for d in cluster.daemons]  # every process started, restarts included
        self._turns: dict[str, int] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the schedule; bounded by one restart and one wait for it to come back."""
        self._stopping.set()
        self._thread.join(TERM_EXIT_S + 60.0 + BACK_TIMEOUT_S)

    def _loop(self) -> None:
        next_at = time.monotonic() + self.interval_s / 2
        for number in range(10**6):
            if self._stopping.wait(max(0.0, next_at - time.monotonic())) or time.monotonic() >= self.until:
                return
            self._inject(self.kinds[number % len(self.kinds)])
            next_at = max(next_at + self.interval_s, time.monotonic())

    def _inject(self, kind: str) -> None:
        role, how = kind.split("-")
        members = self.cluster.role(role)
        turn = self._turns.get(role, 0)
        self._turns[role] = turn + 1
        daemon = members[turn % len(members)]
        in_flight = self._wait_busy(daemon.address) if role == "worker" else None
        fault = Fault(kind, daemon.log_path.stem, daemon.address, time.time(), in_flight)
        self.faults.append(fault)
        self.say(f"fault: {kind} {fault.target} {fault.address}"
                 + (f" with {in_flight} requests in flight" if in_flight is not None else ""))
        fault.exit_code = self._take_down(daemon, how, fault)
        if self._stopping.wait(self.down_s):
            fault.error = fault.error or "not restarted: the run ended"
            return
        again = self._restart(daemon, role, fault)
        if again is not None:
            fault.new_address = again.address
            self._wait_back(role, again.address, fault)

    def _take_down(self, daemon: Daemon, how: str, fault: Fault) -> int | None:
        os.kill(daemon.pid, signal.SIGKILL if how == "kill" else signal.SIGTERM)
        try:
            return daemon.process.wait(5.0 if how == "kill" else TERM_EXIT_S)
        except subprocess.TimeoutExpired:
            fault.error = f"still running {TERM_EXIT_S:.0f}s after SIGTERM: killed"
            daemon.kill()
            return daemon.process.returncode

    def _restart(self, daemon: Daemon, role: str, fault: Fault) -> Daemon | None:
        ports = [None] * RESTART_TRIES + ([0] if role != "coordinator" else [])
        for port in ports:
            try:
                again = self.cluster.restart(daemon, port=port)
            except DaemonFailed as exc:
                fault.error = f"restart failed: {exc}"
                if self._stopping.wait(0.5):
                    return None
                continue
            self.pids.append(again.pid)
            fault.error = ""
            return again
        return None

    def _wait_back(self, role: str, address: str, fault: Fault) -> None:
        deadline = time.monotonic() + BACK_TIMEOUT_S
        pending = list(self.cluster.coordinator_addresses)
        while pending and time.monotonic() < deadline and not self._stopping.is_set():
            if self._sees_back(pending[0], role, address):
                pending.pop(0)
            else:
                self._stopping.wait(0.2)
        if not pending:
            fault.back_at = time.time()
        elif self._stopping.is_set():
            fault.error = "the run ended before every coordinator saw it back"
        else:
            fault.error = f"coordinator {pending[0]} did not see it back within {BACK_TIMEOUT_S:.0f}s"

    def _sees_back(self, coordinator: str, role: str, address: str) -> bool:
        try:
            with Client([coordinator]) as client:
                status = client.status(timeout=1.0)
        except ClusterError:
            return False
        alive = [m for m in status.members if m.alive]
        if role != "coordinator":
            return any(m.address == address for m in alive)
        roles = [m.role for m in alive]
        return (roles.count("node") >= len(self.cluster.role("node"))
                and roles.count("worker") >= len(self.cluster.role("worker")))

    def _wait_busy(self, address: str) -> int | None:
        """The worker's requests in flight, once it has any (or after BUSY_WAIT_S); None if it does not answer."""
        deadline = time.monotonic() + BUSY_WAIT_S
        in_flight = None
        with WorkerClient(address) as worker:
            while time.monotonic() < deadline and not self._stopping.is_set():
                try:
                    info = worker.info(timeout=1.0)
                except WorkerError:
                    return None
                in_flight = info.running + info.waiting
                if in_flight:
                    break
                time.sleep(0.05)
        return in_flight
