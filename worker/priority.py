"""Who goes first and who gives way: the prefill order (priorities and aging) and preemption.

`PriorityPolicy` is a part of the Scheduler (worker/scheduler.py), kept apart so that the
scheduler reads as its step rules. It works on the scheduler's state: `running`, `waiting`,
`num_steps`, `aging_steps`, the pool and the connector, and its `_release`, `_can_grow`,
`_num_cached` and `_tokens_to_compute`.

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

from worker.request import Request, RequestStatus
from worker.scheduled_batch import ScheduledBatch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PriorityPolicy:
    """The Scheduler's ordering and preemption rules (a mixin)."""

    def _prefill_order(self, batch: ScheduledBatch) -> list[tuple[Request, int]]:
        """(request, prompt tokens it still has to compute) for running requests mid-prompt and
        waiting ones: aged ones first (oldest first), then by priority (design note 2), then the fewest
        tokens left first; ties keep running before waiting, queue order."""
        candidates = [r for r in self.running if r not in batch.requests] + list(self.waiting)
        ranked = []
        for request in candidates:
            left = self._tokens_to_compute(request)
            rank = (0, request.arrival_step, 0) if self._aged(request) else (1, self._priority(request), left)
            ranked.append((rank, request, left))
        ranked.sort(key=lambda entry: entry[0])
        return [(request, left) for _, request, left in ranked]

    def _aged(self, request: Request) -> bool:
        """Waited through `aging_steps` steps: goes before every younger request (scheduler design note 3)."""
        return self.num_steps - request.arrival_step > self.aging_steps

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_room(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running requests outside the batch until `request` can grow (design
        note 1); it may be preempted itself. True if anything was preempted."""
        preempted = False
        while not self._can_grow(request, num_new):
            victim = self._victim(batch)
            self._preempt(victim)
            preempted = True
            if victim is request:
                break
        return preempted

    def _preempt_for_priority(self) -> None:
        """Before the step takes its decodes: if the first waiting request in the prefill order
        lacks a seat or blocks, preempt running requests of a higher priority value for it (design note 2)."""
        if not self.waiting:
            return
        no_batch = ScheduledBatch([], [])
        request = next((r for r, _ in self._prefill_order(no_batch) if r.status is RequestStatus.WAITING), None)
        if request is None or (self.connector is not None and self.connector.is_looking_up(request)):
            return  # it could not be admitted now anyway
        P = self.page_tokens
        hits = self.pool.lookup(request.page_keys(request.num_reusable_pages()))
        first_chunk_end = min(request.num_tokens, self._num_cached(request) + self.max_prefill_tokens)
        needed = _cdiv(first_chunk_end, P) - len(hits)
        # Its own idle cached prefix counts among the free blocks, but admission takes a reference
        # on it (the scheduler's _admit): those blocks are not there for its chunk.
        while (self.num_seats_taken() >= self.max_num_seqs
               or needed > self.pool.get_num_free_blocks() - self.pool.num_idle(hits)):
            victim = self._lower_victim(request, no_batch)
            if victim is None:
                return
            self._preempt(victim)

    def _victim(self, batch: ScheduledBatch, exclude: Request | None = None) -> Request | None:
        """The running request outside the batch to preempt first: the highest priority value,
        the newest among equals (design notes 1 and 2)."""
        candidates = [(self._priority(r), i, r) for i, r in enumerate(self.running)
                      if r not in batch.requests and r is not exclude]
        return max(candidates, key=lambda entry: entry[:2])[2] if candidates else None

    def _lower_victim(self, request: Request, batch: ScheduledBatch) -> Request | None:
        """A running request that `request` may preempt: of a strictly higher priority value (design note 2)."""
        victim = self._victim(batch, exclude=request)
        return victim if victim is not None and self._priority(victim) > self._priority(request) else None

    def _priority(self, request: Request) -> int:
        """Its priority, one better for every `aging_steps + 1` steps since it arrived (design note 2)."""
        return request.priority - (self.num_steps - request.arrival_step) // (self.aging_steps + 1)
