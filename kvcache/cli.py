"""The `kvcache` command line: one entry point, a subcommand per daemon or tool."""

from __future__ import annotations

import argparse
import sys

from kvcache import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcache",
        description="A distributed KV-cache service for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    from kvnode import daemon as node_daemon

    node = commands.add_parser("node", help="start a KV-store node", description=node_daemon.__doc__)
    node_daemon.add_arguments(node)
    node.set_defaults(run=node_daemon.run)

    from kvcache.bench import cli as bench_cli

    bench = commands.add_parser("bench", help="measure a part of the service", description=bench_cli.__doc__)
    bench_cli.add_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
