"""Bad input for any kvcache daemon, found by server reflection: list its methods, build
messages from each request's own fields with edge values, and send raw bytes to any method
whatever its shape. Used by the every-method bad-input tests of each daemon."""

from __future__ import annotations

import math

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster_helpers import raw_channel

UNCLEAN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1 claims ~4 GiB that are not there


def list_methods(address: str, prefix: str = "kvcache.") -> list[tuple[str, object]]:
    """(service, method descriptor) for every method of the daemon's own services."""
    channel = grpc.insecure_channel(address)
    try:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(database)
        found = []
        for name in database.get_services():
            if name.startswith(prefix):
                found += [(name, method) for method in pool.FindServiceByName(name).methods]
        return found
    finally:
        channel.close()


def call(address: str, service: str, method, messages: list[bytes], timeout_s: float = 10.0) -> grpc.StatusCode:
    """Send `messages` as bytes to the method, whatever its shape; the status it ended with."""
    channel = raw_channel(address)
    path = f"/{service}/{method.name}"
    try:
        if method.client_streaming:
            stub = (channel.stream_stream if method.server_streaming else channel.stream_unary)(path, None, None)
            request = iter(messages)
        else:
            stub = (channel.unary_stream if method.server_streaming else channel.unary_unary)(path, None, None)
            request = messages[0]
        reply = stub(request, timeout=timeout_s)
        if method.server_streaming:
            list(reply)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


def _edge_values(field, many_bytes: list[bytes]) -> list:
    if field.type == FieldDescriptor.TYPE_BYTES:
        values = [b"", b"x" * 15, b"x" * 17, b"x" * 1000]
        return [[v] for v in values] + [many_bytes] if field.is_repeated else values
    if field.type == FieldDescriptor.TYPE_BOOL:
        values = [True]
    elif field.cpp_type in (FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64):
        values = [2**32 - 1 if field.cpp_type == FieldDescriptor.CPPTYPE_UINT32 else 2**64 - 1]
    elif field.cpp_type in (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64):
        values = [-1, -(2**31)]
    elif field.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        values = [-1.0, math.nan, math.inf, 1e30]
    elif field.cpp_type == FieldDescriptor.CPPTYPE_STRING:
        values = ["", "x" * 1000]
    else:
        return []
    return [[v] for v in values] + [values * 5000] if field.is_repeated else values


def field_cases(message_descriptor, many_bytes: list[bytes] = ()) -> list[tuple[str, bytes]]:
    """Messages built from the request's own fields: edge values for each field in turn
    (a repeated field also gets a long list; `many_bytes` is that list for repeated bytes)."""
    cls = message_factory.GetMessageClass(message_descriptor)
    cases = [("empty", b"")]
    for field in message_descriptor.fields:
        for value in _edge_values(field, list(many_bytes)):
            message = cls()
            if field.is_repeated:
                getattr(message, field.name).extend(value)
            else:
                setattr(message, field.name, value)
            cases.append((f"{field.name}={str(value)[:40]}", message.SerializeToString()))
    return cases
