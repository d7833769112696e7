"""A cluster started with TLS (certificates made by `kvcache certs` into the test's folder): every
gRPC and data port takes mutual TLS only; members and clients holding a certificate of the
cluster's CA work as in plaintext, and nobody else gets a call through."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import subprocess

import grpc
import numpy as np
import pytest
from cryptography import x509

from cluster_helpers import collect, kvcache_command, started, wait_for
from base import security
from coordinator.client import Client, TlsMismatch
from kvcache.certs import ROLES, make_certs
from kvcache.cluster import client_tls, start_cluster, wait_healthy
from kvnode.wire import data_frames as dw
from kvnode.client import NodeClient
from kvnode.client.data_client import DataPlaneClient
from kvnode.client.data_client_io import DataPlaneError
from protos import kvcache_pb2 as pb
from worker.engine.engine import Engine

PROMPT = "The bakery opens at seven and closes when the bread is gone. Do you sell rye bread?"


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory, certs):
    with start_cluster(tmp_path_factory.mktemp("cluster"), nodes=1, workers=1, coordinators=1, replicas=1,
                       node_capacity="16MiB", worker_kv_cache="16MiB", tls_dir=certs) as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=1, client_options=client_tls(certs))
        yield cluster


def member_credentials(certs, role="worker") -> security.Credentials:
    return security.Credentials(certs / "ca.pem", certs / f"{role}.pem", certs / f"{role}.key")


def data_plane(secure_cluster, certs, transport: str, context=None) -> DataPlaneClient:
    """A data plane client of the node over TCP or over its same-host unix socket (which runs the same TLS)."""
    node = secure_cluster.role("node")[0]
    with NodeClient(node.address, credentials=member_credentials(certs)) as client:
        info = client.info()
    assert info.data_unix, "a TLS node offers its unix socket, under the same TLS"
    plane = DataPlaneClient("127.0.0.1", info.data_port, context, info.data_unix if transport == "unix" else "")
    assert plane.transport == transport
    return plane


def plain_connection(secure_cluster, certs, transport: str) -> socket.socket:
    plane = data_plane(secure_cluster, certs, transport)
    if transport == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(b"\0" + plane.unix_name.encode())
        return sock
    return socket.create_connection(("127.0.0.1", plane.port), timeout=5)


def test_certs_name_loopback_and_the_hosts_given_and_keep_keys_private(tmp_path):
    make_certs(tmp_path, hosts=["kv-1.example", "10.0.0.7"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((tmp_path / f"{role}.pem").read_bytes())
        assert cert.issuer == ca.subject
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "kv-1.example"}
        assert set(names.get_values_for_type(x509.IPAddress)) == {
            ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.0.0.7")}
        assert stat.S_IMODE(os.stat(tmp_path / f"{role}.key").st_mode) == 0o600
    with pytest.raises(ValueError, match="exists"):
        make_certs(tmp_path)


def test_with_certificates_the_answer_equals_the_engine_alone(secure_cluster, certs):
    expected = Engine.load("tiny").generate(PROMPT, max_new_tokens=8)[0].token_ids
    with Client(secure_cluster.coordinator_addresses, tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "client.pem"),
                tls_key=str(certs / "client.key")) as client:  # a client's certificate, which it need not give
        tokens, done = collect(client.generate(PROMPT, max_tokens=8))
        again, second = collect(client.generate(PROMPT, max_tokens=8))
    assert tokens == again == expected and done.finish_reason == "length"
    assert second.usage.cached_tokens_local + second.usage.cached_tokens_remote > 0


def test_a_plaintext_connection_to_every_grpc_port_fails(secure_cluster):
    for daemon in secure_cluster.daemons:
        with grpc.insecure_channel(daemon.address) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, daemon.role


def refusal(address: str, method: str, request, credentials) -> grpc.RpcError:
    """The error a call of `method` gets over TLS with `credentials` (it must fail)."""
    with grpc.secure_channel(address, credentials) as channel:
        streaming = method.endswith("GetPages")
        stub = (channel.unary_stream if streaming else channel.unary_unary)(method, type(request).SerializeToString,
                                                                             None)
        with pytest.raises(grpc.RpcError) as failed:
            reply = stub(request, timeout=5)
            if streaming:
                list(reply)
    return failed.value


@pytest.mark.parametrize("who", ["no client certificate", "a certificate of another CA"])
def test_tls_without_a_cluster_certificate_cannot_register_beat_put_or_get(secure_cluster, certs, tmp_path, who):
    """A coordinator takes a caller without a certificate (a client) but refuses it the member
    calls; a kvnode takes none at all; a certificate of another CA gets through nowhere."""
    ca = (certs / "ca.pem").read_bytes()
    if who == "no client certificate":
        credentials = grpc.ssl_channel_credentials(ca)
    else:
        make_certs(tmp_path / "other")
        credentials = grpc.ssl_channel_credentials(ca, (tmp_path / "other" / "node.key").read_bytes(),
                                                   (tmp_path / "other" / "node.pem").read_bytes())
    coordinator = secure_cluster.role("coordinator")[0]
    node = secure_cluster.role("node")[0].address
    member_calls = [
        (coordinator.address, "/kvcache.v1.Coordinator/Register",
         pb.RegisterRequest(role="node", address="127.0.0.1:1", capacity_bytes=2**20, page_bytes=1024)),
        (coordinator.address, "/kvcache.v1.Coordinator/Heartbeat", pb.HeartbeatRequest(member_id="x")),
        (coordinator.address, "/kvcache.v1.Coordinator/Deregister", pb.DeregisterRequest(member_id="x")),
    ]
    for address, method, request in member_calls:
        refused = refusal(address, method, request, credentials)
        if who == "no client certificate":
            assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, method
            assert "the caller presented no certificate" in refused.details(), method
        else:
            assert refused.code() == grpc.StatusCode.UNAVAILABLE, method
    assert refusal(node, "/kvcache.v1.KVStore/GetPages", pb.GetPagesRequest(keys=[b"k" * 16]),
                   credentials).code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(node, credentials) as channel:
        put = channel.stream_unary("/kvcache.v1.KVStore/PutPages", None, None)
        with pytest.raises(grpc.RpcError) as failed:
            put(iter([b""]), timeout=5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    log = coordinator.log_path.read_text()
    if who == "no client certificate":
        assert "refused request: PERMISSION_DENIED: Register is for node and worker members" in log
    else:
        assert "TLS handshake(s) since the last such line" in log
    assert "Traceback" not in log


def test_a_client_with_the_ca_alone_generates_and_reads_status(secure_cluster, certs):
    """The CA checks the coordinators; no client certificate is needed (nor asked of the caller)."""
    expected = Engine.load("tiny").generate(PROMPT, max_new_tokens=4)[0].token_ids
    with Client(secure_cluster.coordinator_addresses, tls_ca=str(certs / "ca.pem")) as client:
        tokens, done = collect(client.generate(PROMPT, max_tokens=4))
        members = client.status().members
    assert tokens == expected and done.finish_reason == "length"
    assert sorted(m.role for m in members if m.alive) == ["node", "worker"]


def test_a_client_certificate_reaches_client_calls_only_not_a_members(secure_cluster, certs):
    """The CA signed it, but it is not a member's: it may not join the cluster nor read or write
    pages on a kvnode, over gRPC or the data plane."""
    client = member_credentials(certs, "client")
    credentials = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), (certs / "client.key").read_bytes(),
                                               (certs / "client.pem").read_bytes())
    coordinator = secure_cluster.role("coordinator")[0].address
    node = secure_cluster.role("node")[0].address
    calls = [
        (coordinator, "/kvcache.v1.Coordinator/Register",
         pb.RegisterRequest(role="node", address="127.0.0.1:1", capacity_bytes=2**20, page_bytes=1024)),
        (coordinator, "/kvcache.v1.Coordinator/Heartbeat", pb.HeartbeatRequest(member_id="x")),
        (coordinator, "/kvcache.v1.Coordinator/Deregister", pb.DeregisterRequest(member_id="x")),
        (node, "/kvcache.v1.KVStore/Lookup", pb.LookupRequest(keys=[b"k" * 16])),
        (node, "/kvcache.v1.KVStore/GetPages", pb.GetPagesRequest(keys=[b"k" * 16])),
        (node, "/kvcache.v1.KVStore/DropPages", pb.DropPagesRequest(keys=[b"k" * 16])),
    ]
    for address, method, request in calls:
        refused = refusal(address, method, request, credentials)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, method
        assert "worker members" in refused.details(), method
    with grpc.secure_channel(node, credentials) as channel:
        put = channel.stream_unary("/kvcache.v1.KVStore/PutPages", None, None)
        with pytest.raises(grpc.RpcError) as failed:
            put(iter([b""]), timeout=5)
        assert failed.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with NodeClient(node, credentials=client) as as_client:
        assert as_client.info().page_bytes > 0  # Info stays open to any certificate of the cluster
    for transport in ("tcp", "unix"):
        plane = data_plane(secure_cluster, certs, transport, client.client_context())
        with pytest.raises(DataPlaneError):
            plane.get_into([b"k" * 16], memoryview(bytearray(1024)), memoryview(bytearray(16)), timeout_s=5)
        assert plane.transport == transport
        plane.close()
    assert "the data plane is for worker members" in secure_cluster.role("node")[0].log_path.read_text()


def test_a_kvnode_serves_members_over_its_tls_data_plane(secure_cluster, certs):
    node = secure_cluster.role("node")[0]
    keys = [bytes([i]) * 16 for i in range(1, 3)]
    with NodeClient(node.address, credentials=member_credentials(certs)) as client:
        page_bytes = client.info().page_bytes
        data = np.random.default_rng(3).integers(0, 256, size=(2, page_bytes), dtype=np.uint8)
        assert client.put_pages(keys, [b"", keys[0]], data).outcomes[0] in ("stored", "already_present")
        assert client.get_pages(keys).tobytes() == data.tobytes()
        assert client.data_plane_address() is not None and client.use_data_plane, "no fallback to gRPC"
        assert client.data_plane_transport() == "unix"  # the same host: its unix socket, under TLS
    with NodeClient(node.address, credentials=member_credentials(certs), unix_socket=False) as client:
        assert client.get_pages(keys).tobytes() == data.tobytes()
        assert client.data_plane_transport() == "tcp" and client.use_data_plane
    assert "data plane (GET/PUT of pages over TLS)" in node.log_path.read_text()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_plaintext_connection_to_the_data_port_gets_no_page(secure_cluster, certs, transport):
    with plain_connection(secure_cluster, certs, transport) as sock:
        sock.sendall(dw.get_request([b"k" * 16]))
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    assert not received.startswith(dw.ok_reply(0)[:4]), "a plaintext peer must not get a reply frame"
    plain = data_plane(secure_cluster, certs, transport)
    with pytest.raises(DataPlaneError):
        plain.get_into([b"k" * 16], memoryview(bytearray(1024)), memoryview(bytearray(16)), timeout_s=5)
    plain.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_tls_without_a_client_certificate_cannot_fetch_from_the_data_port(secure_cluster, certs, transport):
    checks_server_only = security.Credentials(certs / "ca.pem")
    client = data_plane(secure_cluster, certs, transport, checks_server_only.client_context())
    with pytest.raises(DataPlaneError):
        client.get_into([b"k" * 16], memoryview(bytearray(1024)), memoryview(bytearray(16)), timeout_s=5)
    assert client.transport == transport  # refused by the node's TLS, not by a missing socket
    client.close()


def test_sighup_re_reads_the_certificate_files_for_new_connections(tmp_path):
    """Rotation without a restart: files replaced by another CA's, SIGHUP, and new connections
    need the new CA's certificates on both ports (gRPC and the data plane)."""
    import shutil
    import signal

    from cluster_helpers import wait_for
    from kvcache.cluster import tls_args
    from kvcache.launch import Daemon
    from kvnode.client import NodeError

    old, new, live = tmp_path / "old", tmp_path / "new", tmp_path / "live"
    make_certs(old)
    make_certs(new)
    shutil.copytree(old, live)
    with Daemon("node", ["--port", "0", "--page-bytes", "1024", "--capacity", "64KiB", *tls_args(live, "node")],
                log_path=tmp_path / "node.log") as node:
        with NodeClient(node.address, credentials=member_credentials(old)) as client:
            assert client.info().page_bytes == 1024
        for name in ("ca.pem", "node.pem", "node.key"):
            shutil.copy(new / name, live / name)
        os.kill(node.pid, signal.SIGHUP)
        assert wait_for(lambda: "TLS files re-read" in (tmp_path / "node.log").read_text(), timeout_s=10)
        keys = [b"r" * 16]
        with NodeClient(node.address, credentials=member_credentials(new)) as client:
            client.put_pages(keys, [b""], np.zeros((1, 1024), dtype=np.uint8))
            assert client.get_pages(keys).shape == (1, 1024) and client.use_data_plane
        with NodeClient(node.address, credentials=member_credentials(old), timeout=3) as client:
            with pytest.raises(NodeError) as refused:
                client.info()
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_worker_certificate_of_another_ca_cannot_fetch_from_the_data_port(secure_cluster, certs, tmp_path,
                                                                           transport):
    """The data plane's TLS runs over memory BIOs (kvnode/wire/tls_stream.py): its handshake still
    checks the peer's certificate against the cluster's CA, on both ends."""
    make_certs(tmp_path / "other")
    foreign = security.Credentials(tmp_path / "other" / "ca.pem", tmp_path / "other" / "worker.pem",
                                   tmp_path / "other" / "worker.key")
    client = data_plane(secure_cluster, certs, transport, foreign.client_context())
    with pytest.raises(DataPlaneError, match="certificate verify failed|TLS"):
        client.get_into([b"k" * 16], memoryview(bytearray(1024)), memoryview(bytearray(16)), timeout_s=5)
    client.close()
    ours_to_them = security.Credentials(certs / "ca.pem", tmp_path / "other" / "worker.pem",
                                        tmp_path / "other" / "worker.key")  # trusts the node, is not trusted by it
    client = data_plane(secure_cluster, certs, transport, ours_to_them.client_context())
    with pytest.raises(DataPlaneError):
        client.get_into([b"k" * 16], memoryview(bytearray(1024)), memoryview(bytearray(16)), timeout_s=5)
    client.close()


def client_command(*args: str) -> subprocess.CompletedProcess:
    """`kvcache ARGS` to completion, without the environment's coordinators or token."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVCACHE_COORDINATORS", "KVCACHE_TOKEN", "GRPC_VERBOSITY")}
    return subprocess.run(kvcache_command(*args), capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def test_a_plaintext_client_of_a_tls_cluster_is_told_in_one_line_to_pass_the_ca(secure_cluster):
    coordinator = secure_cluster.coordinator_addresses[0]
    for command in (["status"], ["generate", "--max-tokens", "2", "Hello"]):
        done = client_command(*command, "--coordinators", coordinator)
        assert done.returncode == 1
        assert done.stderr.splitlines() == [
            f"kvcache {command[0]}: error: the cluster at {coordinator} speaks TLS and this client does not: pass "
            f"--tls-ca FILE, the cluster's CA (`kvcache cluster up --secure` wrote RUN_DIR/tls/ca.pem; in Python "
            f"Client(tls_ca=FILE)), and its token"], done.stderr
    with Client([coordinator]) as plaintext, pytest.raises(TlsMismatch, match="speaks TLS and this client does not"):
        plaintext.status(timeout=5)


def test_a_tls_client_of_a_plaintext_cluster_is_told_in_one_line_to_leave_tls_out(certs, tmp_path):
    with started(tmp_path, "coordinator", "plaintext") as coordinator:
        done = client_command("generate", "--coordinators", coordinator.address, "--tls-ca", str(certs / "ca.pem"),
                              "--max-tokens", "2", "Hello")
        with Client([coordinator.address], tls_ca=str(certs / "ca.pem")) as tls:
            with pytest.raises(TlsMismatch) as mismatch:
                collect(tls.generate("Hello", max_tokens=2))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"kvcache generate: error: the cluster at {coordinator.address} speaks plaintext, not TLS, and this client "
        f"connected with TLS: leave out --tls-ca, --tls-cert and --tls-key, or start the cluster with TLS"], done.stderr
    assert mismatch.value.code == grpc.StatusCode.UNAVAILABLE and "speaks plaintext, not TLS" in str(mismatch.value)


def test_a_client_with_another_ca_is_told_the_certificate_is_not_accepted(secure_cluster, tmp_path):
    make_certs(tmp_path / "other")
    coordinator = secure_cluster.coordinator_addresses[0]
    done = client_command("status", "--coordinators", coordinator, "--tls-ca", str(tmp_path / "other" / "ca.pem"))
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert (f"the cluster at {coordinator} presents a certificate that --tls-ca {tmp_path / 'other' / 'ca.pem'} does "
            f"not accept") in done.stderr


def test_a_plaintext_member_of_a_tls_cluster_says_the_mismatch_in_its_log(secure_cluster, tmp_path):
    coordinator = secure_cluster.coordinator_addresses[0]
    with started(tmp_path, "node", "plaintext-node", "--coordinators", coordinator, "--capacity", "1MiB",
                 "--page-bytes", "1024") as node:
        expected = (f"coordinator {coordinator} unreachable (the coordinator at {coordinator} speaks TLS and this "
                    f"daemon does not: start this daemon with --tls-cert, --tls-key and --tls-ca")
        assert wait_for(lambda: expected in node.log_path.read_text(), timeout_s=15), node.log_path.read_text()
    assert "Traceback" not in node.log_path.read_text()


def test_a_client_certificate_of_another_ca_is_said_to_be_refused(secure_cluster, certs, tmp_path):
    make_certs(tmp_path / "other")
    coordinator = secure_cluster.coordinator_addresses[0]
    with Client([coordinator], tls_ca=str(certs / "ca.pem"), tls_cert=str(tmp_path / "other" / "client.pem"),
                tls_key=str(tmp_path / "other" / "client.key")) as client:
        with pytest.raises(TlsMismatch) as mismatch:
            client.status(timeout=5)
    assert str(mismatch.value) == (f"the cluster at {coordinator} does not accept this client's certificate, "
                                   f"--tls-cert {tmp_path / 'other' / 'client.pem'}: give one signed by the "
                                   f"cluster's CA")


def test_a_client_without_a_certificate_is_told_a_worker_wants_one(secure_cluster, certs):
    worker = secure_cluster.role("worker")[0].address
    done = client_command("generate", "--worker", worker, "--tls-ca", str(certs / "ca.pem"), "--max-tokens", "2",
                          "Hello")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"kvcache generate: error: the worker at {worker} takes only callers with a certificate of the cluster's CA: "
        f"pass --tls-cert and --tls-key too (or go through a coordinator, which needs none)"], done.stderr
