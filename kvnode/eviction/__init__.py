"""Eviction policies for the page store, apart from the store that carries them out.

The store keeps slots, pages, leases and child counts; its EvictionQueue tells it which
unleased page to evict next, and the policy says whether a put must find its parent
cached. The caller picks the policy (as vLLM v1's block pool takes its eviction order
from the caller). A policy is an order and a rule:

- the order: lru (recency.py), fifo (recency.py), arc (arc.py), s3fifo (s3fifo.py) or
  lfu with aging (lfu.py);
- the prefix rule: under the prefix-* policies only leaves are evicted (pages no cached
  page names as parent) and a put whose parent is not cached is refused, so every cached
  page's whole prefix is cached. These are the ones a node may run (NODE_POLICIES).
  Without the rule (lru, fifo, arc, s3fifo, lfu: what remote stores that know nothing of
  prefixes do, kept so `kvcache bench eviction` can compare them on this very code) any
  page may go, and evicting a page whose children are cached orphans them: they hold
  memory that no lookup from the root can reach until the parent is stored again.

Every order is O(log n) amortized per operation (candidates.py); `kvcache bench eviction
--cost` measures it up to 100,000 pages.
"""

from __future__ import annotations

from typing import Mapping

from kvnode.eviction.arc import ArcOrder
from kvnode.eviction.candidates import Order, Page
from kvnode.eviction.lfu import LfuOrder
from kvnode.eviction.policy import EvictionPolicy
from kvnode.eviction.ram_queue import RamQueue
from kvnode.eviction.recency import RecencyOrder
from kvnode.eviction.s3fifo import S3FifoOrder

ORDERS: dict[str, type[Order]] = {"lru": RecencyOrder, "fifo": RecencyOrder, "arc": ArcOrder,
                                  "s3fifo": S3FifoOrder, "lfu": LfuOrder}

PREFIX_LRU = EvictionPolicy("prefix-lru", "lru", leaves_only=True, requires_parent=True)
PREFIX_AWARE = PREFIX_LRU  # its old name, kept for callers
LRU = EvictionPolicy("lru", "lru", leaves_only=False, requires_parent=False)
FIFO = EvictionPolicy("fifo", "fifo", leaves_only=False, requires_parent=False)
_PREFIX_SAFE = [PREFIX_LRU] + [EvictionPolicy(f"prefix-{order}", order, leaves_only=True, requires_parent=True)
                               for order in ("arc", "s3fifo", "lfu")]
_UNRESTRICTED = [LRU, FIFO] + [EvictionPolicy(order, order, leaves_only=False, requires_parent=False)
                               for order in ("arc", "s3fifo", "lfu")]
POLICIES = {policy.name: policy for policy in _PREFIX_SAFE + _UNRESTRICTED}
NODE_POLICIES = [policy.name for policy in _PREFIX_SAFE]
ALIASES = {"prefix-aware": PREFIX_LRU.name}


def get_policy(name: str) -> EvictionPolicy:
    name = ALIASES.get(name, name)
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


class EvictionQueue:
    """The store's one queue: the policy's order behind the calls the store makes.

    offer(key, page): stored, or its lease ended, or its last pin was released;
    touched(key, page); lost_last_child(key, page); pop(now, protect) -> the key to evict
    (never `protect`) or None; removed(key): it left the index otherwise, dropped
    (candidates.py: Order.removed); check(): the order's bookkeeping, for tests.
    """

    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        self.policy = policy
        self.order = ORDERS[policy.order](policy, pages)
        # bound methods, not wrappers: the store calls them on every operation
        self.offer = self.order.offer
        self.touched = self.order.touched
        self.lost_last_child = self.order.lost_last_child
        self.pop = self.order.pop
        self.removed = self.order.removed
        self.check = self.order.check
