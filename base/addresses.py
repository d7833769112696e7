"""Host and port as every daemon prints, parses and advertises them: `host:port`, an IPv6
literal in brackets (`[::1]:50051`), and the rule for what a member advertises (a coordinator
or the gateway, which register nowhere, only say where they are reached)."""

from __future__ import annotations

import ipaddress

WILDCARDS = ("0.0.0.0", "::", "")
COORDINATOR_PORT = 50050  # a coordinator's --port unless given
# What the command line and the gateway dial when given no coordinators: a local cluster's.
DEFAULT_COORDINATORS = f"127.0.0.1:{COORDINATOR_PORT}"


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC targets read it: an IPv6 literal goes in brackets ([::1]:50051)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def split_host_port(address: str, default_port: int | None = None) -> tuple[str, int]:
    """(host, port) of `host:port`, `[v6]:port` or, with default_port, a bare host or IPv6
    literal; the host without brackets. ValueError says what is wrong."""
    address = address.strip()
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{address!r}: an IPv6 address goes in brackets, [::1]:50051")
        port_text = rest[1:] if rest else None
    elif address.count(":") > 1:
        if not _is_ipv6(address):
            raise ValueError(f"{address!r}: an IPv6 address with a port goes in brackets, [::1]:50051")
        host, port_text = address, None
    else:
        host, sep, port_text = address.partition(":")
        port_text = port_text if sep else None
    if not host:
        raise ValueError(f"{address!r} names no host")
    if port_text is None:
        if default_port is None:
            raise ValueError(f"{address!r} names no port: give HOST:PORT")
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise ValueError(f"{address!r}: the port must be 1-65535")
    return host, int(port_text)


def is_wildcard(host: str) -> bool:
    """True for an address that means every interface: nobody can dial it from elsewhere."""
    return host.strip("[]") in WILDCARDS


def advertised(bind_host: str, port: int, advertise: str | None) -> str:
    """What a member registers: --advertise (HOST:PORT, or HOST with the bound port), else the
    bound address; ValueError for a wildcard bind without --advertise or a wildcard advertised."""
    if advertise:
        host, port = split_host_port(advertise, default_port=port)
        if is_wildcard(host):
            raise ValueError(f"--advertise {advertise}: advertise an address others can dial, not a wildcard")
        return host_port(host, port)
    if is_wildcard(bind_host):
        raise ValueError(f"--host {bind_host or repr(bind_host)} listens on every interface: give --advertise HOST[:PORT], "
                         "the address other machines reach this one at")
    return host_port(bind_host.strip("[]"), port)


def reached_at(bind_host: str, port: int, advertise: str | None) -> str | None:
    """Where a daemon that registers nowhere (a coordinator, the gateway) is reached: --advertise,
    checked as a member's, else the bound address; None for a wildcard bind without one (its
    clients are given the address; it cannot tell it)."""
    if advertise or not is_wildcard(bind_host):
        return advertised(bind_host, port, advertise)
    return None


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text.split("%", 1)[0])
        return True
    except ValueError:
        return False
