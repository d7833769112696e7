"""Where a sequence's blocks live: the ring over the cluster's live kvnodes, as the coordinators place.

With coordinators, a thread asks them for the live kvnodes every `refresh_s` (the ring is a pure
function of that set, so this view places as they do); kvnodes whose pages are another size are
left out, with one warning. With a fixed kvnode list, the ring is built once.
"""

from __future__ import annotations

import logging
import threading

from coordinator.client import Client, ClusterError
from coordinator.ring import Ring
from vllm_connector.settings import Settings

log = logging.getLogger("vllm_connector")

DEFAULT_REPLICAS = 2
STATUS_TIMEOUT_S = 2.0


class Placement:
    def __init__(self, settings: Settings, page_bytes: int):
        self.page_bytes = page_bytes
        self._replicas = settings.replicas or DEFAULT_REPLICAS
        self._ring = Ring({address: 1 << 30 for address in settings.kvnodes})
        self._stop = threading.Event()
        self._told: set[str] = set()  # warnings given once
        self._client: Client | None = None
        self._thread: threading.Thread | None = None
        if settings.coordinators:
            self._ring = Ring({})
            self._fixed_replicas = bool(settings.replicas)
            self._client = Client(list(settings.coordinators), token=settings.client_token(), tls_ca=settings.tls_ca or None,
                                  tls_cert=settings.tls_cert or None, tls_key=settings.tls_key or None)
            self._refresh_s = settings.refresh_s
            self.refresh()
            self._thread = threading.Thread(target=self._refresh_loop, name="kvcache-placement", daemon=True)
            self._thread.start()

    def nodes(self, key_hex: str) -> list[str]:
        """The kvnodes holding the sequence whose first block's key is `key_hex`, primary first."""
        return self._ring.placement(key_hex, self._replicas)

    def num_nodes(self) -> int:
        return len(self._ring.nodes)

    def refresh(self) -> None:
        try:
            status = self._client.status(timeout=STATUS_TIMEOUT_S)
        except ClusterError as exc:
            self._warn_once("status", "no coordinator answered (%s); no blocks are found or saved until one does", exc)
            return
        self._told.discard("status")
        live = {m.address: m.capacity_bytes for m in status.members if m.role == "node" and m.alive}
        matching = {a: c for a, c in live.items() if status_page_bytes(status, a) == self.page_bytes}
        if live and not matching:
            self._warn_once("pages", "none of the cluster's %d kvnodes stores pages of %d bytes (one layer of one of "
                            "vLLM's blocks of this model): start kvnodes with --page-bytes %d (`kvcache cluster up "
                            "--vllm-model` does)", len(live), self.page_bytes, self.page_bytes)
        if not self._fixed_replicas and status.replicas:
            self._replicas = status.replicas
        if set(matching) != set(self._ring.nodes):
            self._ring = Ring(matching)  # a new ring, swapped in whole (coordinator/ring.py)
            log.info("kvcache placement: %d kvnodes (epoch %s)", len(matching), self._ring.epoch)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STATUS_TIMEOUT_S + 1)
        if self._client is not None:
            self._client.close()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - the view stays as it was; the next refresh tries again
                log.exception("kvcache placement: refreshing the cluster view failed")

    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._told:
            self._told.add(what)
            log.warning("kvcache connector: " + message, *args)


def status_page_bytes(status, address: str) -> int:
    return next((m.page_bytes for m in status.members if m.address == address and m.role == "node"), 0)
