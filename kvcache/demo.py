"""`make demo`: start a local cluster, show the cache at work, shut everything down.

Runs the default model (SmolLM2-135M-Instruct; another as the first argument). Sends, as chats
that the workers render with the model's template: (1) one question under a shared system
prompt, cold; (2) four more questions under the same system prompt at once, so they spread over
both workers and the second worker fetches the system prompt's pages from the kvnodes; (3) a
three-turn chat whose every turn extends the last (the second question needs the first's answer).
Prints each answer and a table of time to first token and where prompt tokens came from.
`python -m kvcache.demo --data-dir DIR` keeps the kvnodes' pages in DIR: a second run finds them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from base.generation import Finished, Piece
from coordinator.client import Client
from kvcache.bench.report import print_table
from kvcache.cluster import start_cluster, wait_healthy
from kvcache.generate import printable
from worker.model.named import DEFAULT_MODEL

MODEL = DEFAULT_MODEL   # SmolLM2-135M-Instruct: a real model, so the answers can be judged
SYSTEM = ("You are a helpful assistant at a bakery. Answer in one short sentence. The bakery opens at 7am "
          "and closes at 7pm. It sells bread, croissants and cakes. The bread of the day is rye bread.")
QUESTIONS = [
    "What time does the bakery open?",
    "How many days are there in a week?",
    "How many legs does a spider have?",
    "Does the bakery sell croissants?",
    "What color is the sky on a clear day?",
]
CHAT_SYSTEM = "You are a helpful assistant. Answer in one short sentence."   # a chat of its own: cold at first
CHAT = ["What is the capital of France?", "What is it famous for?", "How tall is the Eiffel Tower?"]
MAX_TOKENS = 32


def ask(client: Client, label: str, messages: list[dict], session: str = "") -> dict:
    text, finished = [], None
    started = time.perf_counter()
    for event in client.generate(messages, session_id=session, max_tokens=MAX_TOKENS):
        if isinstance(event, Piece):
            text.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    usage = finished.usage
    return {"label": label, "answer": "".join(text), "ttft_ms": usage.ttft_ms, "prompt": usage.prompt_tokens,
            "local": usage.cached_tokens_local, "remote": usage.cached_tokens_remote,
            "computed": usage.computed_tokens, "total_ms": (time.perf_counter() - started) * 1000}


def question(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i]}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcache.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=MODEL, help=f"the model to run (default {MODEL})")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="keep the kvnodes' pages in DIR between runs (default: RAM only)")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="kvcache-demo-")) / "logs"
    model = args.model
    print(f"Starting a local cluster: 2 coordinators, 3 kvnodes, 2 workers (model: {model}) ...", flush=True)
    data_dir = Path(args.data_dir).resolve() if args.data_dir else None
    with start_cluster(logs, nodes=3, workers=2, coordinators=2, replicas=2, model=model, node_capacity="64MiB",
                       worker_kv_cache="64MiB", data_dir=data_dir) as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=3, workers=2)
        print(f"coordinators {', '.join(cluster.coordinator_addresses)}; logs in {logs}\n", flush=True)
        rows = []
        with Client(cluster.coordinator_addresses) as client:
            rows.append(ask(client, "system prompt, question 1 (cold)", question(0)))
            with ThreadPoolExecutor(max_workers=4) as pool:
                rows += pool.map(lambda i: ask(client, f"system prompt, question {i + 1}", question(i)),
                                 range(1, len(QUESTIONS)))
            history = [{"role": "system", "content": CHAT_SYSTEM}]
            for turn, message in enumerate(CHAT, start=1):
                history.append({"role": "user", "content": message})
                row = ask(client, f"chat turn {turn}" + (" (cold)" if turn == 1 else ""), history, session="demo-chat")
                history.append({"role": "assistant", "content": row["answer"]})
                rows.append(row)
        questions = QUESTIONS + CHAT
        for row, asked in zip(rows, questions):
            answer = printable(row["answer"]).replace("\n", " ").replace("\t", " ")
            print(f"[{row['label']}] {asked}\n    -> {answer[:110]}")
        print()
        print_table(
            ["request", "ttft ms", "prompt tok", "local cache", "from kvnodes", "computed"],
            [[r["label"], r["ttft_ms"], r["prompt"], r["local"], r["remote"], r["computed"]] for r in rows],
        )
        warm = [r for r in rows if "(cold)" not in r["label"]]
        cached = sum(r["local"] + r["remote"] for r in warm)
        prompt = sum(r["prompt"] for r in warm)
        print(f"\nBeyond the two cold requests, {cached} of {prompt} prompt tokens ({cached / prompt:.0%}) "
              f"came from the cache.")
        if model != MODEL:
            print(f"Model {model}: with random weights (tiny), the answers are noise; the cache columns are the point.")
        print("Shutting the cluster down ...", flush=True)
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
