"""Who goes first and who gives way: the prefill order (priorities and aging) and the choice of
whom to preempt. The policy decides; the scheduler (worker/engine/scheduler.py) preempts.

Priorities are lower first, 0 by default; among equal priorities the prefill order is the fewest
tokens left first and preemption takes the newest request, as with no priorities at all. Waiting
makes a request's priority better, so a low-priority one is never passed over, nor preempted,
forever.
"""

from __future__ import annotations

from typing import Container, Iterable, Sequence

from worker.engine.request import Request


class PriorityPolicy:
    """Orders requests and picks whom to preempt, at scheduler step `step` (its step count)."""

    def __init__(self, aging_steps: int):
        self.aging_steps = aging_steps

    def prefill_order(self, candidates: Iterable[tuple[Request, int]], step: int) -> list[tuple[Request, int]]:
        """Candidates (request, prompt tokens it still has to compute) in prefill order: aged ones
        first (oldest first), then by priority, then the fewest tokens left first; ties keep the
        order given. Aged requests go before any priority, so aging bounds every request's wait."""
        ranked = []
        for request, left in candidates:
            rank = (0, request.arrival_step, 0) if self.aged(request, step) else (1, self.priority(request, step), left)
            ranked.append((rank, request, left))
        ranked.sort(key=lambda entry: entry[0])
        return [(request, left) for _, request, left in ranked]

    def aged(self, request: Request, step: int) -> bool:
        """Waited through `aging_steps` steps: goes before every younger request, so a stream of short
        prompts never starves a long one."""
        return step - request.arrival_step > self.aging_steps

    def priority(self, request: Request, step: int) -> int:
        """Its priority, one better for every `aging_steps + 1` steps since it arrived, so a low-priority
        request cannot be passed over or preempted forever."""
        return request.priority - (step - request.arrival_step) // (self.aging_steps + 1)

    def victim(self, running: Sequence[Request], spared: Container[Request], step: int) -> Request | None:
        """The running request (oldest first in `running`) to preempt first, none of `spared`: the
        highest priority value, the newest among equals, so a request is never preempted for one
        of lower priority.

        A preempted request's blocks are released (its full pages stay in the prefix cache) and its
        tokens kept; it waits to be recomputed, keeping its age, so it soon goes first. A request
        alone always fits: prompts and lengths are capped at the pool's size."""
        candidates = [(self.priority(r, step), i, r) for i, r in enumerate(running) if r not in spared]
        return max(candidates, key=lambda entry: entry[:2])[2] if candidates else None

    def lower_victim(self, request: Request, running: Sequence[Request], spared: Container[Request],
                     step: int) -> Request | None:
        """A running request that `request` may preempt: of a strictly higher priority value. Before a
        step takes its decodes, the first waiting request in the prefill order preempts such ones,
        one at a time, until it has a seat and its first chunk's blocks, and is admitted in that
        step (Scheduler._preempt_for_priority)."""
        victim = self.victim(running, [*spared, request], step)
        return victim if victim is not None and self.priority(victim, step) > self.priority(request, step) else None
