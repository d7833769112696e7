"""`kvcache cluster up --vllm-model DIR`: coordinators and kvnodes whose page is one layer of one vLLM
block, no workers, and the kv_transfer_config vLLM needs printed and written to the run dir; a folder
that cannot be read is refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_helpers import cluster_down
from coordinator.client import Client
from gguf_helpers import write_hf_folder
from kvcache import cluster_vllm
from kvcache.model_pages import VllmBlockPages, vllm_block_pages
from kvnode.client import NodeClient
from vllm_connector.settings import Settings
from worker.model.testing import llama_config, random_tensors_for

CLI = [sys.executable, "-m", "kvcache.cli", "cluster"]
# 3 layers, 2 KV heads of 64 // 4 = 16 dims.
CONFIG = llama_config(vocab_size=300, eos_token_id=2, n_layers=3)
SMOLLM2_135M = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30,
                "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": True, "hidden_act": "silu", "vocab_size": 49152, "eos_token_id": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("hf") / "tiny-llama", CONFIG, random_tensors_for(CONFIG))


def up(run_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "up", "--run-dir", str(run_dir), "--detach", "--nodes", "2", "--coordinators", "2",
                           "--node-capacity", "64MiB", "--no-metrics", *options],
                          capture_output=True, text=True, timeout=180)


def members_of(run_dir: Path) -> list[dict]:
    cluster_file = run_dir / "cluster.json"
    return json.loads(cluster_file.read_text())["members"] if cluster_file.exists() else []


def node_status(coordinators: list[str]) -> dict:
    """`kvcache status --json`, as a user would look at the cluster."""
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "status", "--json", "--coordinators",
                           ",".join(coordinators)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_page_is_one_layer_of_a_vllm_block(tmp_path):
    """vLLM's AttentionSpec.page_size_bytes: 2 x block_size x KV heads x head_dim x dtype bytes."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    assert vllm_block_pages(tmp_path).page_bytes == 2 * 128 * 3 * 64 * 2 == 98_304
    assert vllm_block_pages(tmp_path, 16, "float32").page_bytes == 2 * 16 * 3 * 64 * 4
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2_135M, "head_dim": 128}))
    pages = vllm_block_pages(tmp_path, dtype="float16")
    assert (pages.page_bytes, pages.layers) == (2 * 128 * 3 * 128 * 2, 30)


def test_kvnodes_take_a_whole_block_in_one_request():
    """--max-keys stays the kvnode's default up to 256 layers and follows the layers past it."""
    assert cluster_vllm.max_keys(VllmBlockPages(4096, 30, 16, 2, 16, "float32")) is None
    assert cluster_vllm.max_keys(VllmBlockPages(4096, 300, 16, 2, 16, "float32")) == 300
    assert cluster_vllm.max_keys(None) is None


def test_cluster_up_for_vllm_starts_kvnodes_of_vllm_pages_and_no_worker(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    done = up(run_dir, "--vllm-model", str(model_dir))
    try:
        assert done.returncode == 0, done.stderr
        members = members_of(run_dir)
        assert sorted(m["role"] for m in members) == ["coordinator", "coordinator", "node", "node"]
        coordinators = [m["address"] for m in members if m["role"] == "coordinator"]
        page_bytes = 2 * 128 * 2 * 16 * 2
        assert f"kvnode pages: {page_bytes} bytes" in done.stdout

        written = json.loads((run_dir / cluster_vllm.KV_TRANSFER_FILE).read_text())
        assert str(run_dir / cluster_vllm.KV_TRANSFER_FILE) in done.stdout
        assert json.dumps(written) in done.stdout
        assert written == {"kv_connector": "KVCacheConnector", "kv_connector_module_path": "vllm_connector.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"coordinators": coordinators}}
        assert Settings.from_extra_config(written["kv_connector_extra_config"]).coordinators == tuple(coordinators)
        assert json.loads((run_dir / "cluster.json").read_text())["vllm"]["page_bytes"] == page_bytes

        for coordinator in coordinators:
            status = node_status([coordinator])
            assert sorted(m["role"] for m in status["members"]) == ["node", "node"]  # no worker registered
            assert all(m["alive"] and int(m["page_bytes"]) == page_bytes for m in status["members"])
    finally:
        down = cluster_down(CLI, run_dir, members_of(run_dir))
    assert down.returncode == 0, down.stderr
    assert "stopped 4 processes" in down.stdout
    assert not (run_dir / "cluster.json").exists() and not (run_dir / cluster_vllm.KV_TRANSFER_FILE).exists()


def test_a_secure_vllm_cluster_gives_the_connector_a_worker_certificate_and_a_token(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    done = up(run_dir, "--vllm-model", str(model_dir), "--secure", "--vllm-block-size", "32",
              "--vllm-dtype", "float32", "--replicas", "1")
    try:
        assert done.returncode == 0, done.stderr
        settings = Settings.from_extra_config(
            json.loads((run_dir / cluster_vllm.KV_TRANSFER_FILE).read_text())["kv_connector_extra_config"])
        assert settings.tls_cert.endswith(f"{cluster_vllm.CONNECTOR_CERT}.pem")
        with Client(list(settings.coordinators), token=settings.client_token(), tls_ca=settings.tls_ca,
                    tls_cert=settings.tls_cert, tls_key=settings.tls_key) as client:
            status = client.status()
        nodes = [m for m in status.members if m.role == "node"]
        assert len(nodes) == 2 and len(status.members) == 2 and status.replicas == 1
        page_bytes = 2 * 32 * 2 * 16 * 4
        with NodeClient(nodes[0].address, credentials=settings.credentials()) as node:  # kvnodes take its pages
            assert node.info().page_bytes == page_bytes
            assert node.put_pages([b"k" * 16], [b""], [bytes(page_bytes)]).stored == 1
    finally:
        down = cluster_down(CLI, run_dir, members_of(run_dir))
    assert down.returncode == 0, down.stderr


@pytest.mark.parametrize("folder, options, message", [
    ("empty", [], "--vllm-model: no config.json in"),
    ("bert", [], "unsupported architecture model_type='bert'"),
    ("model", ["--workers", "1"], "--workers is for kvcache's own workers and gateway"),
    ("model", ["--model", "tiny", "--gateway-port", "8000"], "--model and --gateway-port are for kvcache's own"),
    ("model", ["--vllm-block-size", "0"], "--vllm-block-size must be at least 1, got 0"),
    ("model", ["--node-capacity", "16KiB"], "--node-capacity 16KiB holds no whole vLLM block"),
    (None, ["--vllm-dtype", "float16"], "--vllm-dtype needs --vllm-model"),
])
def test_what_cannot_make_a_vllm_cluster_is_refused_in_one_line_before_anything_starts(
        tmp_path, model_dir, folder, options, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    where = {"model": model_dir}.get(folder, tmp_path / folder) if folder else None
    run_dir = tmp_path / "run"
    done = subprocess.run([*CLI, "up", "--run-dir", str(run_dir), "--detach",
                           *(["--vllm-model", str(where)] if where else []), *options],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not run_dir.exists()  # nothing started, nothing written
