"""`kvcache generate`: send one prompt through the coordinators (or straight to one worker,
for debugging) and stream the answer; --json prints one object at the end. With --chat the
worker renders the model's chat template; with --session too, the chat's turns are kept in a
file of this machine's (chat_sessions.py), so the next turn sends the whole conversation."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from coordinator.client import Client, ClusterError
from kvcache.chat_sessions import ChatSession
from protos import security, tokens
from worker.client import Finished, Piece, WorkerClient, WorkerError

DEFAULT_COORDINATORS = "127.0.0.1:50050"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="the prompt text (or give --chat)")
    parser.add_argument("--chat", metavar="TEXT", help="a user message: the worker renders the model's chat template")
    parser.add_argument("--system", metavar="TEXT", help="with --chat: the system message (a session's first turn)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--coordinators",
        default=None,
        help=f"coordinator addresses, tried in turn: A,B (default {DEFAULT_COORDINATORS}, or $KVCACHE_COORDINATORS)",
    )
    target.add_argument("--worker", help="talk to this worker (host:port) directly instead, for debugging")
    parser.add_argument("--nodes", default="", help="with --worker: kvnode addresses for the pages, primary first: A,B")
    parser.add_argument("--session", default="",
                        help="session id: the turns of one chat share their placement; with --chat, the "
                             "conversation so far is kept and sent again with each turn")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (1: all)")
    parser.add_argument("--seed", type=int, default=None, help="the same seed gives the same text")
    parser.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    parser.add_argument("--no-cache", action="store_true", help="bypass every cache tier (recompute the whole prompt)")
    parser.add_argument("--priority", type=int, default=0, help="lower is scheduled first on the worker (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, usage")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up (default 300)")
    add_token_argument(parser)
    security.add_arguments(parser, client=True)


def run(args: argparse.Namespace) -> int:
    try:
        prompt, session = _prompt(args)
        credentials = security.from_args(args, client=True)
        token = tokens.client_token(args.token_file)
    except ValueError as exc:
        print(f"kvcache generate: error: {exc}", file=sys.stderr)
        return 2
    options = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        placement=[a.strip() for a in args.nodes.split(",") if a.strip()],
        no_cache=args.no_cache,
        priority=args.priority,
    )
    text, token_ids, finished = [], [], None
    try:
        if args.worker:
            client = WorkerClient(args.worker, timeout=args.timeout, credentials=credentials, token=token)
            events = client.generate(prompt, **options)
        else:
            del options["placement"]
            client = Client(coordinator_addresses(args.coordinators), timeout=args.timeout, token=token,
                            **tls_options(args))
            events = client.generate(prompt, session_id=args.session, **options)
        with client:
            for event in events:
                if isinstance(event, Piece):
                    text.append(event.text)
                    token_ids.extend(event.token_ids)
                    if not args.json:
                        print(printable(event.text), end="", flush=True)
                elif isinstance(event, Finished):
                    finished = event
    except (WorkerError, ClusterError, ValueError) as exc:
        print(f"\nkvcache generate: error: {exc}", file=sys.stderr)
        return 1
    if finished is None:
        print("\nkvcache generate: error: the stream ended without a final message", file=sys.stderr)
        return 1
    if session is not None:
        session.save_turn(prompt, "".join(text))
    if args.json:
        result = {
            "text": "".join(text),
            "token_ids": token_ids,
            "finish_reason": finished.finish_reason,
            "usage": asdict(finished.usage),
        }
        print(json.dumps(result))
    else:
        usage = finished.usage
        print(
            f"\n[{finished.finish_reason}] prompt {usage.prompt_tokens} tokens: "
            f"{usage.cached_tokens_local} from local cache, {usage.cached_tokens_remote} from kvnodes, "
            f"{usage.computed_tokens} computed; {usage.completion_tokens} generated; ttft {usage.ttft_ms:.1f} ms",
            file=sys.stderr,
        )
    return 0


def _prompt(args: argparse.Namespace):
    """-> (text or chat messages, the session to record the turn in or None)."""
    if args.chat is None:
        if args.prompt is None:
            raise ValueError("give a prompt, or --chat TEXT")
        if args.system is not None:
            raise ValueError("--system goes with --chat")
        return args.prompt, None
    if args.prompt is not None:
        raise ValueError("give a prompt or --chat TEXT, not both")
    session = ChatSession.open(args.session) if args.session else None
    history = session.messages if session else []
    if args.system is not None:
        if history and history[0] != {"role": "system", "content": args.system}:
            raise ValueError(f"session {args.session!r} already has its first turn: --system starts a session")
        if not history:
            history = [{"role": "system", "content": args.system}]
    return history + [{"role": "user", "content": args.chat}], session


def coordinator_addresses(text: str | None) -> list[str]:
    text = text or os.environ.get("KVCACHE_COORDINATORS") or DEFAULT_COORDINATORS
    return [a.strip() for a in text.split(",") if a.strip()]


def printable(text: str) -> str:
    """Text safe for a terminal: control characters (a random model emits them) become U+FFFD."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd" for ch in text)


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="FILE", default=None,
                        help="a file holding this client's token, sent as `authorization: Bearer TOKEN` "
                             "(default: $KVCACHE_TOKEN; none when unset)")


def tls_options(args: argparse.Namespace) -> dict:
    """Client's TLS keywords from --tls-ca, --tls-cert and --tls-key."""
    return {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}
