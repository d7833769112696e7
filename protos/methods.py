"""gRPC method paths read from kvcache.proto's descriptor, for the few calls that cannot use the
generated stubs (a hand-framed message, no protobuf serializer): called at import, so a method
renamed or removed in the proto stops the import instead of failing its first call."""

from protos import kvcache_pb2


def method_path(service: str, method: str) -> str:
    """"/kvcache.v1.SERVICE/METHOD"; KeyError when the proto has no such service or method."""
    services = kvcache_pb2.DESCRIPTOR.services_by_name
    if service not in services:
        raise KeyError(f"kvcache.proto has no service {service!r} (it has {', '.join(sorted(services))})")
    methods = services[service].methods_by_name
    if method not in methods:
        raise KeyError(f"kvcache.proto's {service} has no method {method!r} (it has {', '.join(sorted(methods))})")
    return f"/{services[service].full_name}/{method}"
