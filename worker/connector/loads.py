"""The KV connector's loads: what a load left, the loads under way by request and those given up
that still run (their blocks the loader's). KVConnector (connector.py) starts and reports them,
LayerwiseLoads (layers.py) settles those joined early."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from worker.kv.pages_in_place import PagesInPlace


@dataclass(frozen=True)
class Landed:
    """What a load left: how many of its leading pages arrived in its blocks, or, pinned where they lie
    in a same-host node's pool, all of them (`pages_in_place`: Tier.fill_in_place)."""
    num_pages: int = 0
    pages_in_place: PagesInPlace | None = None


@dataclass
class FinishedLoads:
    landed: list[tuple[Any, Landed]] = field(default_factory=list)  # (request, what its load left)
    released: list[list[int]] = field(default_factory=list)  # blocks of loads given up, the loader done with them
    overdue: list[Any] = field(default_factory=list)  # requests whose load ran past timeout_s


class LayerwiseLoad:
    """How many layers of one layer-wise load landed, whether it ended, and its early join."""

    def __init__(self, wake: Callable[[], None]):
        self.cond = threading.Condition()
        self.num_landed = 0  # layers in the pool, from the first
        self.done = False
        self.joined = False  # its request joined a step before the load ended
        self.tried_early = False  # it did once: never again
        self.waited_s = 0.0  # once joined: what its step waited for layers so far (step_wait_s bounds it)
        self._wake = wake

    def land(self, layer: int) -> None:
        with self.cond:
            first = self.num_landed == 0
            self.num_landed = max(self.num_landed, layer + 1)
            self.cond.notify_all()
        if first:
            self._wake()  # the request may join a step now

    def end(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


@dataclass
class Load:
    request: Any
    future: Future
    started: float
    blocks: list[int] = field(default_factory=list)  # once given up: to release when the loader is done
    layers: LayerwiseLoad | None = None  # a layer-wise load (layers.py)


class Loads:
    """The connector's loads by request, and those given up that still run (the loader may write
    their blocks)."""

    def __init__(self, clock: Callable[[], float], timeout_s: float):
        self.clock = clock
        self.timeout_s = timeout_s
        self.num_given_up = 0
        self.num_cancelled = 0  # ... of which had not started: never run (see give_up)
        self._loads: dict[int, Load] = {}  # id(request) -> its load
        self._given_up: list[Load] = []  # still running

    def add(self, load: Load) -> None:
        self._loads[id(load.request)] = load

    def get(self, request) -> Load | None:
        return self._loads.get(id(request))

    def __getitem__(self, request) -> Load:
        return self._loads[id(request)]

    def under_way(self, load: Load) -> bool:
        """Neither over nor overdue."""
        return not load.future.done() and self.clock() - load.started < self.timeout_s

    def end(self, request) -> None:
        """Its outcome was taken."""
        del self._loads[id(request)]

    def give_up(self, request, blocks: Sequence[int]) -> None:
        """`blocks` (those the loader may write) come back in `released` once the loader let go of
        them: at the next call when the load had not started, as it is then cancelled (never run);
        only when it finishes when it had. A given-up load that ends with pages in place releases
        them at once."""
        load = self._loads.pop(id(request))
        load.blocks = list(blocks)
        self._given_up.append(load)
        self.num_given_up += 1
        if load.future.cancel():
            self.num_cancelled += 1

    def take_finished_loads(self) -> FinishedLoads:
        """What KVConnector.take_finished_loads reports (its docstring)."""
        finished, now = FinishedLoads(), self.clock()
        for key, load in list(self._loads.items()):
            if load.layers is not None and load.layers.joined:
                continue  # settled by the step it joined (LayerwiseLoads.settle)
            if load.future.done():
                del self._loads[key]
                finished.landed.append((load.request, Landed() if load.future.cancelled() else load.future.result()))
            elif now - load.started >= self.timeout_s:
                finished.overdue.append(load.request)
        for load in list(self._given_up):
            if load.future.done():
                self._given_up.remove(load)
                _release_in_place(load.future)
                finished.released.append(load.blocks)
        return finished

    def has_releases(self) -> bool:
        return any(load.future.done() for load in self._given_up)

    def release_in_place(self) -> None:
        """Pages pinned in place go back to the node (on close): a join of released ones computes
        them (in_place_joins.py)."""
        for load in [*list(self._loads.values()), *list(self._given_up)]:
            _release_in_place(load.future)

    def __len__(self) -> int:
        return len(self._loads) + len(self._given_up)


def _release_in_place(future: Future) -> None:
    """A given-up load's pages pinned in place go back to the node at once."""
    if future.done() and not future.cancelled() and future.exception() is None:
        pages = future.result().pages_in_place
        if pages is not None:
            pages.release()
