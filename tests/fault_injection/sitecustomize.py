"""Put on PYTHONPATH of a test's worker process: makes its model fail as a bug would.

KVCACHE_TEST_POISON_TOKEN=N: a forward whose batch holds token N raises.
KVCACHE_TEST_STALL_TOKEN=N: a forward whose batch holds token N hangs (the test kills the process).
"""

import os
import time

_POISON = os.environ.get("KVCACHE_TEST_POISON_TOKEN")
_STALL = os.environ.get("KVCACHE_TEST_STALL_TOKEN")

if _POISON or _STALL:
    import worker.model

    _forward = worker.model.Model.forward

    def _faulty_forward(self, batch, *args, **kwargs):
        tokens = set(batch.token_ids.tolist())
        if _POISON and int(_POISON) in tokens:
            raise FloatingPointError("injected fault")
        if _STALL and int(_STALL) in tokens:
            time.sleep(600)
        return _forward(self, batch, *args, **kwargs)

    worker.model.Model.forward = _faulty_forward
