"""Who is in the cluster: kvnodes and workers register, heartbeat, and are marked dead
after a few missed beats. Plain Python with an injectable clock; knows nothing of gRPC.

A member is identified by the id it registered with (a restart registers anew, with a
new id); a beat from an id the coordinator does not know (it restarted, or declared the
member gone long ago) is answered "unknown" so the member registers again.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from coordinator.ring import Ring

NODE, WORKER = "node", "worker"
HEARTBEAT_INTERVAL_S = 1.0
DEAD_AFTER_S = 4.0  # three missed beats and some slack: a busy machine delays beats by over 2 s
FORGET_AFTER_S = 300.0


@dataclass
class Member:
    member_id: str
    role: str
    address: str
    capacity_bytes: int = 0  # kvnodes: pool size, the ring weight
    page_bytes: int = 0
    model: str = ""  # workers
    fingerprint: str = ""
    last_beat: float = 0.0
    alive: bool = True
    load: dict = field(default_factory=dict)  # the last beat's figures (pages used, running requests ...)


class Membership:
    def __init__(self, clock: Callable[[], float] = time.monotonic, dead_after_s: float = DEAD_AFTER_S):
        self.clock = clock
        self.dead_after_s = dead_after_s
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()  # one ring build at a time, outside self._lock
        self._ring = Ring({})

    def register(self, role: str, address: str, capacity_bytes: int = 0, page_bytes: int = 0,
                 model: str = "", fingerprint: str = "") -> Member:
        if role not in (NODE, WORKER):
            raise ValueError(f"role must be {NODE!r} or {WORKER!r}, got {role!r}")
        if not address:
            raise ValueError("a member must give the address it serves on")
        if role == NODE and capacity_bytes <= 0:
            raise ValueError(f"a kvnode must give its capacity in bytes, got {capacity_bytes}")
        with self._lock:
            # The same address registering again is a restart: the old identity is gone.
            for old_id in [m.member_id for m in self._members.values() if m.address == address and m.role == role]:
                del self._members[old_id]
            member = Member(uuid.uuid4().hex[:12], role, address, capacity_bytes, page_bytes, model, fingerprint,
                            last_beat=self.clock())
            self._members[member.member_id] = member
        self._refresh_ring()
        return member

    def heartbeat(self, member_id: str, load: dict | None = None) -> bool:
        """Record a beat; False if the id is unknown (the member should register again)."""
        with self._lock:
            member = self._members.get(member_id)
            if member is None:
                return False
            member.last_beat = self.clock()
            if load is not None:
                member.load = dict(load)
            revived = not member.alive
            member.alive = True
        if revived:
            self._refresh_ring()
        return True

    def deregister(self, member_id: str) -> Member | None:
        """A member leaving on purpose: forget it now (it leaves the ring); None if unknown."""
        with self._lock:
            member = self._members.pop(member_id, None)
        if member is not None:
            self._refresh_ring()
        return member

    def sweep(self) -> list[Member]:
        """Mark members that missed their beats dead (and forget long-dead ones); returns the newly dead."""
        now = self.clock()
        newly_dead = []
        with self._lock:
            for member_id, member in list(self._members.items()):
                silent = now - member.last_beat
                if member.alive and silent > self.dead_after_s:
                    member.alive = False
                    newly_dead.append(member)
                elif not member.alive and silent > FORGET_AFTER_S:
                    del self._members[member_id]
        if newly_dead:
            self._refresh_ring()
        return newly_dead

    def mark_dead(self, address: str) -> None:
        """A caller saw this member fail (e.g. a worker dropped a stream): stop routing to it until it beats."""
        with self._lock:
            changed = False
            for member in self._members.values():
                if member.address == address and member.alive:
                    member.alive, member.last_beat, changed = False, self.clock() - self.dead_after_s, True
        if changed:
            self._refresh_ring()

    def members(self) -> list[Member]:
        with self._lock:
            return sorted(self._members.values(), key=lambda m: (m.role, m.address))

    def live(self, role: str) -> list[Member]:
        with self._lock:
            return [m for m in self._members.values() if m.role == role and m.alive]

    @property
    def ring(self) -> Ring:
        """The ring over the live kvnodes (replaced, never mutated, on every change)."""
        return self._ring

    def _refresh_ring(self) -> None:
        """Build the ring for the live kvnodes as they are now, outside self._lock: a build takes
        seconds at 1,000 nodes, and heartbeats must not wait for it. Builds run one at a time and
        each reads the newest view, so the last one to finish matches the members."""
        with self._build_lock:
            with self._lock:
                nodes = {m.address: m.capacity_bytes for m in self._members.values() if m.role == NODE and m.alive}
            if nodes != self._ring.nodes:
                self._ring = Ring(nodes)
