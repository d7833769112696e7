"""`kvcache status`: the cluster as a coordinator sees it (members, liveness, pages, load, epoch).
Without --coordinators it finds the cluster as client_target.py says.

Columns: `holds` is a kvnode's pages of its capacity, and a worker's KV blocks that running
requests hold of its pool (blocks cached for reuse count as free: a worker idle after cache hits
shows 0); `activity` is a kvnode's lookups that found their pages since it started, and a
worker's requests running and waiting, and those this coordinator sent it that have not ended.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from base.units import format_size
from coordinator.client import Client, ClusterError, TlsMismatch
from kvcache import client_target
from kvcache.bench.report import print_table

LEGEND = ("holds: a kvnode's pages of its capacity; a worker's KV blocks running requests hold (cached ones are free)\n"
          "activity: a kvnode's pages found by lookups; a worker's requests running, waiting, and in flight from here")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    client_target.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        target = client_target.resolve(args)
    except ValueError as exc:
        print(f"kvcache status: error: {exc}", file=sys.stderr)
        return 2
    if target.found_in is not None:
        print(target.describe(), file=sys.stderr, flush=True)
    try:
        with Client(target.coordinators, **target.options) as client:
            status = client.status()
    except (ClusterError, ValueError) as exc:
        hint = (target.hint() if getattr(exc, "code", None) == grpc.StatusCode.UNAVAILABLE
                and not isinstance(exc, TlsMismatch) else "")
        print(f"kvcache status: error: {exc}{hint}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
        return 0
    print(f"coordinator {status.coordinator_id}  epoch {status.epoch}  replicas {status.replicas}")
    rows = []
    for m in status.members:
        load = m.load
        if m.role == "node":
            holds = f"{load.used_pages}/{load.capacity_pages} pages"
            looked = load.hit_pages + load.miss_pages
            activity = f"pages found {load.hit_pages}/{looked}" + (f" ({load.hit_pages / looked:.0%})" if looked else "")
            size = format_size(m.capacity_bytes)
        else:
            holds = f"{load.total_blocks - load.free_blocks}/{load.total_blocks} blocks in use"
            activity = f"running {load.running}, waiting {load.waiting}, in flight {m.outstanding}"
            size = m.model
        state = "alive" if m.alive else f"DEAD ({m.seconds_since_beat:.0f}s silent)"
        rows.append([m.role, m.address, state, size, holds, activity])
    print_table(["role", "address", "state", "size/model", "holds", "activity"], rows)
    print(LEGEND)
    return 0
