"""`kvcache bench vllm`: time to first token of a vLLM engine whose prompt's prefix another engine saw, with
that KV recomputed, loaded from kvcache (same host), or from vLLM's ExampleConnector (files).

A writer engine answers prompts of a prefix and a question; then a new reader engine (another
process, an empty local cache) answers the same prefixes with another question ("shared prefix",
the workload a KV cache is for) and, on other prefixes, the writer's very prompts ("same prompt").
(The ExampleConnector keys a prompt by its tokens up to its last whole block, so it hits on both
here, where every question fits in the prefix's last block; a longer question would be a miss for
it.) Each reader first answers one unrelated prompt, so no row pays an engine's first request
(kvcache's first contact with a kvnode maps its pool). Times are vLLM's own first-token latency,
medians over the repeats. The recompute rows come from an engine
without a connector, which answers each prompt twice: cold, then from vLLM's own prefix cache
(the same computation a hit from any connector does, so its tokens are what a hit must give).
kvcache's fetch rate comes from its connector's load lines. Last, the kvcache reader answers more
prompts while one of the two kvnodes is SIGKILLed: every request must finish with the same tokens.
Needs vLLM's environment (`make test-vllm` makes .venv-vllm and the model folder).
Goals at 2,048 tokens, shared prefix: kvcache >= 10x lower TTFT than recompute and >= 1.5x lower
than the ExampleConnector; identical tokens; 0 failed requests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from kvcache.bench.report import dump_json, machine, print_table
from kvcache.bench.vllm_run import (BLOCK_TOKENS, EngineFailed, connector_config, engine, local_cluster,
                                    wait_until_saved)
from kvcache.model_pages import vllm_block_pages

DEFAULT_PYTHON = ".venv-vllm/bin/python"
DEFAULT_MODEL = ".venv-vllm/models/smollm2-135m"
KILL_PROMPTS, KILL_TOKENS = 4, 1024
QUESTION_TOKENS = 32
_LOAD_LINE = re.compile(r"loaded (\d+) blocks \(([\d.]+) MB\) from kvnode \S+ in ([\d.]+) ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--python", default=DEFAULT_PYTHON,
                        help=f"a Python with vLLM (default {DEFAULT_PYTHON}, which `make test-vllm` makes)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a Hugging Face model folder (default {DEFAULT_MODEL}: the default model, exported)")
    parser.add_argument("--prefix-tokens", default="512,2048,4096",
                        help="prompt lengths measured, comma-separated (default 512,2048,4096)")
    parser.add_argument("--repeats", type=int, default=2, help="prompts of each length; medians shown (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    try:
        sizes = [int(s) for s in args.prefix_tokens.split(",") if s.strip()]
        if not sizes or min(sizes) < BLOCK_TOKENS or max(sizes) > 8000 or any(s % BLOCK_TOKENS for s in sizes) \
                or args.repeats < 1:
            raise ValueError
    except ValueError:
        print(f"kvcache bench vllm: error: --prefix-tokens takes multiples of {BLOCK_TOKENS} (vLLM's block) up to 8000, "
              "and --repeats a positive count", file=sys.stderr)
        return 2
    problem = _check_vllm(args.python, Path(args.model))
    if problem:
        print(f"kvcache bench vllm: error: {problem}", file=sys.stderr)
        return 2
    pages = vllm_block_pages(args.model)
    try:
        report = _measure(args, sizes, pages.page_bytes)
    except EngineFailed as exc:
        print(f"kvcache bench vllm: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        dump_json({"machine": machine(), **report})
        return 0
    _print(report)
    return 0


def _measure(args: argparse.Namespace, sizes: list[int], page_bytes: int) -> dict:
    rng = np.random.default_rng(0)

    def tokens(count: int) -> list[int]:
        return rng.integers(1000, 40000, count).tolist()

    def prompts_of(prefixes: dict, question: int) -> list[list[int]]:
        return [prefix + questions[question] for s in sizes for prefix in prefixes[s]]

    questions = [tokens(QUESTION_TOKENS) for _ in range(2)]
    shared = {s: [tokens(s) for _ in range(args.repeats)] for s in sizes}   # whole blocks: all of it is cacheable
    same = {s: [tokens(s) for _ in range(args.repeats)] for s in sizes}
    written, asked, repeated = prompts_of(shared, 0), prompts_of(shared, 1), prompts_of(same, 0)
    kill_prompts = [tokens(KILL_TOKENS) + questions[0] for _ in range(KILL_PROMPTS)]
    warm_up = [tokens(3 * BLOCK_TOKENS)]
    model, python = Path(args.model), args.python
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-vllm-") as tmp:
        logs = Path(tmp)
        say = (lambda text: None) if args.json else (lambda text: print(text, file=sys.stderr, flush=True))
        say("recompute: an engine without a connector, each prompt cold and then from its own prefix cache")
        with engine(model, logs / "recompute.log", python=python) as plain:
            plain.ask(warm_up)
            cold = {"shared": plain.ask(asked), "same": plain.ask(repeated), "kill": plain.ask(kill_prompts)}
            warm = {"shared": plain.ask(asked), "same": plain.ask(repeated), "kill": plain.ask(kill_prompts)}
        results = {"recompute": cold, "vLLM prefix cache": warm}
        with local_cluster(logs, page_bytes, nodes=2, replicas=2, capacity="1GiB") as cluster:
            config = connector_config(cluster.coordinators)
            say("kvcache: a writer, then a reader")
            with engine(model, logs / "kvcache-writer.log", config, python) as writer:
                writer.ask(written + repeated + kill_prompts)
            wait_until_saved([n.address for n in cluster.nodes])
            with engine(model, logs / "kvcache-reader.log", config, python) as reader:
                reader.ask(warm_up)
                results["kvcache"] = {"shared": reader.ask(asked), "same": reader.ask(repeated)}
                say("kvcache: a kvnode killed while the reader answers")
                survived = reader.ask(kill_prompts[:1])
                cluster.nodes[0].kill()
                survived += _ask_each(reader, kill_prompts[1:])
                loads = _loads(reader.log())
        lmcache_why = _lmcache_missing(python)
        if lmcache_why is None:
            say("LMCache (its multi-process connector and server): a writer, then a reader")
            with lmcache_server(python, logs / "lmcache-server.log") as lmcache:
                with engine(model, logs / "lmcache-writer.log", lmcache, python) as writer:
                    writer.ask(written + repeated)
                with engine(model, logs / "lmcache-reader.log", lmcache, python) as reader:
                    reader.ask(warm_up)
                    results["lmcache"] = {"shared": reader.ask(asked), "same": reader.ask(repeated)}
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": str(logs / "example")}}
        say("ExampleConnector: a writer, then a reader")
        with engine(model, logs / "example-writer.log", example, python) as writer:
            writer.ask(written + repeated)
        with engine(model, logs / "example-reader.log", example, python) as reader:
            reader.ask(warm_up)
            results["example"] = {"shared": reader.ask(asked), "same": reader.ask(repeated)}
    report = _report(sizes, args.repeats, results, survived, warm["kill"], loads)
    report["lmcache"] = LMCACHE_NOTE + ("" if lmcache_why is None else f"; its multi-process connector not run: {lmcache_why}")
    return report


# Measured on this machine with lmcache 0.5.6 (docs/vllm.md): its in-process connector has no CPU path.
LMCACHE_NOTE = ("LMCacheConnectorV1 cannot run on vLLM's CPU build (lmcache 0.5.6 has no CPU connector for vLLM: "
                "'No supported cpu connector found', then every lookup times out); the row is its multi-process "
                "connector, LMCacheMPConnector, against an `lmcache server` on this host")
LMCACHE_PORT_TIMEOUT_S = 120.0


def _lmcache_missing(python: str) -> str | None:
    """Why the LMCache row cannot run with `python`, or None."""
    if not Path(python).with_name("lmcache").is_file():
        return "lmcache is not installed beside vLLM (`make bench-vllm-deps` installs it)"
    done = subprocess.run([python, "-c", "import lmcache.v1"], capture_output=True, text=True, timeout=120)
    return None if done.returncode == 0 else f"lmcache does not import: {done.stderr.strip()[-200:]}"


@contextlib.contextmanager
def lmcache_server(python: str, log_path: Path) -> Iterator[dict]:
    """An `lmcache server` on free loopback ports, and the kv_transfer_config that reaches it; stopped by its pid.
    Engine-driven transfers are the CPU client's; observability needs an exporter lmcache does not pull in."""
    port, http_port = _free_port(), _free_port()
    command = [str(Path(python).with_name("lmcache")), "server", "--host", "127.0.0.1", "--port", str(port),
               "--http-port", str(http_port), "--l1-size-gb", "2", "--eviction-policy", "LRU", "--chunk-size", "256",
               "--disable-observability", "--disable-metrics", "--supported-transfer-mode", "auto"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                  env=dict(os.environ, LMCACHE_DISABLE_BANNER="1"))
    try:
        deadline = time.monotonic() + LMCACHE_PORT_TIMEOUT_S
        while not _listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise EngineFailed(f"the lmcache server did not listen on {port}; log {log_path}")
            time.sleep(0.2)
        yield {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _check_vllm(python: str, model: Path) -> str | None:
    try:
        done = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python} ({exc}): `make test-vllm` makes .venv-vllm, or give --python"
    if done.returncode != 0:
        return f"{python} cannot import vllm: `make test-vllm` makes .venv-vllm, or give --python"
    if not (model / "config.json").is_file():
        return f"{model} is no model folder: `kvcache export-hf {model}` writes the default model there"
    return None


def _ask_each(reader, prompts: list) -> list[dict]:
    """Each prompt alone; a request that fails counts as failed instead of ending the bench."""
    answers = []
    for prompt in prompts:
        try:
            answers += reader.ask([prompt], max_tokens=8)
        except EngineFailed as exc:
            answers.append({"failed": str(exc)[:200]})
    return answers


def _loads(log: str) -> dict:
    found = [(int(b), float(mb), float(ms)) for b, mb, ms in _LOAD_LINE.findall(log)]
    megabytes, millis = sum(f[1] for f in found), sum(f[2] for f in found)
    return {"loads": len(found), "megabytes": round(megabytes, 1),
            "gb_per_s": round(megabytes / 1e3 / (millis / 1e3), 2) if millis else None}


def _report(sizes, repeats, results, survived, kill_reference, loads) -> dict:
    """Per workload and prefix length: each method's median TTFT and least cached tokens, whether its
    tokens equal the cold and the prefix-cached recompute's, and kvcache's speed-ups."""
    tables = {}
    for workload in ("shared", "same"):
        rows = []
        for i, size in enumerate(sizes):
            span = slice(i * repeats, (i + 1) * repeats)
            row = {"prefix_tokens": size}
            for method, answers in results.items():
                chunk = answers[workload][span]
                row[method] = {
                    "ttft_ms": round(statistics.median(a["ttft"] or a["seconds"] for a in chunk) * 1e3, 1),
                    "cached": min(a["cached"] for a in chunk),
                    "as_cold": all(a["tokens"] == r["tokens"] for a, r in zip(chunk, results["recompute"][workload][span])),
                    "as_prefix_cache": all(a["tokens"] == r["tokens"]
                                           for a, r in zip(chunk, results["vLLM prefix cache"][workload][span])),
                }
            kv = row["kvcache"]["ttft_ms"]
            row["kvcache_vs_recompute"] = round(row["recompute"]["ttft_ms"] / kv, 1)
            row["kvcache_vs_example"] = round(row["example"]["ttft_ms"] / kv, 1)
            if "lmcache" in row:
                row["kvcache_vs_lmcache"] = round(row["lmcache"]["ttft_ms"] / kv, 1)
            rows.append(row)
        tables[workload] = rows
    failed = sum(1 for a in survived if "failed" in a)
    differing = sum(1 for a, ref in zip(survived, kill_reference) if "failed" not in a and a["tokens"] != ref["tokens"])
    return {"shared_prefix": tables["shared"], "same_prompt": tables["same"], "fetch": loads,
            "kvnode_killed": {"requests": len(survived), "failed": failed, "differing": differing}}


def _print(report: dict) -> None:
    methods = [m for m in ("recompute", "vLLM prefix cache", "kvcache", "example", "lmcache") if m in report["shared_prefix"][0]]
    others = [m for m in ("recompute", "example", "lmcache") if m in methods]
    for title, key in (("shared prefix (a new question after a prefix the writer saw)", "shared_prefix"),
                       ("same prompt (the writer's very prompt)", "same_prompt")):
        print(f"\n{title}: TTFT ms (cached tokens)")
        headers = ["prefix", *methods, *(f"kvcache vs {m}" for m in others), "tokens as vLLM's prefix cache"]
        print_table(headers, [[r["prefix_tokens"], *(f"{r[m]['ttft_ms']} ({r[m]['cached']})" for m in methods),
                               *(f"{r[f'kvcache_vs_{m}']}x" for m in others),
                               ", ".join(f"{m}: {'yes' if r[m]['as_prefix_cache'] else 'NO'}"
                                         for m in methods if m not in ("recompute", "vLLM prefix cache"))]
                              for r in report[key]])
    f, k = report["fetch"], report["kvnode_killed"]
    print(f"\nkvcache fetches: {f['loads']} loads, {f['megabytes']} MB, {f['gb_per_s']} GB/s")
    print(f"a kvnode killed mid-run: {k['requests']} requests, {k['failed']} failed, {k['differing']} differing")
    print(f"LMCache: {report['lmcache']}")
