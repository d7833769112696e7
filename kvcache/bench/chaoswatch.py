"""Who the coordinators declared dead during a chaos run, and which of those the bench had killed.

Two sources: each coordinator's ClusterStatus, polled (alive=False), and its log's "missed its
heartbeats" lines (a member marked dead and back between two polls shows only there). A member
seen dead is excused while a fault had it down: from its kill until a few seconds after every
coordinator saw it back (a member restarted on another port is excused for good: its old
address stays dead in the coordinators' lists).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from coordinator.client import Client, ClusterError

POLL_INTERVAL_S = 0.5
EXCUSE_AFTER_BACK_S = 3.0
_MISSED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*?\b(node|worker) (\S+) missed its heartbeats")
_RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*\(request \S+, ([1-9]\d*) tokens sent\)")


@dataclass(frozen=True)
class DeadSighting:
    at: float            # time.time()
    coordinator: str     # its address (status) or its log's name (log)
    role: str
    address: str
    source: str          # "status" or "log"


@dataclass(frozen=True)
class Downtime:
    """A member the bench took down: excused from `start` to `end` (time.time())."""

    address: str
    start: float
    end: float


class StatusWatcher:
    """Polls every coordinator's ClusterStatus until stopped; keeps each member seen not alive."""

    def __init__(self, coordinators: list[str]):
        self.coordinators = coordinators
        self.sightings: list[DeadSighting] = []
        self.polls = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10.0)

    def _loop(self) -> None:
        clients = {a: Client([a], timeout=5.0) for a in self.coordinators}
        try:
            while not self._stopping.wait(POLL_INTERVAL_S):
                for address, client in clients.items():
                    try:
                        status = client.status(timeout=1.0)
                    except ClusterError:
                        continue  # a coordinator down (killed by the bench) or too busy to answer
                    self.polls += 1
                    now = time.time()
                    self.sightings += [DeadSighting(now, address, m.role, m.address, "status")
                                       for m in status.members if not m.alive]
        finally:
            for client in clients.values():
                client.close()


def log_sightings(logs: list[Path], since: float) -> list[DeadSighting]:
    """The "missed its heartbeats" lines of the coordinators' logs written after `since` (time.time())."""
    return [DeadSighting(at, path.stem, match.group(3), match.group(4), "log")
            for path, at, match in _log_lines(logs, _MISSED, since)]


def resumed_streams(logs: list[Path], since: float) -> int:
    """Streams a coordinator resumed on another worker after some tokens (its "N tokens sent" lines):
    shows the faults hit requests mid-stream. Resumes by the client (a coordinator died) are not logged."""
    return sum(1 for _ in _log_lines(logs, _RESUMED, since))


def _log_lines(logs: list[Path], pattern: re.Pattern, since: float):
    """(log, time.time() of the line, match) for the lines matching `pattern` written after `since`."""
    for path in logs:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            match = pattern.match(line)
            if not match:
                continue
            at = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
            if at >= since:
                yield path, at, match


def wrongly_dead(sightings: list[DeadSighting], downtimes: list[Downtime]) -> list[DeadSighting]:
    """Sightings of members the bench did not have down at the time, earliest first."""
    def excused(s: DeadSighting) -> bool:
        return any(d.address == s.address and d.start - 1.0 <= s.at <= d.end for d in downtimes)

    return sorted((s for s in sightings if not excused(s)), key=lambda s: s.at)
