"""Belady's MIN, computed offline from a whole trace: on a miss with the pool full, the page
whose next use is farthest goes, or the missing page is not stored when its own next use is
the farthest. No online policy hits more blocks on the same trace and capacity.

Every block of every request is a use, in order. A hit counts as a prefix hit only while every
earlier block of its request hit too (what a lookup can use). On a trace whose ids name their
whole prefix the two counts are equal: a parent's next use always comes before its child's, so
MIN never keeps a child whose parent it evicted.
"""

from __future__ import annotations

import heapq
from typing import Sequence

NEVER = float("inf")


def belady(requests: Sequence, capacity: int) -> dict:
    """Hits under MIN: {"hit_blocks", "hit_tokens", "any_hit_blocks"}; requests have keys and block_tokens.
    The token count is that of the blocks MIN hits: MIN maximises blocks, not tokens, and a request's
    last block may hold fewer tokens, so its token hit rate is close to, not strictly, the ceiling."""
    uses = [(key, n) for n, request in enumerate(requests) for key in request.keys]
    next_use = [NEVER] * len(uses)
    last: dict[bytes, int] = {}
    for position in range(len(uses) - 1, -1, -1):
        key = uses[position][0]
        next_use[position] = last.get(key, NEVER)
        last[key] = position
    cached: dict[bytes, float] = {}  # key -> next use
    # (-next use, key), lazily invalidated like the store's queues: an entry is current while the
    # cached page still has that next use. O(log n) per use.
    heap: list[tuple[float, bytes]] = []
    hit_blocks = hit_tokens = any_hits = 0
    position = 0
    for request in requests:
        intact = True
        for key, tokens in zip(request.keys, request.block_tokens):
            upcoming = next_use[position]
            position += 1
            if key in cached:
                any_hits += 1
                if intact:
                    hit_blocks += 1
                    hit_tokens += tokens
            else:
                intact = False
                if len(cached) >= capacity:
                    while -heap[0][0] != cached.get(heap[0][1]):
                        heapq.heappop(heap)  # stale
                    if -heap[0][0] <= upcoming:
                        continue  # this page is the one used farthest away: not stored
                    del cached[heapq.heappop(heap)[1]]
            cached[key] = upcoming
            heapq.heappush(heap, (-upcoming, key))
            if len(heap) > 2 * capacity + 64:
                heap = [(-use, k) for k, use in cached.items()]
                heapq.heapify(heap)
    return {"hit_blocks": hit_blocks, "hit_tokens": hit_tokens, "any_hit_blocks": any_hits}
