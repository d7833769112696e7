"""What the scheduler side tells the worker side each step: blocks to load and blocks to save.

Plain data, so it crosses to vLLM's worker processes as it is, and tests build it without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockLoad:
    """Fetch blocks `block_keys` of request `req_id` from kvnode `address` into vLLM blocks `block_ids`."""

    req_id: str
    address: str
    block_keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockSave:
    """Save the request's blocks `first` .. len(block_keys) - 1, held in vLLM blocks `block_ids`, to `addresses`.

    `block_keys` runs from the sequence's first block, so a node can be asked how much of the chain it has."""

    req_id: str
    addresses: tuple[str, ...]
    block_keys: tuple[bytes, ...]
    first: int
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)
