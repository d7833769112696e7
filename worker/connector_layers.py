"""The KV connector's layer-wise loads: a request whose pages come layer by layer may join a step
before its load ended, the engine waiting briefly for each layer as its forward reaches it.

`LayerwiseLoads` is a part of the KVConnector (worker/connector.py), kept apart so that the
connector reads as its lookups and loads. It works on the connector's state: `tier`, `_loads`
(each `_Load` with its `layers`, `joined`, `tried_early`, `waited_s`), `clock`, `timeout_s`,
`layer_wait_s`, `step_wait_s`, `settle_timeout_s` and the counters `num_early_joins`,
`num_unjoined`, `num_layer_waits`, and its `give_up_load`.

Design notes
1. Layer-wise loads (issue 19, connector design note 7): with a tier that offers
   `fill_layerwise` and has `layerwise_fill` on, a load reports each layer of its pages as it
   lands in the pool (`Layers`, the connector's `start_load`). Once its first layer
   landed (the node answered and is sending; it wakes the engine), the scheduler may let the
   request join a step of its own before the load ends (`join_early`, once a load); the engine
   waits before computing layer l until layer l landed (`wait_layer`). That wait holds up the
   whole engine, so it is short (`layer_wait_s`, 0.1 s a layer, and `step_wait_s`, 0.3 s of such
   waits in all a step, the compute between them not counted, so a node trickling its layers
   just in time cannot hold the engine for layers x 0.1 s): a layer later than that, or a load
   that ended without it, sends the request back to wait for its load as any parked one (`unjoin`).
   After the forward `settle_layerwise` says whether every page arrived intact (the tier checks
   them only at the end, waited for at most `settle_timeout_s`); on any failure the scheduler
   throws the step's work away.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError, TimeoutError
from typing import Any, Callable, Sequence

log = logging.getLogger("worker.connector")  # its messages are the connector's


class Layers:
    """How many layers of a layer-wise load landed, and whether it ended (note 1)."""

    def __init__(self, wake: Callable[[], None]):
        self.cond = threading.Condition()
        self.landed = 0
        self.done = False
        self._wake = wake

    def land(self, layer: int) -> None:
        with self.cond:
            first = self.landed == 0
            self.landed = max(self.landed, layer + 1)
            self.cond.notify_all()
        if first:
            self._wake()  # the request may join a step now

    def end(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


class LayerwiseLoads:
    """The KVConnector's layer-wise loads, from the first layer landed to the outcome (a mixin)."""

    def can_join_early(self, request) -> bool:
        """Whether a parked request's load is layer-wise, under way (its first layer landed) and not
        over, not overdue, and never joined early before (note 1)."""
        load = self._loads.get(id(request))
        return (load is not None and load.layers is not None and not load.tried_early and load.layers.landed > 0
                and not load.future.done() and self.clock() - load.started < self.timeout_s)

    def join_early(self, request) -> None:
        """The request runs before its load ended; it is no longer reported by take_finished_loads."""
        load = self._loads[id(request)]
        load.joined = load.tried_early = True
        self.num_early_joins += 1

    def unjoin(self, request) -> None:
        """The request waits for its load again, reported by take_finished_loads as any (note 1)."""
        self._loads[id(request)].joined = False
        self.num_unjoined += 1

    def wait_layer(self, request, layer: int) -> bool:
        """Wait until layer `layer` of the request's early-joined load is in the pool: True; False
        after layer_wait_s, once the step's layer waits reached step_wait_s in all, or at once when
        the load ended without it (note 1)."""
        load = self._loads.get(id(request))
        if load is None or load.layers is None:
            return False
        layers, started = load.layers, time.monotonic()
        deadline = started + min(self.layer_wait_s, self.step_wait_s - load.waited_s)  # only waits count
        with layers.cond:
            if layers.landed <= layer and not layers.done:
                self.num_layer_waits += 1
            while layers.landed <= layer and not layers.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                layers.cond.wait(left)
            load.waited_s += time.monotonic() - started
            return layers.landed > layer

    def settle_layerwise(self, request, blocks: Sequence[int], wait_s: float | None = None) -> int | None:
        """An early-joined load's outcome: the pages that arrived intact (the tier's count), waiting for
        it at most wait_s (settle_timeout_s when None); None when it still runs: it is given up and
        `blocks` come back in `released` once the loader let go of them."""
        load = self._loads[id(request)]
        try:
            filled = load.future.result(timeout=self.settle_timeout_s if wait_s is None else wait_s)
        except TimeoutError:
            self.give_up_load(request, blocks)
            return None
        except CancelledError:
            filled = 0
        del self._loads[id(request)]
        return filled

    def _fill_layerwise(self, keys: list[bytes], block_ids: list[int], context: Any, layers: Layers) -> int:
        try:
            filled = int(self.tier.fill_layerwise(keys, block_ids, context, layers.land))
        except Exception:
            log.exception("remote tier layer-wise fill failed; computing instead")
            filled = 0
        return max(0, min(filled, len(keys)))
