"""base.serving: addresses and binding errors that read clearly (in-process, 127.0.0.1 only)."""

from __future__ import annotations

import gc
import socket

import pytest

from base import serving


@pytest.mark.parametrize(
    "host, expected",
    [("127.0.0.1", "127.0.0.1:50051"), ("localhost", "localhost:50051"), ("::1", "[::1]:50051"),
     ("[::1]", "[::1]:50051"), ("::", "[::]:50051")],
)
def test_host_port_brackets_ipv6_literals(host, expected):
    assert serving.host_port(host, 50051) == expected


def test_bind_picks_a_free_port_for_port_zero():
    server, health = serving.make_server([], [])
    try:
        assert serving.bind(server, "127.0.0.1", 0) > 0
    finally:
        serving.stop(server, health, 0.1)


def test_bind_to_a_taken_port_says_so_without_asking_grpc(capfd):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server, health = serving.make_server([], [])
        try:
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
                serving.bind(server, "127.0.0.1", port)
        finally:
            serving.stop(server, health, 0.1)
    assert "add_port" not in capfd.readouterr().err  # gRPC core never tried, so logged nothing


def test_bind_to_an_address_of_no_local_interface_is_refused():
    server, health = serving.make_server([], [])
    try:
        with pytest.raises(OSError, match="cannot listen on 192.0.2.1:0: Cannot assign requested address"):
            serving.bind(server, "192.0.2.1", 0)
    finally:
        serving.stop(server, health, 0.1)



def test_startup_objects_are_frozen_out_of_full_collections():
    """What a daemon calls once built: the objects made so far are no longer scanned by the
    collector (a full collection then costs a fraction of a millisecond, not ~10 ms)."""
    gc.unfreeze()   # whatever an earlier test left frozen: the count below is this call's alone
    try:
        assert gc.get_freeze_count() == 0
        serving.freeze_startup_objects()
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
