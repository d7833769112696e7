"""Who goes first and who gives way: the prefill order (priorities and aging) and the choice of
whom to preempt. The policy decides; the scheduler (worker/engine/scheduler.py) preempts.

Design notes
1. When a request needs a block and none is available, the newest running request not yet in
   this step is preempted: its blocks are released (its full pages stay in the prefix cache),
   its tokens so far are kept, and it waits to be recomputed (keeping its age, so it soon goes
   first). A request alone always fits, because prompts and lengths are capped at the pool's size.
2. Priorities (lower values first, default 0): the prefill order of scheduler note 3 ranks by
   priority before tokens left (aged requests still go first), and preemption (note 1) takes the
   running request of the highest value, the newest among equals, so a request is never
   preempted for one of lower priority. Before a step takes its decodes, the first waiting
   request in that order, if it lacks a seat or the blocks of its first chunk, preempts running
   requests of a strictly higher value, one at a time, until it has them; it is then admitted in
   that step. Aging: a request's priority counts one better for every `aging_steps + 1` steps
   since it arrived, so a low-priority one cannot be preempted forever, and with equal
   priorities the order is exactly that of scheduler note 3 and of note 1.
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
        first (oldest first), then by priority (design note 2), then the fewest tokens left first;
        ties keep the order given."""
        ranked = []
        for request, left in candidates:
            rank = (0, request.arrival_step, 0) if self.aged(request, step) else (1, self.priority(request, step), left)
            ranked.append((rank, request, left))
        ranked.sort(key=lambda entry: entry[0])
        return [(request, left) for _, request, left in ranked]

    def aged(self, request: Request, step: int) -> bool:
        """Waited through `aging_steps` steps: goes before every younger request (scheduler design note 3)."""
        return step - request.arrival_step > self.aging_steps

    def priority(self, request: Request, step: int) -> int:
        """Its priority, one better for every `aging_steps + 1` steps since it arrived (design note 2)."""
        return request.priority - (step - request.arrival_step) // (self.aging_steps + 1)

    def victim(self, running: Sequence[Request], spared: Container[Request], step: int) -> Request | None:
        """The running request (oldest first in `running`) to preempt first, none of `spared`: the
        highest priority value, the newest among equals (design notes 1 and 2)."""
        candidates = [(self.priority(r, step), i, r) for i, r in enumerate(running) if r not in spared]
        return max(candidates, key=lambda entry: entry[:2])[2] if candidates else None

    def lower_victim(self, request: Request, running: Sequence[Request], spared: Container[Request],
                     step: int) -> Request | None:
        """A running request that `request` may preempt: of a strictly higher priority value (design note 2)."""
        victim = self.victim(running, [*spared, request], step)
        return victim if victim is not None and self.priority(victim, step) > self.priority(request, step) else None
