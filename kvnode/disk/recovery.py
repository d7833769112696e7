"""Rebuild the disk tier's index at start from its slots' headers.

Design notes
1. Every slot is read whole and its checksum checked (xxh3 runs at several GB/s, so reading
   the file is the cost: ~0.3 s per GiB from the page cache). A page read at start is then
   known intact, so a lookup never counts a page that a fetch would find broken. A torn or
   corrupted slot is emptied (its header zeroed) and counted.
2. Only pages that reach a root through intact pages are kept: a page whose parent is missing
   (torn, corrupted, never written before a crash) is unreachable by a lookup, so it is dropped
   with all its descendants, and no orphan survives a restart. Keys name content, so a key
   found in two slots (a crash between writing a page again and emptying its old slot) is the
   same page twice: the later write is kept.
3. Pages come out parents first, earlier writes first, so the store rebuilds its child counts
   in one pass and its LRU order roughly as it was (by write order: last touches are not on disk).
4. An append-only log of puts and evictions, checkpointed now and then, would restart without
   reading the pages; it was not built: reading 1 GiB of slots takes well under the 3 s goal
   (docs/benchmarks.md), and the log would trust pages it never read back.
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
        if other is not None:
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
    """The pages that reach a root through found pages, parents first, earlier writes first."""
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
