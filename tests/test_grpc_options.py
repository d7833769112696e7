"""Every gRPC argument the daemons and clients set is one gRPC's core reads: it ignores a name it
does not know without a word. A misspelt one ("grpc.http2.min_recv_ping_interval_without_data_ms")
once left the servers at gRPC's default allowance of one ping in 5 minutes while no data flows, and
the callers, which ping every 10 s, lost any call silent for ~30 s (a long prefill) to GOAWAY
too_many_pings (base/serving.py)."""

from __future__ import annotations

from pathlib import Path

import grpc._cython.cygrpc as cygrpc

from base import security, serving


def core_names() -> bytes:
    """The bytes of gRPC's compiled core, where each argument it reads is a C string."""
    return Path(cygrpc.__file__).read_bytes()


def test_every_server_and_keepalive_argument_is_one_grpc_reads():
    core = core_names()
    names = [name for name, _ in [*serving.server_options(), *security.KEEPALIVE_OPTIONS]]
    assert "grpc.http2.min_ping_interval_without_data_ms" in names
    unknown = [name for name in names if name.encode() + b"\0" not in core]
    assert not unknown, f"gRPC reads no argument named {unknown}"


def test_the_servers_take_the_callers_keepalive_pings_while_no_data_flows():
    server = dict(serving.server_options())
    client = dict(security.KEEPALIVE_OPTIONS)
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
    assert client["grpc.http2.max_pings_without_data"] == 0
