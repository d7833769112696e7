"""`kvcache cluster up --vllm-model DIR`: a local cluster whose kvnodes keep a vLLM engine's KV blocks.

vLLM is the engine, so no NumPy worker and no HTTP gateway start (vLLM serves its own API):
coordinators, and kvnodes whose page is one layer of one vLLM block (kvcache/model_pages.py),
the size the vLLM connector (vllm_connector/) stores. What vLLM needs to reach them, its
kv_transfer_config, is printed and written to RUN_DIR/vllm-kv-transfer.json for scripts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from base.units import parse_size
from kvcache.model_pages import VLLM_CPU_BLOCK_SIZE, VLLM_DTYPE_BYTES, VllmBlockPages, vllm_block_pages
from kvnode.service import DEFAULT_MAX_KEYS
from worker.model.config import CheckpointError
from worker.model.named import DEFAULT_MODEL

KV_TRANSFER_FILE = "vllm-kv-transfer.json"
# --secure: a worker certificate of its own for the connector (kvnodes take pages from workers
# only), and a tenant whose token alone is in RUN_DIR/vllm.token (it asks coordinators for status).
CONNECTOR_CERT = "vllm-connector"
TENANT = "vllm"
TOKEN_FILE = "vllm.token"
VLLM_NODE_CAPACITY = "1GiB"
# The NumPy workers' options (and their gateway's) with their defaults: a vLLM cluster starts
# neither, so giving one with --vllm-model is refused rather than silently ignored.
# The pools' sizes (--worker-kv-cache, and --node-capacity) come from the model (kvcache/cluster_sizes.py).
WORKER_DEFAULTS = {"workers": 2, "model": DEFAULT_MODEL, "kv_dtype": "float32", "worker_kv_cache": None,
                   "blas_threads": None, "max_prefill_tokens": None, "alone_prefill_tokens": None,
                   "gateway_port": 0}


def add_arguments(up: argparse.ArgumentParser) -> None:
    vllm = up.add_argument_group(
        "vLLM", "a cluster for vLLM engines (the vllm_connector package): coordinators and kvnodes sized for "
                f"vLLM's blocks, no workers and no gateway; {_flags(list(WORKER_DEFAULTS))} are refused with it")
    vllm.add_argument("--vllm-model", metavar="DIR", default=None,
                      help="the Hugging Face model folder vLLM serves (its config.json gives layers, KV heads "
                           "and head_dim): each kvnode's page is then one layer of one vLLM block, 2 (K and V) "
                           "x block size x KV heads x head_dim x dtype bytes; the kv_transfer_config to give "
                           f"vLLM is printed and written to RUN_DIR/{KV_TRANSFER_FILE}")
    vllm.add_argument("--vllm-block-size", type=int, default=None,
                      help=f"with --vllm-model: tokens per vLLM block, vLLM's --block-size (default "
                           f"{VLLM_CPU_BLOCK_SIZE}, what vLLM's CPU backend uses)")
    vllm.add_argument("--vllm-dtype", choices=sorted(VLLM_DTYPE_BYTES), default=None,
                      help="with --vllm-model: the dtype of vLLM's KV cache, its --dtype (or --kv-cache-dtype "
                           "when given) (default bfloat16)")


def settle_options(args: argparse.Namespace) -> VllmBlockPages | None:
    """Fill in the defaults that depend on the kind of cluster; the vLLM block's pages, or None
    for a cluster of NumPy workers. ValueError for an option the cluster has no use for, or a
    model folder that cannot be read."""
    if args.vllm_model is None:
        given = [name for name in ("vllm_block_size", "vllm_dtype") if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{_flags(given)} need{'s' if len(given) == 1 else ''} --vllm-model")
        for name, default in WORKER_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        return None
    given = [name for name in WORKER_DEFAULTS if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{_flags(given)} {'is' if len(given) == 1 else 'are'} for kvcache's own workers "
                         "and gateway: a --vllm-model cluster starts none (vLLM is the engine and serves the "
                         f"API); leave {'it' if len(given) == 1 else 'them'} out")
    if args.vllm_block_size is not None and args.vllm_block_size < 1:
        raise ValueError(f"--vllm-block-size must be at least 1, got {args.vllm_block_size}")
    try:
        pages = vllm_block_pages(args.vllm_model, args.vllm_block_size or VLLM_CPU_BLOCK_SIZE,
                                 args.vllm_dtype or "bfloat16")
    except CheckpointError as exc:
        raise ValueError(f"--vllm-model: {exc}") from None
    args.workers, args.no_gateway, args.gateway_port = 0, True, 0
    args.model = str(Path(args.vllm_model).resolve())
    args.node_capacity = args.node_capacity or VLLM_NODE_CAPACITY
    block_bytes = pages.page_bytes * pages.layers
    if parse_size(args.node_capacity) < block_bytes:
        raise ValueError(f"--node-capacity {args.node_capacity} holds no whole vLLM block ({pages.layers} layers "
                         f"x {pages.page_bytes} bytes = {block_bytes} bytes): give more")
    return pages


def max_keys(pages: VllmBlockPages | None) -> int | None:
    """The kvnodes' --max-keys: a block's pages, one a layer, go in one request; None keeps the default."""
    return pages.layers if pages is not None and pages.layers > DEFAULT_MAX_KEYS else None


def kv_transfer_config(coordinators: list[str], run_dir: Path, tls_dir: Path | None) -> dict:
    """vLLM's --kv-transfer-config for this cluster: the connector finds the kvnodes through the coordinators."""
    extra: dict = {"coordinators": list(coordinators)}
    if tls_dir is not None:
        extra.update(tls_ca=str(tls_dir / "ca.pem"), tls_cert=str(tls_dir / f"{CONNECTOR_CERT}.pem"),
                     tls_key=str(tls_dir / f"{CONNECTOR_CERT}.key"), token_file=str(run_dir / TOKEN_FILE))
    return {"kv_connector": "KVCacheConnector", "kv_connector_module_path": "vllm_connector.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def write_kv_transfer_config(path: Path, config: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path)


def cluster_file_entry(pages: VllmBlockPages, run_dir: Path) -> dict:
    """What the cluster file records of a vLLM cluster, for scripts."""
    return {"page_bytes": pages.page_bytes, "block_size": pages.block_size, "dtype": pages.dtype,
            "layers": pages.layers, "kv_transfer_config": str(run_dir / KV_TRANSFER_FILE)}


def print_usage(pages: VllmBlockPages, model: str, config: dict, path: Path) -> None:
    """What a vLLM user needs: the page size chosen, the kv_transfer_config, and a command to try."""
    print(f"kvnode pages: {pages.page_bytes} bytes, one layer of a vLLM block: {pages.describe()}; "
          f"{pages.layers} pages a block")
    print(f"vLLM kv_transfer_config (also in {path}):")
    print(json.dumps(config))
    print(f"try: python -m vllm.entrypoints.openai.api_server --model {model} --block-size {pages.block_size} "
          f"--dtype {pages.dtype} --enforce-eager --kv-transfer-config \"$(cat {path})\"", flush=True)


def _flags(names: list[str]) -> str:
    return " and ".join(f"--{name.replace('_', '-')}" for name in names)
