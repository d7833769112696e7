"""What the scheduler hands the engine for one step: the requests and how many new tokens each."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.request import Request


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]
    admission_held: bool = False  # scheduling it preempted or found the pool short: admit nobody more
    layerwise: bool = False  # one request whose remote pages are still landing (RemoteJoins.join_early)

    def __len__(self) -> int:
        return len(self.requests)
