"""gRPC service names and method paths read from kvcache.proto's descriptor, for what the generated
stubs do not cover (calls with a hand-framed message, servers' names, lists of methods): called at
import, so a name renamed or removed in the proto stops the import instead of failing a call."""

from protos import kvcache_pb2


def service_name(service: str) -> str:
    """"kvcache.v1.SERVICE", as servers register it; KeyError when the proto has no such service."""
    services = kvcache_pb2.DESCRIPTOR.services_by_name
    if service not in services:
        raise KeyError(f"kvcache.proto has no service {service!r} (it has {', '.join(sorted(services))})")
    return services[service].full_name


def method_path(service: str, method: str) -> str:
    """"/kvcache.v1.SERVICE/METHOD"; KeyError when the proto has no such service or method."""
    full_name = service_name(service)
    methods = kvcache_pb2.DESCRIPTOR.services_by_name[service].methods_by_name
    if method not in methods:
        raise KeyError(f"kvcache.proto's {service} has no method {method!r} (it has {', '.join(sorted(methods))})")
    return f"/{full_name}/{method}"
