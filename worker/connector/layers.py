"""The KV connector's layer-wise loads: a request whose pages come layer by layer may join a step
before its load ended, the engine waiting briefly for each layer as its forward reaches it.

With a tier whose `layerwise_fill` is on, a load reports each layer of its pages as it lands in the
pool (`LayerwiseLoad.land`). Once its first layer landed, the scheduler may let the request join a
step of its own (`join_early`, once a load), and the engine waits before computing layer l until
layer l landed (`wait_layer`). After the forward the connector's `settle_layerwise` says whether
every page arrived intact (the tier checks them only at the end); on any failure the scheduler
throws the step's work away. `LayerwiseLoads` keeps the waits' bounds and counts, and each
layer-wise load its `LayerwiseLoad`; the connector (connector.py) keeps the loads.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class LayerwiseLoad:
    """How many layers of one layer-wise load landed, whether it ended, and its early join."""

    def __init__(self, wake: Callable[[], None]):
        self.cond = threading.Condition()
        self.landed = 0
        self.done = False
        self.joined = False  # its request joined a step before the load ended
        self.tried_early = False  # it did once: never again
        self.waited_s = 0.0  # once joined: what its step waited for layers so far (step_wait_s bounds it)
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
    """The bounds on the engine's waits for layers, and what joined, went back and waited.

    A wait holds up the whole engine, so it is short: `layer_wait_s` a layer, and `step_wait_s` of
    such waits in all a step (the compute between them not counted), so a node trickling its layers
    just in time cannot hold the engine for layers x layer_wait_s. A layer later than that, or a
    load that ended without it, sends the request back to wait for its load as any parked one
    (`unjoin`). `settle_timeout_s` bounds the wait for the load's outcome after the forward."""

    def __init__(self, layer_wait_s: float, step_wait_s: float, settle_timeout_s: float):
        self.layer_wait_s = layer_wait_s
        self.step_wait_s = step_wait_s
        self.settle_timeout_s = settle_timeout_s
        self.num_early_joins = 0  # requests that joined a step before their layer-wise load ended
        self.num_unjoined = 0  # ... and went back to wait for it, a layer late
        self.num_layer_waits = 0  # times the engine found a layer not landed yet and waited for it

    def can_join_early(self, load: LayerwiseLoad) -> bool:
        """Its first layer landed and it never joined early before (the connector checks the rest)."""
        return not load.tried_early and load.landed > 0

    def join_early(self, load: LayerwiseLoad) -> None:
        load.joined = load.tried_early = True
        self.num_early_joins += 1

    def unjoin(self, load: LayerwiseLoad) -> None:
        load.joined = False
        self.num_unjoined += 1

    def wait_layer(self, load: LayerwiseLoad, layer: int) -> bool:
        """Wait until layer `layer` is in the pool: True; False after layer_wait_s, once the step's
        layer waits reached step_wait_s in all, or at once when the load ended without it."""
        started = time.monotonic()
        deadline = started + min(self.layer_wait_s, self.step_wait_s - load.waited_s)  # only waits count
        with load.cond:
            if load.landed <= layer and not load.done:
                self.num_layer_waits += 1
            while load.landed <= layer and not load.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                load.cond.wait(left)
            load.waited_s += time.monotonic() - started
            return load.landed > layer
