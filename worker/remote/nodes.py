"""The remote tier's known kvnodes: first contact off the caller's thread, back-off, a bounded table.

Placement addresses come from clients, so an address is worth nothing until its node answered.
First contact with a node, and re-contact after it failed, is a probe (its Info) on a probe
thread: a caller waits for it at most until a moment it chooses (`ready`; the engine's side a
few tens of ms), and until the node answered it is a miss for that call while the probe goes on.
A node on loopback answers in a few ms, so the very first request that names it uses it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import grpc

from kvnode.client import NodeClient, NodeError, NodeInfo

log = logging.getLogger("worker.remote")


@dataclass
class Node:
    address: str
    client: NodeClient
    max_keys: int = 1  # most pages the node takes in one request (from its info)
    max_lookup_keys: int = 1  # ... in one lookup that leases (its info's max_leases_per_call, if lower)
    answered: bool = False  # its Info answered with our page size, and no call failed since (probe, failed)
    refused: bool = False  # page size does not match: never used
    down_until: float = 0.0  # no probe before this (monotonic seconds)
    num_failures: int = 0  # in a row; sets the back-off
    probe: Future | None = None  # an Info in flight on a probe thread
    num_users: int = 0  # callers holding it, and its probe: never evicted while > 0


class NodeTable:
    def __init__(
        self,
        page_bytes: int,
        info_timeout_s: float,
        retry_after_s: float,
        max_retry_after_s: float,
        max_nodes: int,
        max_probes: int,
        on_failure: Callable[[], None] = lambda: None,
        credentials=None,
        on_answered: Callable[[Node], None] = lambda node: None,
        page_sizes: dict[str, int] | None = None,
    ):
        if max_nodes < 1 or max_probes < 1:
            raise ValueError(f"max_nodes and max_probes must be positive, got {max_nodes} and {max_probes}")
        self.page_bytes = page_bytes
        self.page_sizes = page_sizes or {}   # KV dtype -> this model's page bytes in it: names a refused node's dtype
        self.info_timeout_s = info_timeout_s
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max(retry_after_s, max_retry_after_s)
        self.max_nodes = max_nodes
        self.max_probes = max_probes
        self.on_failure = on_failure
        self.on_answered = on_answered  # after a node's first answer, on the probe thread
        self.credentials = credentials  # base.security.Credentials: mutual TLS to kvnodes
        self._nodes: OrderedDict[str, Node] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._num_probes = 0
        self._prober = ThreadPoolExecutor(max_workers=max_probes, thread_name_prefix="kv-probe")
        self._closed = False

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, address: str) -> Node | None:
        return self._nodes.get(address)

    def addresses(self) -> list[str]:
        """Known nodes, least recently used first."""
        with self._lock:
            return list(self._nodes)

    def num_probes(self) -> int:
        return self._num_probes

    # ---- callers ---------------------------------------------------------------

    @contextlib.contextmanager
    def use(self, addresses: Sequence[str]) -> Iterator[list[Node]]:
        """The nodes of `addresses` that could be held, in order, held for the block; probes started where needed."""
        held, evicted = [], []
        with self._lock:
            for address in addresses:
                node = self._nodes.get(address)
                if node is None and not self._closed:
                    node = self._add(address, evicted)
                if node is None:
                    continue
                self._nodes.move_to_end(address)
                node.num_users += 1
                held.append(node)
                self._maybe_probe(node)
        for node in evicted:
            node.client.close()
        try:
            yield held
        finally:
            with self._lock:
                for node in held:
                    node.num_users -= 1

    def contact(self, addresses: Sequence[str]) -> None:
        """Start probes where `use` would, holding nothing."""
        with self.use(addresses):
            pass

    def ready(self, node: Node, until: float) -> bool:
        """Whether calls may go to `node`, waiting for its probe no later than `until` (monotonic seconds)."""
        probe = node.probe
        if probe is not None:
            wait([probe], timeout=max(0.0, until - time.monotonic()))
        return node.answered

    def may_be_usable(self, address: str) -> bool:
        """No RPC, no waiting: False only for a node known to be refused or skipped for now."""
        node = self._nodes.get(address)
        return node is None or node.answered or not (node.refused or time.monotonic() < node.down_until)

    def succeeded(self, node: Node) -> None:
        node.num_failures = 0

    def failed(self, node: Node, exc: NodeError) -> None:
        """Skip `node` for its back-off, `retry_after_s` doubled for every failure in a row up to
        `max_retry_after_s`; it is probed again after that, so a dead address costs one probe per
        back-off, on a probe thread. A call that succeeds resets it (a fetch answered NOT_FOUND is an
        answer, not a failure: RemoteTier._fetch_failed). Only the first failure in a row warns."""
        self.on_failure()
        with self._lock:
            node.answered = False
            node.num_failures += 1
            skip_s = min(self.retry_after_s * 2.0 ** min(node.num_failures - 1, 30), self.max_retry_after_s)
            node.down_until = time.monotonic() + skip_s
            first = node.num_failures == 1
        (log.warning if first else log.debug)(
            "kvnode %s failed (%s); skipping it for %.0fs", node.address, exc.code.name, skip_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._prober.shutdown(wait=True, cancel_futures=True)  # a probe ends within info_timeout_s
        with self._lock:
            nodes = list(self._nodes.values())
            self._nodes.clear()
        for node in nodes:
            node.client.close()

    # ---- under the lock --------------------------------------------------------

    def _add(self, address: str, evicted: list[Node]) -> Node | None:
        """A node for `address`; past `max_nodes` it takes a victim's place (its client closed once out
        of the lock), and with every node in use (callers hold at most a placement each) it is None:
        a miss."""
        if len(self._nodes) >= self.max_nodes:
            victim = self._victim()
            if victim is None:
                return None
            del self._nodes[victim.address]
            evicted.append(victim)
        node = self._nodes[address] = Node(address, NodeClient(address, credentials=self.credentials))
        return node

    def _victim(self) -> Node | None:
        """The least recently used node not in use, one that is not answering before a healthy one."""
        idle = [node for node in self._nodes.values() if node.num_users == 0]
        return next((node for node in idle if not node.answered), idle[0] if idle else None)

    def _maybe_probe(self, node: Node) -> None:
        """Start a probe of `node` if it needs one; at most `max_probes` run at once, and past that an
        address that needs one stays a miss."""
        if node.answered or node.refused or node.probe is not None or self._closed:
            return
        if self._num_probes >= self.max_probes or time.monotonic() < node.down_until:
            return
        self._num_probes += 1
        node.num_users += 1
        node.probe = self._prober.submit(self._probe, node)

    # ---- the probe threads -------------------------------------------------------

    def _probe(self, node: Node) -> None:
        try:
            info = node.client.info(timeout=self.info_timeout_s)
        except NodeError as exc:
            self.failed(node, exc)
        except Exception as exc:  # not the node's usual failure: still skipped, and the node always let go of
            log.exception("probing kvnode %s failed", node.address)
            self.failed(node, NodeError(node.address, grpc.StatusCode.UNKNOWN, repr(exc)))
        else:
            self._answered(node, info)
        finally:
            with self._lock:
                node.probe = None
                node.num_users -= 1
                self._num_probes -= 1

    def _answered(self, node: Node, info: NodeInfo) -> None:
        node.max_keys = max(1, info.max_keys_per_request)
        node.max_lookup_keys = min(node.max_keys, info.max_leases_per_call or node.max_keys)
        if info.page_bytes != self.page_bytes:
            node.refused = True
            dtypes = {size: dtype for dtype, size in self.page_sizes.items()}
            theirs, ours = dtypes.get(info.page_bytes), dtypes.get(self.page_bytes)
            log.warning(
                "refusing kvnode %s: its pages are %d bytes%s, this worker's are %d%s "
                "(start the node with the worker's --model and --kv-dtype%s)",
                node.address, info.page_bytes, f" ({theirs} KV of this model)" if theirs else "", self.page_bytes,
                f" ({ours} KV)" if ours else "", f" {ours}" if ours else "",
            )
            return
        try:
            node.client.prepare_data_plane()  # a same-host node's shared pool is mapped before the first fetch
        except Exception as exc:  # noqa: BLE001 - the fetch maps it, or goes over the socket
            log.info("kvnode %s: could not begin mapping its shared pool now (%s); the first fetch will", node.address,
                     exc)
        node.answered = True
        self.on_answered(node)
