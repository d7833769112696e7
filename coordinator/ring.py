"""Placement: a consistent-hash ring over the live kvnodes (uhashring), weighted by capacity.

The ring is a pure function of the live-node set, so coordinators with the same view
place alike. It is never mutated: a membership change builds a new Ring, and callers
swap the reference (uhashring mutates in place without locks).
"""

from __future__ import annotations

import hashlib
from typing import Mapping

from uhashring import HashRing

# Virtual nodes per GiB of pool: enough points that with equal capacities no node
# holds much more than its share (measured in tests/test_ring.py), few enough to build fast.
VNODES_PER_GIB = 320
MIN_VNODES, MAX_VNODES = 40, 20_000
DEFAULT_PREFIX_CHARS = 64


def vnodes_for(capacity_bytes: int) -> int:
    return max(MIN_VNODES, min(MAX_VNODES, round(VNODES_PER_GIB * capacity_bytes / 2**30)))


def epoch_of(nodes: Mapping[str, int]) -> str:
    """Digest of the sorted live-node set (address and capacity): equal views, equal epochs."""
    text = "\n".join(f"{address} {capacity}" for address, capacity in sorted(nodes.items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def placement_key(prompt: str, session_id: str = "", prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The session id when given, else a digest of the prompt's first characters (never tokenized)."""
    if session_id:
        return "session:" + session_id
    return hashlib.blake2b(prompt[:prefix_chars].encode(), digest_size=16).hexdigest()


class Ring:
    """Immutable ring over `nodes`: address -> capacity in bytes."""

    def __init__(self, nodes: Mapping[str, int]):
        self.nodes = dict(nodes)
        self.epoch = epoch_of(self.nodes)
        config = {address: {"vnodes": vnodes_for(capacity)} for address, capacity in self.nodes.items()}
        self._ring = HashRing(nodes=config) if config else None

    def placement(self, key: str, replicas: int) -> list[str]:
        """The `replicas` distinct nodes that follow `key` on the ring (fewer if fewer are live)."""
        if self._ring is None or replicas < 1:
            return []
        return [conf["nodename"] for conf in self._ring.range(str(key), size=min(replicas, len(self.nodes)))]

    def primary(self, key: str) -> str | None:
        found = self.placement(key, 1)
        return found[0] if found else None
