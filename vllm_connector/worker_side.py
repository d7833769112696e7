"""The connector's worker side: loads into vLLM's blocks and saves out of them, both on threads of their own.

Loads land straight in vLLM's block memory (a page is one layer's block, contiguous there) over
the kvnode's data plane, or from its shared pool on the same host. A request is reported done only
once its fetch returned, so nothing writes into its blocks afterwards; blocks that did not arrive
intact are reported as load errors and vLLM recomputes them. Saves copy the new blocks out after
the step (a memory copy, ~1% of the step that computed them) and send them from a thread, so a
request never waits for a save; past `save_buffer_mib` of unsent copies, new blocks go unsaved.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from kvnode.client import NodeError, PageRejected
from vllm_connector.keys import block_pages, last_layer_keys
from vllm_connector.plan import BlockLoad, BlockSave
from vllm_connector.settings import Settings
from worker.remote.nodes import Node, NodeTable

log = logging.getLogger("vllm_connector")

MAX_QUEUED_SAVES = 4096


@dataclass
class Counters:
    blocks_loaded: int = 0
    blocks_failed: int = 0     # reported to vLLM as load errors: recomputed
    pages_altered: int = 0     # failed their checksum: dropped from the node, recomputed
    blocks_saved: int = 0
    blocks_unsaved: int = 0    # the save buffer was full, or no node took them


@dataclass
class _Save:
    spec: BlockSave
    pages: np.ndarray  # (layers, blocks, page_bytes): each layer taken from vLLM's memory in one call


class WorkerSide:
    def __init__(self, settings: Settings, nodes: NodeTable, layers: list[np.ndarray]):
        """`layers`: vLLM's KV cache of each layer in the keys' layer order, as (num_blocks, page_bytes) uint8 views."""
        self.settings = settings
        self.nodes = nodes
        self.layers = layers
        self.page_bytes = layers[0].shape[1]
        self.counters = Counters()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._errors: set[int] = set()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcache-load")
        self._save_budget = settings.save_buffer_mib << 20
        self._saves: queue.Queue[_Save | None] = queue.Queue(MAX_QUEUED_SAVES)
        self._saver = threading.Thread(target=self._save_loop, name="kvcache-save", daemon=True)
        self._saver.start()

    # ---- loads ---------------------------------------------------------------------

    def start_loads(self, loads: list[BlockLoad]) -> None:
        for load in loads:
            self._loader.submit(self._load, load)

    def take_finished_loads(self) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the blocks among them that vLLM must recompute."""
        with self._lock:
            done, errors = self._done, self._errors
            self._done, self._errors = set(), set()
        return done, errors

    def _load(self, load: BlockLoad) -> None:
        num_landed = 0
        try:
            num_landed = self._fetch(load)
        except Exception:  # noqa: BLE001 - whatever went wrong, the request goes on: vLLM recomputes
            log.exception("kvcache: loading %d blocks of request %s failed", len(load.block_ids), load.req_id)
        failed = load.block_ids[num_landed:]
        with self._lock:
            self.counters.blocks_loaded += num_landed
            self.counters.blocks_failed += len(failed)
            self._errors.update(failed)
            self._done.add(load.req_id)

    def _fetch(self, load: BlockLoad) -> int:
        """How many of the load's blocks, from the first, landed intact."""
        num_layers = len(self.layers)
        deadline = time.monotonic() + self.settings.load_timeout_s
        with self.nodes.use([load.address]) as held:
            if not held or not self.nodes.ready(held[0], until=deadline):
                log.warning("kvcache: kvnode %s cannot be reached; request %s recomputes %d blocks", load.address,
                            load.req_id, len(load.block_ids))
                return 0
            node = held[0]
            per_batch = max(1, node.max_keys // num_layers)
            if node.max_keys < num_layers:
                log.warning("kvcache: kvnode %s takes %d keys a request, fewer than this model's %d layers; "
                            "start it with --max-keys %d or more", node.address, node.max_keys, num_layers, num_layers)
                return 0
            starts = range(0, len(load.block_ids), per_batch)
            batches = [[k for key in load.block_keys[s:s + per_batch] for k in block_pages(key, None, num_layers)[0]]
                       for s in starts]
            landed = 0

            def out_for(i: int) -> list[np.ndarray]:
                return [self.layers[layer][block] for block in load.block_ids[starts[i]:starts[i] + per_batch]
                        for layer in range(num_layers)]

            def count(i: int) -> None:
                nonlocal landed
                landed = min(len(load.block_ids), starts[i] + per_batch)

            began = time.perf_counter()
            try:
                node.client.get_pages_in_batches(batches, out_for, count, timeout=max(0.001, deadline - time.monotonic()))
            except PageRejected as exc:
                bad = exc.index // num_layers
                with self._lock:  # two loader threads count
                    self.counters.pages_altered += 1
                log.warning("kvcache: a page of request %s from kvnode %s failed its checksum; it is dropped there and "
                            "%d blocks are recomputed", load.req_id, node.address, len(load.block_ids) - bad)
                self._drop(node, exc.key)
                return bad
            except NodeError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:  # evicted or dropped meanwhile: a miss, the node is fine
                    self.nodes.failed(node, exc)
                log.warning("kvcache: loading request %s from kvnode %s failed (%s: %s); %d blocks are recomputed",
                            load.req_id, node.address, exc.code.name, exc.details, len(load.block_ids) - landed)
                return landed
            self.nodes.succeeded(node)
            seconds = time.perf_counter() - began
            nbytes = len(load.block_ids) * num_layers * self.page_bytes
            log.info("kvcache: request %s loaded %d blocks (%.1f MB) from kvnode %s in %.1f ms (%.2f GB/s)",
                     load.req_id, len(load.block_ids), nbytes / 1e6, node.address, seconds * 1e3,
                     nbytes / max(seconds, 1e-9) / 1e9)
            return len(load.block_ids)

    def _drop(self, node: Node, key: bytes) -> None:
        try:
            node.client.drop_pages([key], timeout=self.settings.lookup_timeout_s)
        except NodeError as exc:
            log.info("kvcache: kvnode %s did not drop the altered page (%s)", node.address, exc.code.name)

    # ---- saves ---------------------------------------------------------------------

    def save(self, saves: list[BlockSave]) -> None:
        """Copy the blocks of `saves` out of vLLM's memory now (this step computed them) and queue them."""
        for spec in saves:
            nbytes = len(spec.block_ids) * len(self.layers) * self.page_bytes
            with self._lock:
                room = nbytes <= self._save_budget
                if room:
                    self._save_budget -= nbytes
                else:
                    self.counters.blocks_unsaved += len(spec.block_ids)
            if not room:
                continue
            pages = np.empty((len(self.layers), len(spec.block_ids), self.page_bytes), dtype=np.uint8)
            ids = np.asarray(spec.block_ids)
            for layer, cache in enumerate(self.layers):
                np.take(cache, ids, axis=0, out=pages[layer], mode="clip")
            try:
                self._saves.put_nowait(_Save(spec, pages))
            except queue.Full:
                self._release(pages, len(spec.block_ids))

    def wait_for_saves(self, timeout: float) -> bool:
        """True once every queued save was sent (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._saves.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def _release(self, pages: np.ndarray, unsaved: int) -> None:
        with self._lock:
            self._save_budget += pages.nbytes
            self.counters.blocks_unsaved += unsaved

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            try:
                if item is None:
                    return
                saved = 0
                for address in item.spec.addresses:
                    try:
                        saved = max(saved, self._send(address, item))
                    except Exception:  # noqa: BLE001 - a save is best effort: a later request recomputes
                        log.exception("kvcache: saving to kvnode %s failed", address)
                self._release(item.pages, len(item.spec.block_ids) - saved)
                with self._lock:
                    self.counters.blocks_saved += saved
            finally:
                self._saves.task_done()

    def _send(self, address: str, item: _Save) -> int:
        """Put the blocks this node lacks; -> how many of the save's blocks it holds afterwards."""
        spec, num_layers = item.spec, len(self.layers)
        deadline = time.monotonic() + self.settings.load_timeout_s
        with self.nodes.use([address]) as held:
            if not held or not self.nodes.ready(held[0], until=deadline):
                return 0
            node = held[0]
            try:
                present = self._present(node, spec, deadline)
                if present < spec.first:
                    return 0  # the node lacks blocks before these (evicted, or it joined later): they would be refused
                per_batch = max(1, node.max_keys // num_layers)
                for start in range(present, len(spec.block_keys), per_batch):
                    end = min(start + per_batch, len(spec.block_keys))
                    keys, parents = [], []
                    for b in range(start, end):
                        k, p = block_pages(spec.block_keys[b], spec.block_keys[b - 1] if b else None, num_layers)
                        keys += k
                        parents += p
                    rows = [item.pages[layer, b - spec.first] for b in range(start, end) for layer in range(num_layers)]
                    result = node.client.put_pages(keys, parents, rows, timeout=max(0.001, deadline - time.monotonic()))
                    if result.refused:
                        return start - spec.first  # no room, or a parent evicted meanwhile: the rest would be refused too
            except NodeError as exc:
                self.nodes.failed(node, exc)
                return 0
            self.nodes.succeeded(node)
            return len(spec.block_ids)

    def _present(self, node: Node, spec: BlockSave, deadline: float) -> int:
        """How many of the sequence's blocks, from the first, the node holds already."""
        wanted = last_layer_keys(spec.block_keys, len(self.layers))
        held = 0
        for start in range(0, len(wanted), node.max_keys):
            part = wanted[start:start + node.max_keys]
            found = node.client.lookup(part, lease_ms=0, timeout=max(0.001, deadline - time.monotonic()))
            held += found
            if found < len(part):
                break
        return held

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        try:
            self._saves.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._saver.join(timeout=self.settings.load_timeout_s)
