"""Tokens and tenants on a secure cluster (mutual TLS, a tokens file): every client-facing method
wants a known token, and tenants never share a cached page unless both opted into `shared`."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster_helpers import collect, wait_for
from base import security
from base.tokens import TokenCheck, Tokens, authorization, client_token
from coordinator.client import Client, ClusterError
from coordinator.daemon import MEMBER_METHODS
from coordinator.ring import placement_key
from kvcache.cluster import client_tls, start_cluster, wait_healthy
from kvnode.client import NodeClient
from worker.client import WorkerClient
from worker.engine.engine import Engine
from worker.kv.pages import tenant_root

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789", "carol": "carol-token-0123456789",
          "docs": "docs-token-0123456789", "demo": "demo-token-0123456789"}
SHARED = {"docs", "demo"}
SYSTEM = "You are the support assistant of a small bakery. Be kind, be brief, never invent prices. "


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, certs):
    folder = tmp_path_factory.mktemp("cluster")
    tokens_file = folder / "tokens"
    tokens_file.write_text("# tenant token [shared]\n" + "".join(
        f"{name} {token}{' shared' if name in SHARED else ''}\n" for name, token in TOKENS.items()))
    with start_cluster(folder / "logs", nodes=1, workers=2, coordinators=1, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB", tls_dir=certs, tokens_file=tokens_file) as started:
        wait_healthy(started.coordinator_addresses, nodes=1, workers=2,
                     client_options={**client_tls(certs), "token": TOKENS["alice"]})
        yield started


def client(cluster, certs, tenant: str | None) -> Client:
    return Client(cluster.coordinator_addresses, token=TOKENS.get(tenant, tenant), **client_tls(certs))


def worker_client(cluster, certs, address: str, tenant: str) -> WorkerClient:
    credentials = security.Credentials(certs / "ca.pem", certs / "client.pem", certs / "client.key")
    return WorkerClient(address, credentials=credentials, token=TOKENS[tenant])


def cached(usage) -> int:
    return usage.cached_tokens_local + usage.cached_tokens_remote


def secure_channel(address: str, certs, token: str | None) -> grpc.Channel:
    credentials = security.Credentials(certs / "ca.pem", certs / "client.pem", certs / "client.key")
    channel = security.channel(address, credentials)
    if token is None:
        return channel
    return grpc.intercept_channel(channel, _Metadata(authorization(token)))


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata):
        self.metadata = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_Details(details, self.metadata), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_Details(details, self.metadata), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.metadata = list(details.metadata or ()) + list(metadata)
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def methods_by_reflection(address: str, certs) -> list[tuple[str, object]]:
    with secure_channel(address, certs, TOKENS["alice"]) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(database)
        return [(name, method) for name in database.get_services() if name.startswith("kvcache.")
                for method in pool.FindServiceByName(name).methods]


def call_status(channel: grpc.Channel, service: str, method) -> grpc.StatusCode:
    path = f"/{service}/{method.name}"
    shape = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    stub = shape[(method.client_streaming, method.server_streaming)](path, None, None)
    try:
        reply = stub(iter([b""]) if method.client_streaming else b"", timeout=10)
        if method.server_streaming:
            list(reply)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_a_tokens_file_maps_tokens_to_tenants_and_refuses_bad_lines(tmp_path):
    good = tmp_path / "good"
    good.write_text("a aaaaaaaaaaaaaaaa\n\n# c\nb bbbbbbbbbbbbbbbb shared\n")
    tokens = Tokens.load(good)
    assert tokens.tenant("aaaaaaaaaaaaaaaa").namespace == "a"
    assert tokens.tenant("bbbbbbbbbbbbbbbb").namespace == ""  # shared
    assert tokens.tenant("aaaaaaaaaaaaaaab") is None and tokens.tenant(None) is None
    for text, message in [("a secret-token-123456 extra\n", "line 1"), ("a short\n", "16 characters"), ("", "no token")]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message) as refused:
            Tokens.load(bad)
        assert "secret-token" not in str(refused.value), "a refusal never echoes a token"


def test_a_client_token_file_holds_the_token_alone_or_is_a_tokens_file(tmp_path, monkeypatch):
    """A daemons' tokens file works as a client's --token-file: its `default` tenant (the clients' of
    `cluster up --secure`), its only one, or the one --tenant names; anything else is refused
    naming the file and the line, never a token."""
    monkeypatch.delenv("KVCACHE_TOKEN", raising=False)
    path = tmp_path / "token"

    def token(text: str, tenant: str | None = None) -> str | None:
        path.write_text(text)
        return client_token(str(path), tenant)

    assert token("# mine\nalone-token\n") == "alone-token"
    assert token("default dddddddddddddddd\nmonitor mmmmmmmmmmmmmmmm\n") == "dddddddddddddddd"
    assert token("monitor mmmmmmmmmmmmmmmm\ndefault dddddddddddddddd\n", "monitor") == "mmmmmmmmmmmmmmmm"
    assert token("alice aaaaaaaaaaaaaaaa shared\n") == "aaaaaaaaaaaaaaaa"
    secret = "secret-token-0123456789"
    for text, tenant, message in [
        ("", None, "is empty"),
        ("# only a comment\n", None, "is empty"),
        (f"{secret}\nanother-one\n", None, "line 1: expected the token alone, or `TENANT TOKEN \\[shared\\]` lines"),
        (f"alice {secret} extra\n", None, "line 1: expected .* got 3 words \\(a third word can only be `shared`\\)"),
        ("alice short\n", None, "line 1: a token needs at least 16 characters"),
        (f"alice {secret}\nbob {secret}\n", None, "names the tenants alice, bob: give --tenant NAME"),
        (f"alice {secret}\nbob {secret}\n", "carol", "names no tenant 'carol'; it names alice, bob"),
        (f"{secret}\n", "alice", "holds a token alone"),
    ]:
        with pytest.raises(ValueError, match=message) as refused:
            token(text, tenant)
        assert str(path) in str(refused.value) and secret not in str(refused.value)
    with pytest.raises(ValueError, match="--token-file .*nonexistent"):
        client_token(str(tmp_path / "nonexistent"))
    with pytest.raises(ValueError, match="--tenant picks a tenant of a tokens file"):
        client_token(None, "alice")
    monkeypatch.setenv("KVCACHE_TOKEN", "from-the-environment")
    assert client_token(None) == "from-the-environment"


def test_calls_without_a_known_token_are_logged_as_one_line_an_interval(caplog):
    """Anyone who reaches the port can send such calls: a flood of them is one line, not one each."""
    check = TokenCheck(Tokens([("a", "aaaaaaaaaaaaaaaa", False)]))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

    class Call:
        method = "/kvcache.v1.Coordinator/Generate"
        invocation_metadata = authorization("not-a-known-token-at-all")

    with caplog.at_level("INFO", logger="security"):
        for _ in range(50):
            assert check.intercept_service(lambda details: handler, Call) is not handler
    refusals = [r.getMessage() for r in caplog.records if "without a known token" in r.getMessage()]
    assert refusals == ["refused 1 call(s) without a known token since the last such line, the last to "
                        "/kvcache.v1.Coordinator/Generate"]
    assert all("not-a-known-token" not in r.getMessage() for r in caplog.records)


def test_tenants_have_unrelated_key_roots_and_placement_keys():
    fingerprint = bytes(16)
    assert tenant_root(fingerprint, "") == fingerprint
    roots = {tenant_root(fingerprint, t) for t in ("", "alice", "bob")}
    assert len(roots) == 3
    keys = {placement_key("same prompt", "", 64, t) for t in ("", "alice", "bob")}
    assert len(keys) == 3
    assert placement_key("p", "s1", 64, "alice") != placement_key("p", "s1", 64, "bob")


def test_every_client_facing_method_wants_a_known_token(cluster, certs):
    """Listed by reflection (which itself wants a token); health stays open."""
    daemons = cluster.role("coordinator") + cluster.role("worker")[:1]
    for daemon in daemons:
        methods = [(s, m) for s, m in methods_by_reflection(daemon.address, certs)
                   if f"/{s}/{m.name}" not in MEMBER_METHODS]
        assert len(methods) >= 2, daemon.role
        for token in (None, "wrong-token-0123456789"):
            with secure_channel(daemon.address, certs, token) as channel:
                for service, method in methods:
                    assert call_status(channel, service, method) == grpc.StatusCode.UNAUTHENTICATED, \
                        (daemon.role, method.name, token)
                with pytest.raises(grpc.RpcError) as refused:
                    ProtoReflectionDescriptorDatabase(channel).get_services()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
    with client(cluster, certs, None) as anonymous, pytest.raises(ClusterError) as refused:
        collect(anonymous.generate("Hello", max_tokens=2))
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    for daemon in cluster.daemons:
        log = daemon.log_path.read_text()
        assert not any(token in log for token in TOKENS.values()), f"{daemon.role} logged a token"


def test_with_a_valid_token_the_answer_equals_the_engine_alone(cluster, certs):
    prompt = SYSTEM + "Do you sell rye bread?"
    expected = Engine.load("tiny").generate(prompt, max_new_tokens=8)[0].token_ids
    with client(cluster, certs, "alice") as alice:
        tokens, done = collect(alice.generate(prompt, max_tokens=8))
    assert tokens == expected and done.finish_reason in ("length", "stop")


def test_one_tenants_cached_prompt_is_a_miss_for_another_local_and_remote(cluster, certs):
    prompt = "Isolation. " + SYSTEM + "When do you open on Saturdays?"  # an opening no other test sends
    with client(cluster, certs, "alice") as alice, client(cluster, certs, "bob") as bob:
        _, first = collect(alice.generate(prompt, max_tokens=2))
        _, second = collect(alice.generate(prompt, max_tokens=2))
        _, other = collect(bob.generate(prompt, max_tokens=2))
    assert cached(first.usage) == 0 and cached(second.usage) > 0
    assert other.usage.cached_tokens_local == 0 and other.usage.cached_tokens_remote == 0
    # Each worker alone, named the kvnode: alice's prompt computed on the first worker is a local
    # miss there for bob, and a remote miss on the second for carol, and a remote hit for alice.
    [node] = cluster.role("node")
    first_worker, second_worker = (w.address for w in cluster.role("worker"))
    prompt = "Direct. " + SYSTEM + "Do you bake gluten-free bread?"

    def ask(worker: str, tenant: str):
        with worker_client(cluster, certs, worker, tenant) as as_tenant:
            return collect(as_tenant.generate(prompt, max_tokens=1, placement=[node.address]))[1].usage

    with NodeClient(node.address, credentials=security.Credentials(
            certs / "ca.pem", certs / "worker.pem", certs / "worker.key")) as kvnode:
        before = kvnode.info().used_pages
        computed = ask(first_worker, "alice")
        assert cached(computed) == 0
        pages = (computed.prompt_tokens - 1) // 16
        assert wait_for(lambda: kvnode.info().used_pages >= before + pages, timeout_s=10)
    assert ask(second_worker, "alice").cached_tokens_remote == pages * 16
    bob = ask(first_worker, "bob")
    assert bob.cached_tokens_local == 0 and bob.cached_tokens_remote == 0
    carol = ask(second_worker, "carol")
    assert carol.cached_tokens_local == 0 and carol.cached_tokens_remote == 0


def test_shared_tenants_share_a_system_prompt_and_others_do_not(cluster, certs):
    prompt = "Sharing. " + SYSTEM + "Is the shop open on holidays?"
    with client(cluster, certs, "docs") as docs, client(cluster, certs, "demo") as demo, \
            client(cluster, certs, "bob") as bob:
        _, first = collect(docs.generate(prompt, max_tokens=2))
        _, shared = collect(demo.generate(prompt, max_tokens=2))
        _, private = collect(bob.generate(prompt, max_tokens=2))
    assert cached(first.usage) == 0 and cached(shared.usage) > 0 and cached(private.usage) == 0


def test_generate_and_status_take_a_token_file_or_kvcache_token(cluster, certs, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS["alice"] + "\n")
    base = [sys.executable, "-m", "kvcache.cli"]
    where = ["--coordinators", ",".join(cluster.coordinator_addresses), "--tls-ca", str(certs / "ca.pem"),
             "--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key")]
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_TOKEN"}

    def run(*args, **extra_env):
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=120, env={**env, **extra_env})

    ok = run("generate", *where, "--token-file", str(token_file), "--max-tokens", "2", "--json", "Hello")
    assert ok.returncode == 0, ok.stderr
    assert run("status", *where, KVCACHE_TOKEN=TOKENS["bob"]).returncode == 0
    refused = run("generate", *where, "--max-tokens", "2", "Hello")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert TOKENS["alice"] not in ok.stderr + ok.stdout
