"""Orphans of a store's index (kvnode/store/page_store.py): cached pages whose parent is not cached, which
only lru and fifo leave. Counted per missing parent, so a parent stored again adopts its orphans
in O(1). Callers hold the store's lock."""

from __future__ import annotations


class Orphans:
    def __init__(self) -> None:
        self.by_parent: dict[bytes, int] = {}  # missing parent key -> cached pages naming it
        self.num_orphans = 0

    def add(self, parent: bytes, num_pages: int = 1) -> None:
        """`num_pages` cached pages name `parent`, which is not cached (any more)."""
        self.by_parent[parent] = self.by_parent.get(parent, 0) + num_pages
        self.num_orphans += num_pages

    def remove(self, parent: bytes) -> None:
        """An orphan naming `parent` left the index."""
        left = self.by_parent.pop(parent) - 1
        if left:
            self.by_parent[parent] = left
        self.num_orphans -= 1

    def adopt(self, parent: bytes) -> int:
        """`parent` is cached now: how many cached pages name it, orphans no more."""
        adopted = self.by_parent.pop(parent, 0)
        self.num_orphans -= adopted
        return adopted
