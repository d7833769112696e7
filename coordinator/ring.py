"""Placement: a consistent-hash ring over the live kvnodes (uhashring), weighted by capacity.

The ring is a pure function of the live-node set, so coordinators with the same view
place alike. It is never mutated: a membership change builds a new Ring, and callers
swap the reference (uhashring mutates in place without locks).
"""

from __future__ import annotations

import hashlib
from typing import Mapping

from uhashring import HashRing

# Virtual nodes per GiB of pool: a node's share of the hash space varies by about
# 1/sqrt(points), so 640 keeps the largest share of 100 to 1,000 equal nodes within 1.13x of
# the mean (`kvcache bench ring`; 320 gave 1.18x). A ring of 1,000 such nodes takes ~4 s to
# build, which is why Membership builds it outside its lock.
VNODES_PER_GIB = 640
MIN_VNODES, MAX_VNODES = 40, 20_000
DEFAULT_PREFIX_CHARS = 64


def vnodes_for(capacity_bytes: int) -> int:
    return max(MIN_VNODES, min(MAX_VNODES, round(VNODES_PER_GIB * capacity_bytes / 2**30)))


def epoch_of(nodes: Mapping[str, int]) -> str:
    """Digest of the sorted live-node set (address and capacity): equal views, equal epochs."""
    text = "\n".join(f"{address} {capacity}" for address, capacity in sorted(nodes.items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def placement_key(prompt: str, session_id: str = "", prefix_chars: int = DEFAULT_PREFIX_CHARS,
                  namespace: str = "") -> str:
    """The session id when given, else a digest of the prompt's first characters (never tokenized);
    salted with a tenant's `namespace` (base/tokens.py), so tenants' prompts land apart."""
    if session_id:
        key = "session:" + session_id
    else:
        key = hashlib.blake2b(prompt[:prefix_chars].encode(), digest_size=16).hexdigest()
    if namespace:
        return "tenant:" + hashlib.blake2b(f"{namespace}\0{key}".encode(), digest_size=16).hexdigest()
    return key


class Ring:
    """Immutable ring over `nodes`: address -> capacity in bytes."""

    def __init__(self, nodes: Mapping[str, int]):
        self.nodes = dict(nodes)
        self.epoch = epoch_of(self.nodes)
        config = {address: {"vnodes": vnodes_for(capacity)} for address, capacity in self.nodes.items()}
        self._ring = HashRing(nodes=config) if config else None
        # The node at each point, in ring order: placement walks it from the key's point. uhashring's
        # own range() copies its list of points on every call (1.8 ms a request at 1,000 nodes).
        self._point_nodes = [name for _, name in self._ring.get_points()] if config else []

    def placement(self, key: str, replicas: int) -> list[str]:
        """The `replicas` distinct nodes that follow `key` on the ring (fewer if fewer are live);
        the same nodes, in the same order, as uhashring's range(key, size=replicas)."""
        if self._ring is None or replicas < 1:
            return []
        wanted = min(replicas, len(self.nodes))
        points, start = self._point_nodes, self._ring.get_node_pos(str(key))
        found: list[str] = []
        for i in range(len(points)):
            name = points[(start + i) % len(points)]
            if name not in found:
                found.append(name)
                if len(found) == wanted:
                    break
        return found

    def primary(self, key: str) -> str | None:
        found = self.placement(key, 1)
        return found[0] if found else None
