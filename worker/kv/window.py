"""What a sliding window leaves behind: the first block a step's attention reads, and the blocks
a running sequence releases once no later query can read them. One rule for both, so a block
is released only when attention has stopped reading it.
"""

from __future__ import annotations

from typing import Sequence

# The block-table entry of a page the window has left behind, so positions still index the table.
# The sequence's reference goes back to the pool, which may keep the page cached for a later prompt
# with the same prefix (BlockPool._uncache_subtree). Write-back is not affected: a page is copied
# for the kvnodes when it becomes full, before it can be released.
RELEASED = -1


def release_window(layer_windows: Sequence[int | None]) -> int | None:
    """The window after which a page may go: None (never) if a layer attends to the whole context,
    else the widest layer's window. A page holds every layer's K/V, so it can go only when no
    layer reads it."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


def first_read_block(first_query_position: int, window: int | None, page_tokens: int) -> int:
    """The first block that queries from `first_query_position` on can read. A query at position p
    sees keys at p - W < j <= p, and later steps' queries start further on, so the blocks wholly
    before first_query_position - W + 1 are read by no query of this step or any later one."""
    if window is None:
        return 0
    return max(0, first_query_position - window + 1) // page_tokens
