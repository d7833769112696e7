"""Put on PYTHONPATH of a test's daemon: makes a worker's model fail as a bug would, or a kvnode's
memory go bad.

KVCACHE_TEST_POISON_TOKEN=N: a forward whose batch holds token N raises.
KVCACHE_TEST_STALL_TOKEN=N: a forward whose batch holds token N hangs (the test kills the process).
KVCACHE_TEST_ALTER_PAGE=HEX: the first time a kvnode stores the page of that key, one bit of it
flips in the pool right after the put (its checksum, the writer's, stays as it was sent).
KVCACHE_TEST_ALTER_NTH_PAGE=N: the same for the N-th page the kvnode stores (from 1), for writers
whose keys the test cannot compute (vLLM's).
"""

import os
import time

_POISON = os.environ.get("KVCACHE_TEST_POISON_TOKEN")
_STALL = os.environ.get("KVCACHE_TEST_STALL_TOKEN")
_ALTER = os.environ.get("KVCACHE_TEST_ALTER_PAGE")
_ALTER_NTH = int(os.environ.get("KVCACHE_TEST_ALTER_NTH_PAGE", "0"))

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

if _ALTER or _ALTER_NTH:
    import kvnode.store.page_store

    _put = kvnode.store.page_store.PageStore.put
    _altered = []
    _stored = []

    def _altering_put(self, key, parent, data, checksum=None):
        outcome = _put(self, key, parent, data, checksum)
        if outcome == kvnode.store.page_store.PutOutcome.STORED:
            _stored.append(None)
        chosen = key.hex() == _ALTER if _ALTER else len(_stored) == _ALTER_NTH
        if chosen and outcome == kvnode.store.page_store.PutOutcome.STORED and not _altered:
            with self._lock:
                self._pool[self._index[key].slot, 5] ^= 0x04
            _altered.append(key)
        return outcome

    kvnode.store.page_store.PageStore.put = _altering_put
