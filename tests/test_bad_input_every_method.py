"""Bad input to every method of a real worker and coordinator, as server reflection lists them
(the kvnode's are in test_node_bad_input_every_method.py): bytes that do not parse, a message over
the size limit, and messages built from each request's own fields with edge values each get a
clean status, never UNKNOWN or INTERNAL, and both daemons then serve a normal request with the
right tokens. A method added later without a case below fails test_every_method_has_a_case."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from cluster_helpers import collect, wait_for
from coordinator.client import Client
from kvcache.launch import Daemon
from protos import kvcache_pb2 as pb
from reflection_helpers import GARBAGE, UNCLEAN, call, field_cases, list_methods
from worker.engine.engine import Engine

INVALID, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # every daemon's default
PROMPT = "Bread, butter and a little salt. "


def generate(**fields) -> bytes:
    request = pb.GenerateRequest(prompt="hello", max_tokens=4)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    return request.SerializeToString()


# Per "Service/Method": (what the request says, its message as bytes, the status it must get).
CASES = {
    "Worker/Generate": [
        ("max_tokens 0", generate(max_tokens=0), INVALID),
        ("a token id past the vocabulary", generate(prompt_token_ids=[10**6]), INVALID),
        ("nine placement addresses", generate(placement=[f"127.0.0.1:{p}" for p in range(1, 10)]), INVALID),
        ("seventeen stop strings", generate(stop=[f"s{i}" for i in range(17)]), INVALID),
        ("a stop string of 257 characters", generate(stop=["s" * 257]), INVALID),
        ("a request id of 129 characters", generate(request_id="r" * 129), INVALID),
        ("resumed tokens past the vocabulary", generate(resume_token_ids=[10**6]), INVALID),
        ("a temperature that is not a number", generate(temperature=float("nan")), INVALID),
        ("logprobs 21 (at most 20)", generate(logprobs=21), INVALID),
        ("prompt logprobs without echo", generate(prompt_logprobs=1), INVALID),
        ("prompt logprobs 2**32 - 1", generate(echo=True, prompt_logprobs=2**32 - 1), INVALID),
        ("the prompt alone (max_tokens 0 with echo)", generate(max_tokens=0, echo=True, prompt_logprobs=2), OK),
    ],
    "Worker/Info": [("unknown fields only", b"\x08\x01\x12\x03abc", OK)],
    "Coordinator/Generate": [
        ("an empty prompt", generate(prompt=""), INVALID),
        ("max_tokens 0 (the worker's verdict)", generate(max_tokens=0), INVALID),
    ],
    "Coordinator/ClusterStatus": [("unknown fields only", b"\x08\x01\x12\x03abc", OK)],
    "Coordinator/Register": [
        ("an unknown role", pb.RegisterRequest(role="gpu", address="127.0.0.1:1").SerializeToString(), INVALID),
        ("a kvnode of no capacity", pb.RegisterRequest(role="node", address="127.0.0.1:1").SerializeToString(),
         INVALID),
    ],
    "Coordinator/Heartbeat": [("an unknown member", pb.HeartbeatRequest(member_id="x").SerializeToString(), OK)],
    "Coordinator/Deregister": [("an unknown member", pb.DeregisterRequest(member_id="x").SerializeToString(), OK)],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("daemons")
    with contextlib.ExitStack() as stack:
        coordinator = stack.enter_context(Daemon("coordinator", ["--port", "0"], log_path=logs / "coordinator.log"))
        worker = stack.enter_context(Daemon("worker", ["--port", "0", "--model", "tiny", "--kv-cache", "8MiB",
                                                       "--coordinators", coordinator.address],
                                            log_path=logs / "worker.log"))
        with Client([coordinator.address]) as client:
            assert wait_for(lambda: any(m.alive for m in client.status().members), timeout_s=15.0)
        yield {"Coordinator": coordinator.address, "Worker": worker.address}
    for name in ("coordinator.log", "worker.log"):
        assert "Traceback" not in (logs / name).read_text(errors="replace"), name


@pytest.fixture(scope="module")
def methods(cluster):
    """(address, service, method) for every method of the worker's and the coordinator's services."""
    return [(address, service, method) for address in cluster.values() for service, method in list_methods(address)]


@pytest.fixture(scope="module")
def expected():
    return Engine.load("tiny").generate(PROMPT, max_new_tokens=6)[0].token_ids


def assert_serving(cluster, expected) -> None:
    with Client([cluster["Coordinator"]], timeout=30) as client:
        assert collect(client.generate(PROMPT, max_tokens=6))[0] == expected
        assert any(m.alive and m.role == "worker" for m in client.status().members)


def name(service: str, method) -> str:
    return f"{service.rsplit('.', 1)[-1]}/{method.name}"


def test_every_method_has_a_case(methods):
    assert {name(service, method) for _, service, method in methods} == set(CASES), "give each new method its cases"


def test_bytes_that_do_not_parse_get_invalid_argument(cluster, methods, expected):
    for address, service, method in methods:
        for message in (GARBAGE, b"\xff"):
            assert call(address, service, method, [message]) == INVALID, name(service, method)
    assert_serving(cluster, expected)


def test_an_oversized_message_gets_resource_exhausted(cluster, methods, expected):
    too_big = b"\x0a" + pb.GenerateRequest(prompt="x" * MAX_MESSAGE_BYTES).SerializeToString()[1:]
    for address, service, method in methods:
        assert call(address, service, method, [too_big]) == grpc.StatusCode.RESOURCE_EXHAUSTED, name(service, method)
    assert_serving(cluster, expected)


def test_messages_built_from_each_request_field_get_a_clean_status(cluster, methods, expected):
    for address, service, method in methods:
        for case, message in field_cases(method.input_type, [b"k" * 16] * 1000):
            code = call(address, service, method, [message])
            assert code not in UNCLEAN, (name(service, method), case, code)
    assert_serving(cluster, expected)


def test_semantically_bad_values_get_their_status(cluster, methods, expected):
    for address, service, method in methods:
        for what, message, status in CASES[name(service, method)]:
            assert call(address, service, method, [message]) == status, (name(service, method), what)
    assert_serving(cluster, expected)
