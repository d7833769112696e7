"""A real local cluster with a real `kvcache gateway` process in front of it, for the gateway's
tests: the model is a small random Llama GGUF with a ChatML template (chats work, and it runs
fast on two cores), whose tokenizer the gateway loads from the same file (--tokenizer). Every
process is stopped by its own pid when the block ends, also on failure."""

from __future__ import annotations

import contextlib
import http.client as http_client
import json
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import httpx2
import openai

from gguf_helpers import write_gguf
from kvcache.cluster import LocalCluster, start_cluster, wait_healthy
from kvcache.launch import Daemon
from openai_schema import CheckedTransport
from worker.model.testing import llama_config, random_tensors_for

PAGE_TOKENS = 16


def write_chat_model(folder: Path, max_positions: int = 4096) -> Path:
    config = llama_config(vocab_size=300, eos_token_id=2, max_positions=max_positions)
    path = folder / "chat.gguf"
    write_gguf(path, config, random_tensors_for(config, seed=31))
    return path


@contextlib.contextmanager
def cluster_with_gateway(folder: Path, *gateway_args: str, metrics: bool = True, nodes: int = 2,
                         workers: int = 1, key: str | None = None) -> Iterator[tuple[LocalCluster, Daemon]]:
    """`key`: the cluster wants this client key (a tokens file), which callers send as their API key."""
    model = write_chat_model(folder)
    tokens_file = None
    if key is not None:
        tokens_file = folder / "tokens"
        tokens_file.write_text(f"tests {key}\n")
    with start_cluster(folder / "logs", nodes=nodes, workers=workers, coordinators=1, replicas=1, model=str(model),
                       node_capacity="16MiB", worker_kv_cache="16MiB", metrics=metrics,
                       tokens_file=tokens_file) as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=nodes, workers=workers, client_options={"token": key})
        args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(cluster.coordinator_addresses),
                "--tokenizer", str(model)]
        gateway = Daemon("gateway", [*args, *gateway_args],
                         log_path=folder / "logs" / "gateway.log")
        try:
            yield cluster, gateway
        finally:
            gateway.stop(timeout_s=10.0)


def openai_client(gateway_url: str, key: str = "unused", timeout_s: float = 60.0) -> openai.OpenAI:
    """The real openai client; every reply and streamed chunk it gets is checked against OpenAI's
    published schema as it arrives (openai_schema.py), so every test that uses it checks the shapes."""
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key=key, max_retries=0, timeout=timeout_s,
                         http_client=httpx2.Client(transport=CheckedTransport()))


def http(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout_s: float = 30.0) -> tuple[int, dict, bytes]:
    """One plain HTTP request: (status, headers, body)."""
    parts = urlsplit(url)
    connection = http_client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def post_json(url: str, path: str, body: object, timeout_s: float = 30.0, key: str | None = None) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    status, _, data = http(url, "POST", path, json.dumps(body).encode(), headers=headers, timeout_s=timeout_s)
    return status, json.loads(data)
