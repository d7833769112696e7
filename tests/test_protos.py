"""The committed gRPC stubs are exactly what `make protos` generates from the .proto files; hand-built
calls take their paths from the proto."""

from pathlib import Path

import pytest

from protos.generate import PROTO_FILES, generate
from protos.methods import method_path, service_name

PROJECT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_protos(tmp_path):
    generate(PROJECT, tmp_path)
    for proto in PROTO_FILES:
        stem = Path(proto).with_suffix("")
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            generated = tmp_path / f"{stem}{suffix}"
            committed = PROJECT / f"{stem}{suffix}"
            assert committed.read_text() == generated.read_text(), (
                f"{committed.relative_to(PROJECT)} differs from the .proto: run `make protos` and commit"
            )


def test_method_paths_come_from_the_proto():
    assert service_name("Worker") == "kvcache.v1.Worker"
    assert method_path("KVStore", "GetPages") == "/kvcache.v1.KVStore/GetPages"
    with pytest.raises(KeyError, match="no method 'GetPage'"):
        method_path("KVStore", "GetPage")
    with pytest.raises(KeyError, match="no service 'KVStores'"):
        method_path("KVStores", "GetPages")
