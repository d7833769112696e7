"""`make demo`: start a local cluster, show the cache at work, shut everything down.

Sends (1) one question under a shared system prompt, cold; (2) four more questions under the
same system prompt at once, so they spread over both workers and the second worker fetches
the system prompt's pages from the kvnodes; (3) a three-turn chat whose every turn extends
the last. Prints each answer and a table of time to first token and where prompt tokens came from.
`python -m kvcache.demo --data-dir DIR` keeps the kvnodes' pages in DIR: a second run finds them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coordinator.client import Client, Finished, Piece
from kvcache.bench.report import print_table
from kvcache.cluster import start_cluster, wait_healthy
from kvcache.generate import printable

SYSTEM = (
    "You are the assistant of a small bakery in Lyon. You answer in one or two sentences, you never "
    "invent prices, and you suggest the bread of the day when someone is unsure what to buy. "
    "Opening hours: Tuesday to Sunday, 7am to 7pm. "
)
QUESTIONS = [
    "Do you have rye bread today?",
    "Can I order a birthday cake for Saturday?",
    "Is the croissant made with butter?",
    "Do you deliver to the Croix-Rousse?",
    "What is the bread of the day?",
]
CHAT = ["Hello! I need bread for a dinner of eight people.", "Which one keeps best until tomorrow?",
        "Great, and something sweet for dessert?"]
MAX_TOKENS = 24


def ask(client: Client, label: str, prompt: str, session: str = "") -> dict:
    text, finished = [], None
    started = time.perf_counter()
    for event in client.generate(prompt, session_id=session, max_tokens=MAX_TOKENS):
        if isinstance(event, Piece):
            text.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    usage = finished.usage
    return {"label": label, "answer": "".join(text), "ttft_ms": usage.ttft_ms, "prompt": usage.prompt_tokens,
            "local": usage.cached_tokens_local, "remote": usage.cached_tokens_remote,
            "computed": usage.computed_tokens, "total_ms": (time.perf_counter() - started) * 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcache.demo", description=__doc__)
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="keep the kvnodes' pages in DIR between runs (default: RAM only)")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="kvcache-demo-")) / "logs"
    print("Starting a local cluster: 2 coordinators, 3 kvnodes, 2 workers (model: tiny) ...", flush=True)
    data_dir = Path(args.data_dir).resolve() if args.data_dir else None
    with start_cluster(logs, nodes=3, workers=2, coordinators=2, replicas=2, node_capacity="32MiB",
                       worker_kv_cache="32MiB", data_dir=data_dir) as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=3, workers=2)
        print(f"coordinators {', '.join(cluster.coordinator_addresses)}; logs in {logs}\n", flush=True)
        rows = []
        with Client(cluster.coordinator_addresses) as client:
            rows.append(ask(client, "system prompt, question 1 (cold)", SYSTEM + QUESTIONS[0]))
            with ThreadPoolExecutor(max_workers=4) as pool:
                rows += pool.map(lambda i: ask(client, f"system prompt, question {i + 1}", SYSTEM + QUESTIONS[i]),
                                 range(1, len(QUESTIONS)))
            history = SYSTEM
            for turn, message in enumerate(CHAT, start=1):
                history += f"\nUser: {message}\nAssistant:"
                row = ask(client, f"chat turn {turn}", history, session="demo-chat")
                history += row["answer"]
                rows.append(row)
        for row in rows:
            answer = printable(row["answer"]).replace("\n", " ").replace("\t", " ")
            print(f"[{row['label']}] {answer[:70]}")
        print()
        print_table(
            ["request", "ttft ms", "prompt tok", "local cache", "from kvnodes", "computed"],
            [[r["label"], r["ttft_ms"], r["prompt"], r["local"], r["remote"], r["computed"]] for r in rows],
        )
        cached = sum(r["local"] + r["remote"] for r in rows[1:])
        prompt = sum(r["prompt"] for r in rows[1:])
        print(f"\nAfter the first request, {cached} of {prompt} prompt tokens ({cached / prompt:.0%}) came from the cache.")
        print("The tiny model has random weights, so its answers are noise; the cache columns are the point.")
        print("Shutting the cluster down ...", flush=True)
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
