"""Measure a part of the service. Each bench runs its baseline in the same invocation and prints ratios."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True

    from kvcache.bench import node

    node_parser = benches.add_parser("node", help="kvnode put/get throughput against a raw TCP socket", description=node.__doc__)
    node.add_arguments(node_parser)
    node_parser.set_defaults(run=node.run)

    from kvcache.bench import engine

    engine_parser = benches.add_parser("engine", help="paged engine prefill/decode/TTFT against a dense runner",
                                       description=engine.__doc__)
    engine.add_arguments(engine_parser)
    engine_parser.set_defaults(run=engine.run)

    from kvcache.bench import remote

    remote_parser = benches.add_parser("remote", help="TTFT cold vs warm from a kvnode vs warm local",
                                       description=remote.__doc__)
    remote.add_arguments(remote_parser)
    remote_parser.set_defaults(run=remote.run)

    from kvcache.bench import eviction

    eviction_parser = benches.add_parser("eviction", help="hit rate and orphans of prefix-aware vs LRU vs FIFO eviction",
                                         description=eviction.__doc__)
    eviction.add_arguments(eviction_parser)
    eviction_parser.set_defaults(run=eviction.run)

    from kvcache.bench import load

    load_parser = benches.add_parser("load", help="the cluster under concurrent load, with the cache and without",
                                     description=load.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    load.add_arguments(load_parser)
    load_parser.set_defaults(run=load.run)

    from kvcache.bench import transfer

    transfer_parser = benches.add_parser("transfer", help="page get/put through a kvnode, Redis and a raw TCP socket",
                                         description=transfer.__doc__)
    transfer.add_arguments(transfer_parser)
    transfer_parser.set_defaults(run=transfer.run)
