"""An eviction policy: an order (which evictable page goes first) and the prefix rule (whether
only leaves may go, and whether a put needs its parent cached)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvictionPolicy:
    name: str
    order: str  # "lru", "fifo", "arc", "s3fifo" or "lfu" (kvnode/eviction/__init__.py maps it to its class)
    leaves_only: bool  # evict only pages that no cached page names as parent
    requires_parent: bool  # refuse a put whose parent is not cached

    @property
    def prefix_safe(self) -> bool:
        """Every cached page's whole prefix is cached: a node may run it."""
        return self.leaves_only and self.requires_parent
