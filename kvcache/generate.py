"""`kvcache generate`: send one prompt through the coordinators (or straight to one worker,
for debugging) and stream the answer; --json prints one object at the end.

The prompt is a user message: the worker renders the model's chat template around it (an
instruct model answers a chat, and continues raw text with junk), and a model without a template
gets it as plain text instead. --raw sends plain text to continue. With --session the chat's turns
are kept in a file of this machine's (chat_sessions.py), so the next turn sends the whole
conversation. Without --coordinators it finds the cluster as client_target.py says.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import grpc

from base import security
from base.generation import Finished, Piece
from coordinator.client import Client, ClusterError, TlsMismatch
from kvcache import client_target
from kvcache.chat_sessions import ChatSession
from worker.client import WorkerClient, WorkerError

UINT32_MAX = 2**32 - 1
NO_TEMPLATE = "has no chat template"   # a worker's refusal of messages for a model without one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None,
                        help="what to ask, sent as a chat's user message (the worker renders the model's chat "
                             "template; a model without one gets the text as it is); with --raw, text to continue")
    parser.add_argument("--chat", metavar="TEXT",
                        help="the user message, as PROMPT, but refused by a model without a chat template")
    parser.add_argument("--system", metavar="TEXT", help="the chat's system message (a session's first turn)")
    parser.add_argument("--raw", action="store_true",
                        help="send PROMPT as plain text for the model to continue (a completion), no chat template")
    where = client_target.add_arguments(parser)
    where.add_argument("--worker", metavar="HOST:PORT",
                       help="talk to this worker directly instead of the coordinators, for debugging")
    parser.add_argument("--nodes", default="", help="with --worker: kvnode addresses for the pages, primary first: A,B")
    parser.add_argument("--session", default="",
                        help="session id: the turns of one chat share their placement, and the conversation so "
                             "far is kept on this machine and sent again with each turn (give it from the first)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="most tokens to generate, at least 1 (default 64; workers allow at most their "
                             "--max-tokens-limit, default 4096)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass, in (0, 1] (1: all)")
    parser.add_argument("--seed", type=int, default=None, help="the same seed gives the same text (0 to 2^64-1)")
    parser.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    parser.add_argument("--no-cache", action="store_true", help="bypass every cache tier (recompute the whole prompt)")
    parser.add_argument("--priority", type=int, default=0, help="lower is scheduled first on the worker (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, usage")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up (default 300)")


@dataclass
class Prompt:
    """What to send: text, or chat messages; `session` records a chat's turn; `may_be_raw`: a chat
    that a model without a template may take as plain text instead (the user asked for no chat)."""

    value: str | list[dict]
    session: ChatSession | None = None
    may_be_raw: bool = False


def run(args: argparse.Namespace) -> int:
    try:
        check_numbers(args)
        prompt = _prompt(args)
        if args.worker:
            target = None
            credentials = security.from_args(args, client=True)
            token = client_target.client_token(args)
        else:
            target = client_target.resolve(args)
            credentials = token = None
    except ValueError as exc:
        print(f"kvcache generate: error: {exc}", file=sys.stderr)
        return 2
    if target is not None and target.found_in is not None:
        print(target.describe(), file=sys.stderr, flush=True)
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
    out = Output(args.json)
    try:
        try:
            finished = _generate(args, target, credentials, token, prompt.value, options, out)
        except (WorkerError, ClusterError) as exc:
            if not (prompt.may_be_raw and exc.code == grpc.StatusCode.INVALID_ARGUMENT and NO_TEMPLATE in exc.details):
                raise
            print("kvcache generate: the model has no chat template: the prompt goes as plain text (--raw)",
                  file=sys.stderr, flush=True)
            prompt = Prompt(prompt.value[-1]["content"])
            finished = _generate(args, target, credentials, token, prompt.value, options, out)
    except (WorkerError, ClusterError, ValueError) as exc:
        out.end_line()
        if isinstance(exc, WorkerError) and exc.code == grpc.StatusCode.UNAVAILABLE and not out.pieces:
            mismatch = security.tls_mismatch(args.worker, credentials, "the worker")  # base/security.py says why
            if mismatch is not None:
                print(f"kvcache generate: error: {mismatch}", file=sys.stderr)
                return 1
        hint = (target.hint() if target is not None and getattr(exc, "code", None) == grpc.StatusCode.UNAVAILABLE
                and not isinstance(exc, TlsMismatch) else "")
        print(f"kvcache generate: error: {exc}{hint}", file=sys.stderr)
        return 1
    if finished is None:
        out.end_line()
        print("kvcache generate: error: the stream ended without a final message", file=sys.stderr)
        return 1
    if prompt.session is not None:
        prompt.session.save_turn(prompt.value, out.answer)
    if args.json:
        result = {
            "text": out.answer,
            "token_ids": out.token_ids,
            "finish_reason": finished.finish_reason,
            "usage": asdict(finished.usage),
        }
        print(json.dumps(result))
    else:
        out.end_line(answered=True)
        usage = finished.usage
        print(
            f"[{finished.finish_reason}] prompt {usage.prompt_tokens} tokens: "
            f"{usage.cached_tokens_local} from local cache, {usage.cached_tokens_remote} from kvnodes, "
            f"{usage.computed_tokens} computed; {usage.completion_tokens} generated; ttft {usage.ttft_ms:.1f} ms",
            file=sys.stderr,
        )
    return 0


class Output:
    """The answer as it streams: printed as it comes (but with --json), kept whole."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.pieces: list[str] = []
        self.token_ids: list[int] = []

    @property
    def answer(self) -> str:
        return "".join(self.pieces)

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece.text)
        self.token_ids.extend(piece.token_ids)
        if not self.quiet:
            print(printable(piece.text), end="", flush=True)

    def end_line(self, answered: bool = False) -> None:
        """End the printed text with a newline, so a shell prompt, a pipe's reader or an error
        starts a line of its own; an answer ends with one even when empty (one line of output)."""
        if not self.quiet and (answered or self.pieces) and not self.answer.endswith("\n"):
            print(flush=True)


def _generate(args, target, credentials, token, prompt, options: dict, out: Output) -> Finished | None:
    if args.worker:
        client = WorkerClient(args.worker, timeout=args.timeout, credentials=credentials, token=token)
        events = client.generate(prompt, **options)
    else:
        client = Client(target.coordinators, timeout=args.timeout, **target.options)
        events = client.generate(prompt, session_id=args.session,
                                 **{k: v for k, v in options.items() if k != "placement"})
    finished = None
    with client:
        for event in events:
            if isinstance(event, Piece):
                out.add(event)
            elif isinstance(event, Finished):
                finished = event
    return finished


def check_numbers(args: argparse.Namespace) -> None:
    """Each number in its range, so a user reads which option is wrong (not protobuf's
    "Value out of range"); the workers' own limits (--max-tokens-limit) they say themselves."""
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.max_tokens > UINT32_MAX:
        raise ValueError(f"--max-tokens {args.max_tokens} is more than any worker allows "
                         "(their --max-tokens-limit, default 4096)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if not 0 <= args.top_k <= UINT32_MAX:
        raise ValueError(f"--top-k must be 0 (all tokens) or a number of tokens, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be more than 0 and at most 1, got {args.top_p}")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise ValueError(f"--seed must be between 0 and 2^64-1, got {args.seed}")
    if not -2**31 <= args.priority < 2**31:
        raise ValueError(f"--priority must be between -2^31 and 2^31-1, got {args.priority}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be more than 0 seconds, got {args.timeout}")


def _prompt(args: argparse.Namespace) -> Prompt:
    if args.raw:
        if args.chat is not None or args.system is not None:
            raise ValueError("--raw sends plain text: it takes no --chat or --system")
        if args.prompt is None:
            raise ValueError("give the text to continue: kvcache generate --raw TEXT")
        return Prompt(args.prompt)
    if args.prompt is not None and args.chat is not None:
        raise ValueError("give the prompt or --chat TEXT, not both")
    if args.prompt is None and args.chat is None:
        raise ValueError('give a prompt: kvcache generate "What is the capital of France?"')
    session = ChatSession.open(args.session) if args.session else None
    history = session.messages if session else []
    if args.system is not None:
        if history and history[0] != {"role": "system", "content": args.system}:
            raise ValueError(f"session {args.session!r} already has its first turn: --system starts a session")
        if not history:
            history = [{"role": "system", "content": args.system}]
    text = args.chat if args.chat is not None else args.prompt
    # Plain text instead only for a lone question: a system message or earlier turns need the template.
    return Prompt(history + [{"role": "user", "content": text}], session, may_be_raw=args.chat is None and not history)


def printable(text: str) -> str:
    """Text safe for a terminal: control characters (a random model emits them) become U+FFFD."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd" for ch in text)

