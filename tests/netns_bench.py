"""`kvcache bench remote` across hosts: the kvnode on one network namespace, the bench on another,
and (unless --direct) the harness's delaying TCP proxy on a third, in front of both the node's
gRPC and data ports; the node advertises the proxy's host, so its Info sends the data plane
through the proxy too (tests/netns_programs.py: PROXY; this kernel has no netem).

As root, from the repository:

    .venv/bin/python tests/netns_bench.py --model gpt2-small-shape --prompt-tokens 1024 --delay-ms 1

prints the bench's figures (--json: its JSON object, with "path" added). The namespaces, the node
and the proxy are removed by name and pid when it ends, also on failure. The test
test_bench_remote_across_hosts_through_a_delaying_proxy runs it small (tiny model) and checks
only that the warm prompt came from the node through the proxy."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcache.model_pages import model_page_bytes
from netns_helpers import Hosts, first_line, why_no_namespaces
from netns_programs import PROXY

NODE_PORT, DATA_PORT = 50051, 50052


def bench_remote_across_hosts(log_dir: Path, model: str = "tiny", prompt_tokens: int = 256,
                              kv_dtype: str = "float16", repeats: int = 1, delay_ms: float | None = 1.0,
                              timeout_s: float = 600.0) -> tuple[dict, str]:
    """The bench's JSON result (with "path": how it reached the node) and its stderr. delay_ms None:
    no proxy, the bench dials the node's host itself."""
    page_bytes = model_page_bytes(model, kv_dtype)
    capacity = page_bytes * (prompt_tokens // 16 + 1) * (2 * repeats + 2)  # what bench remote asks of a node
    with Hosts(["node", "proxy", "bench"]) as hosts, contextlib.ExitStack() as running:
        node_host, proxy_host = hosts.addresses["node"], hosts.addresses["proxy"]
        advertised = node_host if delay_ms is None else proxy_host
        node = hosts.daemon("node", "node", ["--port", str(NODE_PORT), "--data-port", str(DATA_PORT),
                                             "--page-bytes", str(page_bytes), "--capacity", str(capacity),
                                             "--advertise", f"{advertised}:{NODE_PORT}"],
                            log_path=log_dir / "node.log")
        running.callback(node.stop, 10.0)
        if delay_ms is not None:
            proxy = hosts.start_python("proxy", PROXY, str(delay_ms), proxy_host, f"{NODE_PORT}:{node_host}:{NODE_PORT}",
                                       f"{DATA_PORT}:{node_host}:{DATA_PORT}")
            running.callback(lambda: proxy.poll() is None and proxy.kill())
            if first_line(proxy, timeout_s=30.0).strip() != "ready":
                detail = proxy.stderr.read()[-2000:] if proxy.poll() is not None else "no 'ready' within 30 s"
                raise RuntimeError(f"the delaying proxy did not start: {detail}")
        bench = subprocess.run([*hosts.prefix("bench"), sys.executable, "-m", "kvcache.cli", "bench", "remote",
                                "--model", model, "--prompt-tokens", str(prompt_tokens), "--kv-dtype", kv_dtype,
                                "--repeats", str(repeats), "--json", "--node", f"{advertised}:{NODE_PORT}"],
                               capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if bench.returncode != 0:
            raise RuntimeError(f"bench remote failed (exit {bench.returncode}): {bench.stderr[-2000:]}")
        result = json.loads(bench.stdout)
        result["path"] = "direct" if delay_ms is None else f"proxy, {delay_ms:g} ms each way"
        return result, bench.stderr


def summary(result: dict) -> str:
    ttft = result["ttft_ms"]
    return (f"{result['path']}: cold {ttft['cold']:.0f} ms, warm from kvnode {ttft['warm_remote']:.1f} ms "
            f"({result['speedup_remote_vs_cold']:.1f}x faster than cold), fill {result['fill_ms']:.1f} ms, "
            f"warm-local {ttft['warm_local']:.1f} ms ({result['remote_vs_local']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-small-shape")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--kv-dtype", choices=["float32", "float16"], default="float16")
    parser.add_argument("--repeats", type=int, default=3, help="prompts measured; the bench shows medians")
    path = parser.add_mutually_exclusive_group()
    path.add_argument("--delay-ms", type=float, default=1.0, help="added by the proxy in each direction (default 1)")
    path.add_argument("--direct", action="store_true", help="no proxy: the bench dials the node's host")
    parser.add_argument("--json", action="store_true", help="print the bench's JSON object")
    args = parser.parse_args(argv)
    why_not = why_no_namespaces()
    if why_not is not None:
        print(f"netns_bench: cannot run: {why_not}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvcache-netns-bench-") as log_dir:
        result, _ = bench_remote_across_hosts(Path(log_dir), args.model, args.prompt_tokens, args.kv_dtype,
                                              args.repeats, None if args.direct else args.delay_ms)
    print(json.dumps(result) if args.json else summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
