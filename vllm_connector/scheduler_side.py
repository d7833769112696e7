"""The connector's scheduler side: how many blocks past vLLM's own hit the cluster holds, and the plan of each step.

It never waits on the network: a lookup runs on a thread, and while it runs vLLM is told to ask
again (None) after at most `INLINE_WAIT_S`; one not answered within lookup_timeout_s is a miss,
and its node is skipped for a back-off (worker/remote/nodes.py). Hits are leased on the node that
reported them, so the load that follows finds them. Saving is planned here (which full blocks
are new), carried out by the worker side after the forward step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Sequence

import grpc

from kvnode.client import NodeError
from vllm_connector.keys import BlockLayout, block_keys, last_layer_keys
from vllm_connector.placement import Placement
from vllm_connector.plan import BlockLoad, BlockSave, StepPlan
from vllm_connector.settings import Settings
from worker.remote.nodes import NodeTable

log = logging.getLogger("vllm_connector")

INLINE_WAIT_S = 0.005  # a same-host lookup answers within this: most requests are admitted at once
MAX_TRACKED = 100_000  # requests with a lookup or a save plan; vLLM finishes each, this only bounds a leak


@dataclass
class Lookup:
    future: Future            # -> (address, blocks held) or None
    deadline: float
    keys: list[bytes]         # the prompt's full blocks that could be loaded
    num_local_tokens: int = 0  # vLLM's own hit, as last asked


@dataclass
class Tracked:
    """A request being run: its block keys so far, vLLM's blocks, and how many blocks are saved or held."""

    token_ids: Sequence[int]  # vLLM's live list of the request's tokens
    cache_salt: str
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_saved: int = 0


class SchedulerSide:
    def __init__(self, settings: Settings, layout: BlockLayout, placement: Placement, nodes: NodeTable,
                 clock=time.monotonic):
        self.settings = settings
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.placement = placement
        self.nodes = nodes
        self.clock = clock
        self._lookups: dict[str, Lookup] = {}
        self._tracked: dict[str, Tracked] = {}
        self._loads: list[BlockLoad] = []
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcache-lookup")

    # ---- get_num_new_matched_tokens ----------------------------------------------

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], cache_salt: str,
                               num_local_tokens: int) -> tuple[int | None, bool]:
        bs = self.layout.block_size
        num_blocks = (len(prompt) - 1) // bs  # vLLM computes at least the last prompt token itself
        if num_blocks * bs <= num_local_tokens or not self.placement.num_nodes():
            return 0, False
        lookup = self._lookups.get(req_id)
        if lookup is None:
            if len(self._lookups) >= MAX_TRACKED:
                return 0, False
            keys = block_keys(self.fingerprint, cache_salt or "", prompt, bs, num_blocks)
            deadline = self.clock() + self.settings.lookup_timeout_s
            lookup = Lookup(self._pool.submit(self._look_up, keys, deadline), deadline, keys)
            self._lookups[req_id] = lookup
            wait([lookup.future], timeout=INLINE_WAIT_S)
        lookup.num_local_tokens = num_local_tokens
        if not lookup.future.done():
            if self.clock() < lookup.deadline:
                return None, False  # vLLM asks again next step
            return 0, False  # the thread gives up at the deadline too; the node is skipped from then on
        found = lookup.future.result()
        held_tokens = found[1] * bs if found else 0
        if held_tokens <= num_local_tokens:
            return 0, False
        return held_tokens - num_local_tokens, True

    def _look_up(self, keys: list[bytes], deadline: float) -> tuple[str, int] | None:
        """The node of the placement holding most of `keys` (leased there), and how many; None when none answered."""
        best: tuple[str, int] | None = None
        wanted = last_layer_keys(keys, self.layout.num_layers)
        for address in self.placement.nodes(keys[0].hex()):
            with self.nodes.use([address]) as held:
                if not held or not self.nodes.ready(held[0], until=deadline):
                    continue
                node = held[0]
                try:
                    hits = 0
                    for start in range(0, len(wanted), node.max_lookup_keys):
                        part = wanted[start:start + node.max_lookup_keys]
                        left = deadline - self.clock()
                        if left <= 0:
                            raise NodeError(address, grpc.StatusCode.DEADLINE_EXCEEDED,
                                            f"no answer within the lookup timeout ({self.settings.lookup_timeout_s} s)")
                        found = node.client.lookup(part, lease_ms=self.settings.lease_ms, timeout=left)
                        hits += found
                        if found < len(part):
                            break
                except NodeError as exc:
                    self.nodes.failed(node, exc)
                    continue
                self.nodes.succeeded(node)
            if hits and (best is None or hits > best[1]):
                best = (address, hits)
            if best is not None and best[1] == len(keys):
                break
        return best

    # ---- update_state_after_alloc ---------------------------------------------------

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens <= 0 or lookup is None or not lookup.future.done() or not lookup.future.result():
            return
        address, _ = lookup.future.result()
        bs = self.layout.block_size
        first = lookup.num_local_tokens // bs
        end = (lookup.num_local_tokens + num_external_tokens) // bs
        self._loads.append(BlockLoad(req_id, address, tuple(lookup.keys[first:end]), tuple(block_ids[first:end])))

    # ---- build_connector_meta ---------------------------------------------------------

    def start(self, req_id: str, token_ids: Sequence[int], cache_salt: str, block_ids: Sequence[int],
              num_computed_tokens: int) -> None:
        """A request scheduled for the first time (or again after a preemption) with these blocks."""
        tracked = self._tracked.get(req_id)
        if tracked is None:
            if len(self._tracked) >= MAX_TRACKED:
                return
            tracked = self._tracked[req_id] = Tracked(token_ids, cache_salt or "")
        tracked.block_ids = list(block_ids)
        # What vLLM had before this step, it found in its own cache (computed and saved here) or loaded.
        tracked.num_saved = max(tracked.num_saved, num_computed_tokens // self.layout.block_size)

    def grow(self, req_id: str, new_block_ids: Sequence[int]) -> None:
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            tracked.block_ids.extend(new_block_ids)

    def plan(self, scheduled: dict[str, int]) -> StepPlan:
        """This step's plan; `scheduled` maps each scheduled request to its tokens computed once the step ran."""
        plan, self._loads = StepPlan(loads=self._loads), []
        if not self.settings.save:
            return plan
        bs = self.layout.block_size
        for req_id, num_computed in scheduled.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            full = min(num_computed, len(tracked.token_ids)) // bs
            full = min(full, len(tracked.block_ids))
            if full <= tracked.num_saved:
                continue
            if len(tracked.keys) < full:
                tracked.keys = block_keys(self.fingerprint, tracked.cache_salt, tracked.token_ids, bs, full)
            addresses = tuple(self.placement.nodes(tracked.keys[0].hex()))
            if addresses:
                plan.saves.append(BlockSave(req_id, addresses, tuple(tracked.keys[:full]), tracked.num_saved,
                                            tuple(tracked.block_ids[tracked.num_saved:full])))
            tracked.num_saved = full
        return plan

    # ---- request_finished ---------------------------------------------------------------

    def finished(self, req_id: str) -> None:
        self._lookups.pop(req_id, None)
        self._tracked.pop(req_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

