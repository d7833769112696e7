"""The KV connector's layer-wise loads: a request whose pages come layer by layer may join a step
before its load ended, the engine waiting briefly for each layer as its forward reaches it.

With a tier whose `layerwise_fill` is on, a load reports each layer of its pages as it lands in the
pool (`LayerwiseLoad.land`). Once its first layer landed, the scheduler may let the request join a
step of its own (`join_early`, once a load), and the engine waits before computing layer l until
layer l landed (`wait_layer`). After the forward `settle` says whether every page arrived intact
(the tier checks them only at the end); on any failure the scheduler throws the step's work away.
`LayerwiseLoads` (the connector's `layerwise_loads`, the `LayerwiseJoins` interface in connector.py)
keeps the waits' bounds and counts, and joins the connector's `Loads` early (loads.py: each
layer-wise load has its `LayerwiseLoad`).
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, TimeoutError
from typing import Sequence

from worker.connector.loads import LayerwiseLoad, Loads


class LayerwiseLoads:
    """Parked requests joining a step before their layer-wise load ended, the bounds on the engine's
    waits for their layers, and what joined, went back and waited.

    A wait holds up the whole engine, so it is short: `layer_wait_s` a layer, and `step_wait_s` of
    such waits in all a step (the compute between them not counted), so a node trickling its layers
    just in time cannot hold the engine for layers x layer_wait_s. A layer later than that, or a
    load that ended without it, sends the request back to wait for its load as any parked one
    (`unjoin`). `settle_timeout_s` bounds the wait for the load's outcome after the forward."""

    def __init__(self, loads: Loads, layer_wait_s: float, step_wait_s: float, settle_timeout_s: float):
        self.loads = loads
        self.layer_wait_s = layer_wait_s
        self.step_wait_s = step_wait_s
        self.settle_timeout_s = settle_timeout_s
        self.num_early_joins = 0  # requests that joined a step before their layer-wise load ended
        self.num_unjoined = 0  # ... and went back to wait for it, a layer late
        self.num_layer_waits = 0  # times the engine found a layer not landed yet and waited for it

    def can_join_early(self, request) -> bool:
        """Whether a parked request's load is layer-wise, under way (its first layer landed) and not
        over, not overdue, and never joined early before."""
        load = self.loads.get(request)
        return (load is not None and load.layers is not None and not load.layers.tried_early
                and load.layers.num_landed > 0 and self.loads.under_way(load))

    def join_early(self, request) -> None:
        """The request runs before its load ended; it is no longer reported by take_finished_loads."""
        layers = self._layers(request)
        layers.joined = layers.tried_early = True
        self.num_early_joins += 1

    def unjoin(self, request) -> None:
        """The request waits for its load again, reported by take_finished_loads as any."""
        self._layers(request).joined = False
        self.num_unjoined += 1

    def wait_layer(self, request, layer: int) -> bool:
        """Wait until layer `layer` of the request's early-joined load is in the pool: True; False
        after layer_wait_s, once the step's layer waits reached step_wait_s in all, or at once when
        the load ended without it."""
        load = self.loads.get(request)
        if load is None or load.layers is None:
            return False
        layers = load.layers
        started = time.monotonic()
        deadline = started + min(self.layer_wait_s, self.step_wait_s - layers.waited_s)  # only waits count
        with layers.cond:
            if layers.num_landed <= layer and not layers.done:
                self.num_layer_waits += 1
            while layers.num_landed <= layer and not layers.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                layers.cond.wait(left)
            layers.waited_s += time.monotonic() - started
            return layers.num_landed > layer

    def settle(self, request, blocks: Sequence[int], wait_s: float | None = None) -> int | None:
        """An early-joined load's outcome: the pages that arrived intact (the tier's count), waiting for
        it at most wait_s (settle_timeout_s when None); None when it still runs: it is given up and
        `blocks` come back in take_finished_loads' `released` once the loader let go of them."""
        load = self.loads[request]
        try:
            filled = load.future.result(timeout=self.settle_timeout_s if wait_s is None else wait_s).num_pages
        except TimeoutError:
            self.loads.give_up(request, blocks)
            return None
        except CancelledError:
            filled = 0
        self.loads.end(request)
        return filled

    def _layers(self, request) -> LayerwiseLoad:
        layers = self.loads[request].layers
        assert layers is not None, "not a layer-wise load"
        return layers
