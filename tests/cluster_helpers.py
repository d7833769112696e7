"""Starting and stopping kvcache daemons in tests, in-process or as real processes.

Rules these helpers keep (so integration tests can reuse them safely): only
127.0.0.1, ports picked by the OS (port 0), every process stopped by its own pid,
every wait bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import grpc

from base import serving
from kvcache.launch import Daemon
from kvnode.client import NodeClient
from kvnode.service import SERVICE_NAME, KVStoreService, handler
from kvnode.store.page_store import PageStore

STOP_GRACE_S = 0.5
# The test nodes' shape unless a test asks for another: small, so everything stays fast.
NODE_PAGE_BYTES = 1024
NODE_CAPACITY_PAGES = 8


@dataclass
class InProcessNode:
    """A KVStore service on a real gRPC server in this process; the store is open to inspection."""

    address: str
    store: PageStore
    service: KVStoreService
    server: grpc.Server

    def client(self, **kwargs) -> NodeClient:
        return NodeClient(self.address, **kwargs)


@contextlib.contextmanager
def serve_node(
    store: PageStore,
    *,
    max_keys: int = 8,
    max_message_bytes: int = 64 * 1024,
    service_cls: type[KVStoreService] = KVStoreService,
) -> Iterator[InProcessNode]:
    """Serve `store` on 127.0.0.1 at a free port until the block ends (stop is bounded)."""
    service = service_cls(store, "test-node", max_keys, max_message_bytes)
    server, health = serving.make_server([handler(service)], [SERVICE_NAME], max_message_bytes, max_workers=4)
    port = serving.bind(server, "127.0.0.1", 0)
    server.start()
    try:
        yield InProcessNode(f"127.0.0.1:{port}", store, service, server)
    finally:
        serving.stop(server, health, STOP_GRACE_S)


@contextlib.contextmanager
def data_plane_nodes(capacity_pages: int) -> Iterator[Callable[[int], InProcessNode]]:
    """make(page_bytes): a kvnode in this process with its gRPC service and data plane, holding
    capacity_pages pages of that size; every one made is stopped when the block ends."""
    from kvnode.data_plane.server import DataPlaneServer

    with contextlib.ExitStack() as stack:
        def make(page_bytes: int) -> InProcessNode:
            store = PageStore(capacity_pages, page_bytes)
            node = stack.enter_context(serve_node(store, max_keys=64))
            plane = DataPlaneServer(store, "127.0.0.1", 0, max_keys=64).start()
            stack.callback(plane.stop)
            node.service.data_port = plane.port
            return node

        yield make


@contextlib.contextmanager
def started(tmp_path: Path, role: str, name: str, *args: str, env=None, stop_timeout_s: float = 10.0) -> Iterator[Daemon]:
    """A daemon of `role` on a free port, logging to tmp_path/NAME.log; stopped when the block ends."""
    daemon = Daemon(role, ["--port", "0", *args], log_path=tmp_path / f"{name}.log", env=env)
    try:
        yield daemon
    finally:
        daemon.stop(timeout_s=stop_timeout_s)


def kvcache_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvcache.cli", *args]


@contextlib.contextmanager
def node_process(log_dir: Path, *args: str, timeout_s: float = 30.0) -> Iterator[Daemon]:
    """`kvcache node --port 0 ...` as a child process; its address is read from the line it prints.

    Stopped (SIGTERM, then SIGKILL) by its own pid when the block ends. Its stderr goes to
    a file in log_dir, shown by `read_log`.
    """
    daemon = Daemon("node", ["--host", "127.0.0.1", "--port", "0", *args], log_path=log_dir / "node.log",
                    timeout_s=timeout_s)
    try:
        yield daemon
    finally:
        daemon.stop(timeout_s=5.0)


def free_port() -> int:
    """A TCP port free on loopback now (a daemon restarted on fixed ports takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_log(log_dir: Path) -> str:
    path = log_dir / "node.log"
    return path.read_text(errors="replace") if path.exists() else ""


def run_kvcache(args: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """Run `kvcache ...` to completion (for commands that should exit on their own)."""
    return subprocess.run(kvcache_command(*args), capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    """True as soon as predicate() is; False after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def raw_channel(address: str, max_message_bytes: int = 256 * 1024 * 1024) -> grpc.Channel:
    """A channel for hand-made requests: methods on it take and return bytes as they are."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )


def collect(events) -> tuple[list[int], object]:
    """Token ids of a generate() stream and its Finished event (asserting there is one)."""
    from base.generation import Finished, Piece

    tokens, finished = [], None
    for event in events:
        if isinstance(event, Piece):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None, "the stream ended without a final message"
    return tokens, finished


def run_bench(bench: str, args: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
    """`kvcache bench BENCH ARGS` to completion; on timeout SIGTERM it (a bench stops its own
    cluster on SIGTERM), then kill it, and fail the test."""
    import pytest

    process = subprocess.Popen(kvcache_command("bench", bench, *args), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
        pytest.fail(f"bench {bench} did not finish in {timeout_s}s: {err[-2000:]}")
    return process.returncode, out, err


def cluster_down(command: Sequence[str], run_dir: Path, members: Sequence[dict]) -> subprocess.CompletedProcess:
    """`COMMAND down --run-dir RUN_DIR` (command: the CLI up to `cluster`), then SIGKILL whatever
    member it left running, each by its own pid: a test's cluster never outlives it."""
    from kvcache.cluster import _is_ours

    down = subprocess.run([*command, "down", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120)
    for member in members:
        if _is_ours(member["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(member["pid"], signal.SIGKILL)
    return down
