"""`kvcache status`: the cluster as a coordinator sees it (members, liveness, pages, load, epoch)."""

from __future__ import annotations

import argparse
import json
import sys

from google.protobuf.json_format import MessageToDict

from coordinator.client import Client, ClusterError
from kvcache.bench.report import print_table
from kvcache.generate import add_token_argument, coordinator_addresses, tls_options
from protos import security, tokens
from protos.units import format_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinators", default=None, help="coordinator addresses: A,B (default as for generate)")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    add_token_argument(parser)
    security.add_arguments(parser, client=True)


def run(args: argparse.Namespace) -> int:
    try:
        token = tokens.client_token(args.token_file)
        with Client(coordinator_addresses(args.coordinators), token=token, **tls_options(args)) as client:
            status = client.status()
    except (ClusterError, ValueError) as exc:
        print(f"kvcache status: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
        return 0
    print(f"coordinator {status.coordinator_id}  epoch {status.epoch}  replicas {status.replicas}")
    rows = []
    for m in status.members:
        load = m.load
        if m.role == "node":
            used = f"{load.used_pages}/{load.capacity_pages} pages"
            looked = load.hit_pages + load.miss_pages
            activity = f"hits {load.hit_pages}/{looked}" + (f" ({load.hit_pages / looked:.0%})" if looked else "")
            size = format_size(m.capacity_bytes)
        else:
            used = f"{load.total_blocks - load.free_blocks}/{load.total_blocks} blocks"
            activity = f"running {load.running}, waiting {load.waiting}, routed {m.outstanding}"
            size = m.model
        state = "alive" if m.alive else f"DEAD ({m.seconds_since_beat:.0f}s silent)"
        rows.append([m.role, m.address, state, size, used, activity])
    print_table(["role", "address", "state", "size/model", "used", "activity"], rows)
    return 0
