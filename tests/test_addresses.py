"""Addresses past loopback: what a member advertises (--advertise, refused without one on a
wildcard bind), the data plane's host following it in Info, and IPv6 literals in brackets
wherever an address is printed or parsed."""

from __future__ import annotations

import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, node_process, run_kvcache, wait_for
from base.addresses import advertised, host_port, split_host_port
from coordinator.client import Client
from coordinator_fakes import coordinator_process
from kvcache.launch import Daemon
from kvnode.client import NodeClient
from store_helpers import key

NODE_ARGS = ("--capacity", "64KiB", "--page-bytes", str(NODE_PAGE_BYTES))


@pytest.mark.parametrize("address, expected", [
    ("10.0.0.1:50051", ("10.0.0.1", 50051)),
    ("kv-1.example:7", ("kv-1.example", 7)),
    ("[::1]:50051", ("::1", 50051)),
    ("[fd00::1]:1", ("fd00::1", 1)),
])
def test_split_host_port_reads_names_v4_and_bracketed_v6(address, expected):
    assert split_host_port(address) == expected
    assert host_port(*expected) == address


@pytest.mark.parametrize("address", ["fd00::1:50051x", "[::1", "[::1]x", "host:", "host:0", "host:70000", ":50051",
                                     "host"])
def test_split_host_port_refuses_what_it_cannot_read(address):
    with pytest.raises(ValueError):
        split_host_port(address)


def test_advertised_defaults_to_the_bound_address_and_refuses_wildcards():
    assert advertised("127.0.0.1", 5, None) == "127.0.0.1:5"
    assert advertised("::1", 5, None) == "[::1]:5"
    assert advertised("0.0.0.0", 5, "kv-1.example") == "kv-1.example:5"  # the bound port
    assert advertised("::", 5, "fd00::7") == "[fd00::7]:5"  # a bare IPv6 literal is a host
    assert advertised("0.0.0.0", 5, "[fd00::7]:6") == "[fd00::7]:6"
    for host in ("0.0.0.0", "::", "[::]"):
        with pytest.raises(ValueError, match="give --advertise"):
            advertised(host, 5, None)
    with pytest.raises(ValueError, match="not a wildcard"):
        advertised("0.0.0.0", 5, "0.0.0.0:5")


@pytest.mark.parametrize("role, extra", [("node", NODE_ARGS), ("worker", ("--model", "tiny"))])
def test_a_wildcard_bind_without_advertise_is_refused_at_start(role, extra):
    result = run_kvcache([role, "--host", "0.0.0.0", "--port", "0", *extra])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvcache {role}: error: --host 0.0.0.0 listens on every interface")
    assert "--advertise" in lines[0] and "listening" not in result.stdout


def test_the_node_registers_its_advertised_address_and_its_info_names_that_host_for_the_data_plane(tmp_path):
    # Bound on every interface, advertised as 127.0.0.2 (loopback too, but not the 127.0.0.1 we
    # dial): the coordinator knows it by the advertised address, and the data plane follows that
    # host, not the one the client reached gRPC at.
    with coordinator_process(tmp_path / "coordinator.log") as coordinator, \
            node_process(tmp_path, *NODE_ARGS, "--host", "0.0.0.0", "--advertise", "127.0.0.2",
                         "--coordinators", coordinator.address) as node:
        port = int(node.address.rsplit(":", 1)[1])
        assert node.address == f"0.0.0.0:{port}"

        def registered() -> list[str]:
            with Client([coordinator.address]) as client:
                return [m.address for m in client.status().members if m.role == "node" and m.alive]

        assert wait_for(lambda: registered() == [f"127.0.0.2:{port}"], timeout_s=10.0)
        with NodeClient(f"127.0.0.1:{port}") as client:
            info = client.info()
            assert info.data_host == "127.0.0.2" and info.data_port > 0
            assert client.data_plane_address() == f"127.0.0.2:{info.data_port}"
            keys = [key(1), key(2)]
            pages = np.arange(2 * NODE_PAGE_BYTES, dtype=np.uint32).astype(np.uint8).reshape(2, -1)
            assert client.put_pages(keys, [b"", keys[0]], pages).stored == 2
            np.testing.assert_array_equal(client.get_pages(keys), pages)
            assert client.use_data_plane  # the data plane carried them, no fallback to gRPC


def test_ipv6_literals_print_and_parse_in_brackets(tmp_path):
    with coordinator_process(tmp_path / "coordinator.log", "--host", "::1") as coordinator, \
            node_process(tmp_path, *NODE_ARGS, "--host", "::1", "--coordinators", coordinator.address) as node:
        assert coordinator.address.startswith("[::1]:") and node.address.startswith("[::1]:")

        def registered() -> list[str]:
            with Client([coordinator.address]) as client:
                return [m.address for m in client.status().members if m.role == "node" and m.alive]

        assert wait_for(lambda: registered() == [node.address], timeout_s=10.0)
        with NodeClient(node.address) as client:
            info = client.info()
            assert info.data_host == "::1"
            assert client.data_plane_address() == f"[::1]:{info.data_port}"
            keys = [key(3)]
            pages = np.full((1, NODE_PAGE_BYTES), 7, dtype=np.uint8)
            assert client.put_pages(keys, [b""], pages).stored == 1
            np.testing.assert_array_equal(client.get_pages(keys), pages)
            assert client.use_data_plane


def test_kvcache_health_is_a_probe_that_speaks_the_health_service(tmp_path):
    with node_process(tmp_path, *NODE_ARGS) as node:
        serving_ = run_kvcache(["health", node.address])
        assert serving_.returncode == 0 and serving_.stdout.strip() == f"{node.address}: SERVING"
    gone = run_kvcache(["health", node.address, "--timeout", "0.5"])
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_kvcache_health_speaks_mutual_tls(tmp_path):
    assert run_kvcache(["certs", str(tmp_path / "tls")]).returncode == 0
    tls = tmp_path / "tls"
    member = ["--tls-cert", str(tls / "node.pem"), "--tls-key", str(tls / "node.key"), "--tls-ca", str(tls / "ca.pem")]
    with node_process(tmp_path, *NODE_ARGS, *member) as node:
        assert run_kvcache(["health", node.address, *member]).returncode == 0
        assert run_kvcache(["health", node.address, "--timeout", "0.5"]).returncode == 1  # plaintext gets no answer


@pytest.mark.parametrize("role, extra", [("coordinator", ()), ("gateway", ("--coordinators", "127.0.0.1:1"))])
def test_a_coordinator_and_the_gateway_say_where_they_are_reached(tmp_path, role, extra):
    # They register nowhere: a wildcard bind needs no --advertise, and one given is checked as a
    # member's and shown on the listening line, with the bound port when it names none.
    with Daemon(role, ["--host", "0.0.0.0", "--port", "0", "--advertise", "127.0.0.2", *extra],
                log_path=tmp_path / f"{role}.log") as daemon:
        port = int(daemon.address.rsplit(":", 1)[1])
        listening = [line for line in daemon.log_path.read_text().splitlines() if line.startswith(role)]
        reached = f"reached at 127.0.0.2:{port}," if role == "coordinator" else f"API at http://127.0.0.2:{port}/v1,"
        assert len(listening) == 1 and f"0.0.0.0:{port} (" in listening[0] and reached in listening[0]
    with Daemon(role, ["--host", "0.0.0.0", "--port", "0", *extra], log_path=tmp_path / f"{role}-plain.log"):
        pass  # a wildcard bind alone starts
    refused = run_kvcache([role, "--host", "0.0.0.0", "--port", "0", "--advertise", "[::]:7", *extra])
    assert refused.returncode == 2
    assert refused.stderr.strip() == f"kvcache {role}: error: --advertise [::]:7: advertise an address others " \
                                     "can dial, not a wildcard"
