"""The `kvcache` command line: one entry point, a subcommand per daemon or tool."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import select
import sys

from base import version

# gRPC's own log lines at INFO (one per failed TLS handshake, "Handshake failed with error ...") would
# come beside ours, which say what happened and what to do (base/security.py: tls_mismatch): only its
# errors, unless the user asks for more. Before any gRPC import: it reads this once.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


# Each command: its name, the module holding its add_arguments and run, and its line in --help.
COMMANDS = (
    ("node", "kvnode.daemon", "start a KV-store node"),
    ("worker", "worker.daemon", "start an inference worker"),
    ("coordinator", "coordinator.daemon", "start a coordinator (membership, ring, routing)"),
    ("gateway", "gateway.daemon", "serve an OpenAI-compatible HTTP API in front of the coordinators"),
    ("cluster", "kvcache.cluster_cli", "start or stop a local multi-process cluster"),
    ("generate", "kvcache.generate", "send a prompt and stream the answer"),
    ("status", "kvcache.status", "show the cluster: members, pages, load"),
    ("bench", "kvcache.bench.cli", "measure a part of the service"),
    ("health", "kvcache.health", "ask a daemon's gRPC health service whether it serves (a probe)"),
    ("certs", "kvcache.certs", "make a development CA and certificates for TLS between members"),
    ("export-hf", "kvcache.export_hf", "write a model as a Hugging Face folder for vLLM and transformers"),
)


def build_parser(words: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command with its options; with `words` (a command line's words that are not
    options), the options of the command they name alone (the others keep their name and help
    line; none for no words: --help and --version need none), and of a bench the one named, so a
    daemon or a probe starts without importing the code of every other command: that took a
    second of each start on a busy machine."""
    only = None if words is None else words[0] if words else ""
    parser = argparse.ArgumentParser(
        prog="kvcache",
        description="A distributed KV-cache service for LLM inference.",
        epilog="`kvcache COMMAND --help` explains each command. Start here: kvcache cluster up",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="show program's version number and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for name, module_name, help in COMMANDS:
        if only is not None and name != only:
            commands.add_parser(name, help=help)
            continue
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "bench" and words:
            module.add_arguments(sub, only=words[1] if len(words) > 1 else None)
        else:
            module.add_arguments(sub)
        if name == "node":
            _add_node_model_options(sub)
            sub.set_defaults(run=_run_node)
        elif name == "gateway":
            sub.set_defaults(run=_run_gateway)
        elif hasattr(module, "run"):  # else its own subcommands set theirs (bench, cluster)
            sub.set_defaults(run=module.run)
        if name == "worker":
            _say_models(sub)
    return parser


class _Version(argparse.Action):
    """--version, the version read only when asked (base/version.py)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"kvcache {version.installed()}")  # on stdout, as argparse's own version action
        parser.exit()


def _words(argv: list[str]) -> list[str]:
    """argv's words that are not options: first the command (`kvcache` and `kvcache bench` take
    no option with a value), then a bench's name, then whatever else."""
    return [word for word in argv if not word.startswith("-")]


def _add_node_model_options(parser: argparse.ArgumentParser) -> None:
    """The node's --model and --kv-dtype: pages sized for the workers' model (_run_node)."""
    from base.pages import KV_DTYPES
    from kvcache.model_pages import MODELS

    parser.add_argument("--model", default=None,
                        help=f"size pages for the workers' model, so they fit: {MODELS}; overrides --page-bytes. "
                             "Unless --capacity is given, the pool is sized so one lookup can lease a prompt of "
                             "the model's full context")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                        help="with --model: the workers' KV dtype (default float32)")


def _say_models(parser: argparse.ArgumentParser) -> None:
    """The worker's --model help names every kind of model it loads (its default stays its own)."""
    from kvcache.model_pages import MODELS

    for action in parser._actions:
        if "--model" in action.option_strings:
            action.help = f"{MODELS} (default {action.default})"


def _run_node(args: argparse.Namespace) -> int:
    """With --model: pages of its size, and unless --capacity is given, a pool that lets one lookup
    lease a prompt of its full context (base/pool_sizes.py); the start line says it in its tokens."""
    from base.pages import DEFAULT_PAGE_TOKENS
    from base.pool_sizes import node_pool
    from kvcache.model_pages import model_max_positions, model_page_bytes
    from kvnode import daemon as node_daemon

    if args.model:
        try:
            args.page_bytes = model_page_bytes(args.model, args.kv_dtype)
            max_positions = model_max_positions(args.model)
        except ValueError as exc:
            print(f"kvcache node: error: {exc}", file=sys.stderr)
            return 2
        if args.capacity is None and 0.0 <= args.max_leased_fraction <= 1.0:  # else the daemon says what is wrong
            args.capacity = node_pool(args.page_bytes, max_positions, DEFAULT_PAGE_TOKENS,
                                      args.max_leased_fraction).size()
        args.model_context = (args.model, DEFAULT_PAGE_TOKENS, max_positions)
    return node_daemon.run(args)


def _run_gateway(args: argparse.Namespace) -> int:
    """Without --coordinators or $KVCACHE_COORDINATORS, the gateway serves the cluster `kvcache
    cluster up` started in this folder, as `generate` finds it (kvcache/client_target.py): its
    coordinators, its client certificate when it runs --secure, and its model's tokenizer for
    /tokenize. Named in one line on stderr; with no cluster file, the coordinators' default address."""
    from gateway import daemon as gateway_daemon
    from kvcache import client_target

    if args.coordinators is None and not os.environ.get(client_target.ENV_COORDINATORS, "").strip():
        try:
            found = client_target.cluster_here(client_target.tls_options(args))
        except ValueError as exc:
            print(f"kvcache gateway: error: {exc}", file=sys.stderr)
            return 2
        if found is not None:
            tls = ", TLS with its CA, HTTPS with its gateway certificate" if found.options.get("tls_cert") else ""
            print(f"using the cluster in {found.found_in} (coordinators {','.join(found.coordinators)}{tls})",
                  file=sys.stderr, flush=True)
            args.coordinators = ",".join(found.coordinators)
            for name in ("tls_ca", "tls_cert", "tls_key"):
                setattr(args, name, found.options.get(name) or getattr(args, name))
            if found.model and found.model not in args.tokenizer:
                args.tokenizer.append(found.model)
    return gateway_daemon.run(args)


# OpenBLAS's worker threads spin for ~0.1 s after each multi-threaded call before they sleep
# (its default thread timeout, 2^28 cycles). On 2 cores that spin took a core from the kvnode,
# the fetch and the other daemons after every prefill chunk: a 128-row gpt2-small-shape forward
# cost ~440 ms of process CPU against ~340 ms with 2^4 cycles, the same wall time either way.
# OpenBLAS reads it when it loads (with numpy), so it is set before anything imports numpy;
# a value in the environment wins.
QUIET_BLAS_ENV = {"OPENBLAS_THREAD_TIMEOUT": "4"}


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end has closed."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    for name, value in QUIET_BLAS_ENV.items():
        os.environ.setdefault(name, value)
    try:
        try:
            argv = sys.argv[1:] if argv is None else argv
            args = build_parser(_words(argv)).parse_args(argv)
        except SystemExit:  # after --help: argparse hides a failed write, the flush shows it
            sys.stdout.flush()
            raise
        code = args.run(args)
        sys.stdout.flush()  # here, where a reader gone is caught, not at exit
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a socket's, not ours to hide
        # The reader left (`| head`, a pager quit): nothing more to say to it, and no traceback.
        # Later writes, the interpreter's own flush at exit among them, go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell shows for a command its pipe's SIGPIPE ended
    finally:
        # gRPC objects in reference cycles are freed now, while grpc's threads run: left for the
        # interpreter's exit, freeing one could hang it for good (coordinator/client.py: Client.close).
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
