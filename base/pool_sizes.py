"""Default pool sizes worked out from the model: a worker's local KV pool holds one sequence of the
model's full context, and a kvnode's page pool lets one lookup lease that many pages. Used by
`kvcache worker` (--kv-cache), `kvcache node --model` (--capacity) and `kvcache cluster up`.

A page is page_tokens tokens of every layer: layers x 2 (K and V) x KV heads x head dim x the KV
dtype's bytes, a token (docs/usage.md works it out for the default model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from base.units import format_size

# Both pools are written at start (resident memory, not reserved address space), so a laptop pays
# them in full: hence the upper bounds, and every daemon names its sizes in its start line. The
# lower bound keeps room for many short requests at once on a small model.
MIN_POOL_BYTES = 64 << 20
MAX_WORKER_POOL_BYTES = 1 << 30
MAX_NODE_POOL_BYTES = 2 << 30


def full_context_pages(max_positions: int, page_tokens: int) -> int:
    """Pages of one sequence as long as the model takes."""
    return max(1, math.ceil(max_positions / page_tokens))


@dataclass(frozen=True)
class PoolSize:
    """A pool of `pages` pages of `page_bytes`; `capped`: the upper bound made it hold less than
    one full context (a worker's start line then says what caps its prompts: prompt_cap)."""

    pages: int
    page_bytes: int
    capped: bool = False

    @property
    def bytes(self) -> int:
        return self.pages * self.page_bytes

    def size(self) -> str:
        """The size as --kv-cache and --capacity take it, exact to the byte when not whole MiB."""
        return _size_option(self.bytes)


def worker_pool(page_bytes: int, max_positions: int, page_tokens: int) -> PoolSize:
    """A worker's default KV pool for a model whose page is `page_bytes`: the most one sequence can
    use, so the longest prompt it takes is the model's own limit (within MIN_POOL_BYTES and
    MAX_WORKER_POOL_BYTES; past the cap, --kv-cache raises it)."""
    wanted = full_context_pages(max_positions, page_tokens)
    low, high = _bounds(page_bytes, MIN_POOL_BYTES, MAX_WORKER_POOL_BYTES)
    return PoolSize(min(max(wanted, low), high), page_bytes, capped=wanted > high)


def node_pool(page_bytes: int, max_positions: int, page_tokens: int, leased_fraction: float) -> PoolSize:
    """A kvnode's default page pool: one lookup may lease a whole full-context prompt. Leases are
    bounded to `leased_fraction` of the pool (--max-leased-fraction, so eviction always has room),
    so the pool is those pages divided by it (within MIN_POOL_BYTES and MAX_NODE_POOL_BYTES)."""
    wanted = full_context_pages(max_positions, page_tokens)
    low, high = _bounds(page_bytes, MIN_POOL_BYTES, MAX_NODE_POOL_BYTES)
    if leased_fraction <= 0:
        return PoolSize(low, page_bytes, capped=True)  # no leases at all: no size makes one
    pages = math.ceil(wanted / leased_fraction)
    while leased_pages(pages, leased_fraction) < wanted:  # the store rounds down (kvnode/daemon.py)
        pages += 1
    return PoolSize(min(max(pages, low), high), page_bytes, capped=pages > high)


def leased_pages(pages: int, leased_fraction: float) -> int:
    """Most pages a kvnode of `pages` leases at once: what its store is given."""
    return int(pages * leased_fraction)


def prompt_cap(pool_tokens: int, max_positions: int) -> str:
    """What a worker's start line says of its longest prompt: the model's limit, or the pool's."""
    if pool_tokens >= max_positions:
        return f"one full {max_positions}-token context of the model"
    return f"prompts up to {pool_tokens} tokens, fewer than the model's {max_positions}"


def _bounds(page_bytes: int, low_bytes: int, high_bytes: int) -> tuple[int, int]:
    return max(1, low_bytes // page_bytes), max(1, high_bytes // page_bytes)


def _size_option(num_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes % (1 << shift) == 0:
            return f"{num_bytes >> shift}{unit}"
    return str(num_bytes)


def describe(num_bytes: int) -> str:
    """Bytes as a start line says them: 360MiB, 1.5GiB."""
    text = format_size(num_bytes)
    number, unit = text.split()
    return f"{number.removesuffix('.0')}{unit}"
