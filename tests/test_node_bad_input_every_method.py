"""Bad input to every method of a real `kvcache node`, as server reflection lists them (docs/architecture.md,
"Invariants the tests hold"): bytes that do not parse, a message over the size limit, and values built from each
request's own fields (keys of the wrong length, lists past the bound, the largest numbers) each get
a clean status, never UNKNOWN or INTERNAL, and the node then serves a normal round trip. A method
added later without a semantic case below fails test_every_method_has_a_semantic_case. The
in-process cases with exact messages are in test_node_bad_input.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, node_process, read_log
from kvnode.wire import grpc_frames as wire
from kvnode.client import NodeClient
from reflection_helpers import GARBAGE, UNCLEAN, call, field_cases, list_methods
from store_helpers import key

MAX_KEYS = 8
MAX_MESSAGE_BYTES = 64 * 1024
INVALID, RESOURCE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED

# Per method: (what the request says, its messages as bytes, the status it must get).
SEMANTIC = {
    "Info": [("unknown fields only", [b"\x08\x01\x12\x03abc"], grpc.StatusCode.OK)],
    "Stats": [("unknown fields only", [b"\x08\x01\x12\x03abc"], grpc.StatusCode.OK)],
    "Lookup": [
        ("a key of 15 bytes", [b"\x0a\x0f" + b"k" * 15], INVALID),
        ("more keys than the bound", [b"".join(b"\x0a\x10" + key(i) for i in range(MAX_KEYS + 1))], INVALID),
        ("the largest lease (a negative number as uint32)", [b"\x0a\x10" + key(0) + b"\x10" + b"\xff" * 9 + b"\x01"],
         INVALID),
    ],
    "GetPages": [
        ("a key of 17 bytes", [b"\x0a\x11" + b"k" * 17], INVALID),
        ("more keys than the bound", [b"".join(b"\x0a\x10" + key(i) for i in range(MAX_KEYS + 1))], INVALID),
        ("no keys", [b""], INVALID),
        ("a page not cached", [b"\x0a\x10" + key(999)], grpc.StatusCode.NOT_FOUND),
    ],
    "PutPages": [
        ("a key of 15 bytes", [wire.put_item(b"k" * 15, b"", bytes(NODE_PAGE_BYTES), last=True)], INVALID),
        ("more pages than the bound",
         [wire.put_item(key(500 + i), b"", bytes(NODE_PAGE_BYTES), last=i == MAX_KEYS) for i in range(MAX_KEYS + 1)],
         INVALID),
        ("a page too long", [wire.put_item(key(500), b"", bytes(NODE_PAGE_BYTES + 1), last=True)], INVALID),
        ("an item without data", [wire.put_item(key(500), b"", b"", last=True)], INVALID),
        ("no items", [], INVALID),
        ("a checksum of 8 bytes", [wire.put_item(key(500), b"", bytes(NODE_PAGE_BYTES), True, b"c" * 8)], INVALID),
    ],
    "DropPages": [
        ("a key of 15 bytes", [b"\x0a\x0f" + b"k" * 15], INVALID),
        ("more keys than the bound", [b"".join(b"\x0a\x10" + key(i) for i in range(MAX_KEYS + 1))], INVALID),
        ("a page not cached", [b"\x0a\x10" + key(999)], grpc.StatusCode.OK),
    ],
}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("node")
    with node_process(log_dir, "--capacity", "64KiB", "--page-bytes", str(NODE_PAGE_BYTES), "--max-keys",
                      str(MAX_KEYS), "--max-message-bytes", str(MAX_MESSAGE_BYTES)) as daemon:
        daemon.log_dir = log_dir
        yield daemon
    assert "Traceback" not in read_log(log_dir)


@pytest.fixture(scope="module")
def methods(node):
    return list_methods(node.address)


def assert_serving(address: str) -> None:
    data = np.arange(NODE_PAGE_BYTES, dtype=np.uint8)[None, :] % 251
    probe = key(10_000)
    with NodeClient(address) as client:
        assert client.put_pages([probe], [b""], data).stored in (0, 1)
        assert client.lookup([probe]) == 1
        assert client.get_pages([probe]).tobytes() == data.tobytes()


def test_reflection_lists_the_node_methods(methods):
    assert {m.name for _, m in methods} >= {"Info", "Lookup", "GetPages", "PutPages", "Stats"}


def test_every_method_has_a_semantic_case(methods):
    assert {m.name for _, m in methods} == set(SEMANTIC), "give each new method its semantic cases here"


def test_bytes_that_do_not_parse_get_invalid_argument(node, methods):
    for service, method in methods:
        for messages in ([GARBAGE], [b"\xff"]) + (([wire.put_item(key(1), b"", b"x")[:-1], GARBAGE],)
                                                   if method.client_streaming else ()):
            code = call(node.address, service, method, messages)
            assert code == INVALID, (method.name, messages[:1], code)
        assert_serving(node.address)


def test_an_oversized_message_gets_resource_exhausted(node, methods):
    too_big = b"\x0a" + wire._varint(MAX_MESSAGE_BYTES) + bytes(MAX_MESSAGE_BYTES)
    for service, method in methods:
        code = call(node.address, service, method, [too_big])
        assert code == RESOURCE, (method.name, code)
        assert_serving(node.address)


def test_messages_built_from_each_request_field_get_a_clean_status(node, methods):
    for service, method in methods:
        for name, message in field_cases(method.input_type, [key(i) for i in range(MAX_KEYS * 4)]):
            messages = [message] if not method.client_streaming else [message, message]
            code = call(node.address, service, method, messages)
            assert code not in UNCLEAN, (method.name, name, code)
        assert_serving(node.address)


def test_semantically_bad_values_get_their_status(node, methods):
    for service, method in methods:
        for what, messages, expected in SEMANTIC[method.name]:
            if not messages and not method.client_streaming:
                continue
            code = call(node.address, service, method, messages)
            assert code == expected, (method.name, what, code)
        assert_serving(node.address)
