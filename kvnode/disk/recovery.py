"""Rebuild the disk tier's index at start from its slots' headers.

Every slot is read whole and its checksum checked, so a page indexed at start is known intact and
a lookup never counts a page that a fetch would find broken; a torn or corrupted slot is emptied
(its header zeroed) and counted. Why every slot is read rather than a log replayed:
docs/architecture.md, "The disk tier".
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from kvnode.disk.tier import HEADER_BYTES, DiskTier, SlotHeader


@dataclass
class Recovered:
    pages: list[SlotHeader] = field(default_factory=list)  # parents before children
    free_slots: list[int] = field(default_factory=list)
    corrupted: int = 0  # torn or corrupted slots, emptied
    outdated: int = 0  # slots of an older format (no page checksum), emptied
    orphaned: int = 0  # intact pages dropped because an ancestor was lost
    duplicates: int = 0  # slots emptied because their page was also in a later-written slot
    seconds: float = 0.0

    def summary(self, tier: DiskTier) -> str:
        older = f", and {self.outdated} pages an older kvnode wrote without checksums" if self.outdated else ""
        return (f"recovered {len(self.pages)} pages from {tier.path} in {self.seconds:.2f}s; dropped "
                f"{self.corrupted} corrupted or torn pages and {self.orphaned} pages whose parent was lost{older}")


def recover(tier: DiskTier) -> Recovered:
    started = time.perf_counter()
    out = Recovered()
    head, scratch = bytearray(HEADER_BYTES), bytearray(tier.page_bytes)
    found: dict[bytes, SlotHeader] = {}
    for slot in range(tier.capacity_pages):
        header = tier.inspect(slot, head, scratch)
        if header is None:
            if DiskTier.is_outdated(head):
                out.outdated += 1
                tier.free(slot)
            elif not DiskTier.is_empty(head):
                out.corrupted += 1
                tier.free(slot)
            out.free_slots.append(slot)
            continue
        other = found.get(header.key)
        if other is not None:  # keys name content: the same page twice (a crash between writing it
            # again and emptying its old slot); the later write is kept
            older, header = sorted((other, header), key=lambda h: h.seq)
            out.duplicates += 1
            tier.free(older.slot)
            out.free_slots.append(older.slot)
        found[header.key] = header
    out.pages = _reachable(found)
    kept = {h.key for h in out.pages}
    for header in found.values():
        if header.key not in kept:
            out.orphaned += 1
            tier.free(header.slot)
            out.free_slots.append(header.slot)
    out.free_slots.sort(reverse=True)  # the store pops from the end: lowest slots first
    out.seconds = time.perf_counter() - started
    return out


def _reachable(found: dict[bytes, SlotHeader]) -> list[SlotHeader]:
    """The pages that reach a root through found pages, parents first, earlier writes first.

    A page whose parent is missing (torn, corrupted, never written before a crash) is unreachable
    by a lookup, so it is left out with all its descendants: no orphan survives a restart. The
    order lets the store rebuild its child counts in one pass and its LRU order roughly as it was
    (by write order: last touches are not on disk)."""
    children: dict[bytes, list[SlotHeader]] = {}
    ready: list[tuple[int, bytes]] = []
    for header in found.values():
        if header.parent:
            children.setdefault(header.parent, []).append(header)
        else:
            ready.append((header.seq, header.key))
    heapq.heapify(ready)
    ordered = []
    while ready:
        _, key = heapq.heappop(ready)
        ordered.append(found[key])
        for child in children.get(key, ()):
            heapq.heappush(ready, (child.seq, child.key))
    return ordered
