"""vLLM engines in processes of their own (vllm_engine.py, run with vLLM's Python) and a local cluster
sized for their blocks, for `kvcache bench vllm` and the vLLM tests; every process stopped by its own id."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from coordinator.client import Client
from kvcache.launch import Daemon

DRIVER_MODULE = "kvcache.bench.vllm_engine"  # run with -m: as a script, its folder's vllm.py would shadow vLLM
START_TIMEOUT_S = 240.0
ASK_TIMEOUT_S = 180.0
BLOCK_TOKENS = 128  # vLLM's CPU block


def connector_config(coordinators: list[str], **extra) -> dict:
    return {"kv_connector": "KVCacheConnector", "kv_connector_module_path": "vllm_connector.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"coordinators": coordinators, **extra}}


class EngineFailed(RuntimeError):
    """The engine exited or went quiet; the message names its log."""


class Engine:
    """kvcache/bench/vllm_engine.py in a process group of its own (vLLM's engine core is its child)."""

    def __init__(self, model_dir: Path, log_path: Path, kv_transfer_config: dict | None = None,
                 python: str = sys.executable):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [python, "-m", DRIVER_MODULE, str(model_dir), json.dumps(kv_transfer_config) if kv_transfer_config else ""],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._expect("READY", START_TIMEOUT_S)
        except BaseException:
            self.close(timeout_s=0)
            raise

    def ask(self, prompts: list[str], max_tokens: int = 8, cache_salt: str | None = None) -> list[dict]:
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                             "cache_salt": cache_salt}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._expect("RESULT ", ASK_TIMEOUT_S)[len("RESULT "):])

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self, timeout_s: float = 60.0) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the engine core too, whatever happened above
        self.process.wait(timeout=10)
        self._log.close()

    def _read(self) -> None:
        for line in self.process.stdout:  # the answers alone: the engine logs straight into log_path
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise EngineFailed(f"the vLLM engine said no {prefix!r} within {timeout_s:.0f} s; log: "
                                     f"{self.log_path}") from None
            if line is None:
                raise EngineFailed(f"the vLLM engine exited before {prefix!r}; log {self.log_path}:\n"
                                     + self.log()[-3000:])
            if line.startswith(prefix):
                return line


@contextlib.contextmanager
def engine(model_dir: Path, log_path: Path, kv_transfer_config: dict | None = None,
           python: str = sys.executable) -> Iterator[Engine]:
    e = Engine(model_dir, log_path, kv_transfer_config, python)
    try:
        yield e
    finally:
        e.close()


class LocalCluster:
    """A coordinator and kvnodes sized for vLLM's blocks of the model, as `kvcache cluster up --vllm-model` makes."""

    def __init__(self, log_dir: Path, page_bytes: int, nodes: int = 2, replicas: int = 2, capacity: str = "512MiB",
                 node_env: dict | None = None):
        env = node_env
        self.members: list[Daemon] = []
        try:
            self.coordinator = self._start("coordinator", log_dir / "coordinator.log",
                                           ["--port", "0", "--replicas", str(replicas)], None)
            self.nodes = [self._start("node", log_dir / f"node{i}.log",
                                      ["--port", "0", "--page-bytes", str(page_bytes), "--capacity", capacity,
                                       "--coordinators", self.coordinator.address], env)
                          for i in range(nodes)]
            self.wait_until_seen(nodes)
        except BaseException:
            self.stop()
            raise

    @property
    def coordinators(self) -> list[str]:
        return [self.coordinator.address]

    def _start(self, role: str, log: Path, args: list[str], env) -> Daemon:
        daemon = Daemon(role, args, log_path=log, env=env)
        self.members.append(daemon)
        return daemon

    def wait_until_seen(self, nodes: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        with Client(self.coordinators) as client:
            while time.monotonic() < deadline:
                status = client.status()
                if sum(1 for m in status.members if m.role == "node" and m.alive) == nodes:
                    return
                time.sleep(0.1)
        raise AssertionError(f"the coordinator did not see {nodes} live kvnodes within {timeout_s} s")

    def stop(self) -> None:
        for daemon in reversed(self.members):
            daemon.stop(timeout_s=10.0)


@contextlib.contextmanager
def local_cluster(log_dir: Path, page_bytes: int, **kwargs) -> Iterator[LocalCluster]:
    cluster = LocalCluster(log_dir, page_bytes, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()


def wait_until_saved(addresses: list[str], settle_s: float = 0.5, timeout_s: float = 60.0) -> None:
    """Saves are asynchronous: wait until the kvnodes' page counts stop changing."""
    from kvnode.client import NodeClient

    clients = [NodeClient(a) for a in addresses]
    try:
        deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
        while time.monotonic() < deadline:
            used = [c.info().used_pages for c in clients]
            if used != last:
                last, since = used, time.monotonic()
            elif time.monotonic() - since >= settle_s:
                return
            time.sleep(0.05)
    finally:
        for c in clients:
            c.close()
