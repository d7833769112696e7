"""Who may talk to a kvcache daemon: TLS and mutual TLS for gRPC and the data plane.

One Credentials per process, from --tls-cert, --tls-key and --tls-ca. A daemon given all three
takes TLS only on its gRPC and data ports; its own calls to other members present its certificate.
A kvnode's and a worker's ports take only a peer presenting a certificate of the CA (mutual TLS):
only members and the coordinators call them. A coordinator's port asks for a certificate and checks
one given, but takes a client without one: the CA and a token are a client's whole equipment.
grpcio's Python API can require a client certificate or not ask for one, not ask and check it when
given (require_client_auth=False never sees the peer's certificate), so a coordinator's TLS is
Python's, in front of its gRPC server (base/tls_front.py). Without the options a daemon stays
plaintext, for a loopback development cluster.

A TLS client against a plaintext server, or a plaintext one against a TLS server, hears from gRPC
only "Socket closed": when no server answered, a client asks each one itself (tls_mismatch, a
TLS ClientHello on a connection of its own) and says the mismatch in one line; a certificate
either end refuses is said so too.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from base import addresses

log = logging.getLogger("security")


@dataclass
class Credentials:
    """Certificate, key and CA files; `cert` and `key` may be None for a client that only checks servers."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    generation: int = field(default=0, init=False)  # bumped by each reload

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("give --tls-cert and --tls-key together")
        self._lock = threading.Lock()
        self.load()

    def load(self) -> None:
        """Read the files and build contexts from them (ValueError naming the file that fails)."""
        ca = _read(self.ca, "--tls-ca")
        cert = _read(self.cert, "--tls-cert") if self.cert else None
        key = _read(self.key, "--tls-key") if self.key else None
        server_context = client_context = front_context = https_context = None
        try:
            client_context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca.decode())
            if cert is not None:
                client_context.load_cert_chain(self.cert, self.key)
                server_context = _server_context(self.cert, self.key, ca, ssl.CERT_REQUIRED)  # mutual TLS, as members' ports require
                front_context = _server_context(self.cert, self.key, ca, ssl.CERT_OPTIONAL)  # a coordinator's: a certificate checked when given
                front_context.set_alpn_protocols(["h2"])  # gRPC's clients want HTTP/2 named
                https_context = _server_context(self.cert, self.key, ca, ssl.CERT_NONE)  # the gateway's HTTPS
                https_context.set_alpn_protocols(["http/1.1"])
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"TLS files {self.cert or ''} {self.key or ''} {self.ca} do not make a certificate, "
                             f"key and CA that fit: {exc}") from None
        with self._lock:
            self._ca, self._cert, self._key = ca, cert, key
            self._server_context, self._client_context = server_context, client_context
            self._front_context, self._https_context = front_context, https_context
            self.generation += 1

    # ---- gRPC --------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: a peer must present a certificate of the CA. gRPC asks for the current
        certificate at each new handshake, so a reload (SIGHUP) reaches new connections."""
        if self._cert is None:
            raise ValueError("a server needs --tls-cert and --tls-key")
        served = [0]

        def current():
            with self._lock:
                if served[0] == self.generation:
                    return None  # unchanged: gRPC keeps the configuration it has
                served[0] = self.generation
                return grpc.ssl_server_certificate_configuration([(self._key, self._cert)], self._ca)

        return grpc.dynamic_ssl_server_credentials(current(), current, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        with self._lock:
            return grpc.ssl_channel_credentials(self._ca, self._key, self._cert)

    # ---- the data plane ---------------------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        with self._lock:
            if self._server_context is None:
                raise ValueError("a server needs --tls-cert and --tls-key")
            return self._server_context

    def client_context(self) -> ssl.SSLContext:
        with self._lock:
            return self._client_context

    def front_context(self) -> ssl.SSLContext:
        """A coordinator's port (base/tls_front.py): a client certificate asked for and checked, not required."""
        with self._lock:
            if self._front_context is None:
                raise ValueError("a server needs --tls-cert and --tls-key")
            return self._front_context


    def https_context(self) -> ssl.SSLContext:
        """The gateway's HTTPS port: its certificate, HTTP/1.1 by ALPN, no client certificate asked."""
        with self._lock:
            if self._https_context is None:
                raise ValueError("an HTTPS server needs --tls-cert and --tls-key")
            return self._https_context


def _server_context(cert: Path, key: Path, ca: bytes, verify_mode: ssl.VerifyMode) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.load_verify_locations(cadata=ca.decode())
    context.verify_mode = verify_mode
    return context


def _read(path: Path, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{option} {path}: {exc.strerror or exc}") from None


# For channels whose calls stream for long (a coordinator's to a worker, a client's to a
# coordinator): a peer cut off mid-stream (its link down) sends nothing, not even a reset, and
# without pings its caller would wait out the call's whole deadline. These channels ping every
# 10 s, also while no data flows (a long prefill); no answer within 5 s ends their calls
# UNAVAILABLE, so the caller resumes them elsewhere. Servers take a ping every 5 s at most
# (base/serving.py, server_options), so these never count as abuse.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


def channel(address: str, credentials: Credentials | None, options=()) -> grpc.Channel:
    """The one way to open a channel to a member: TLS with `credentials`, else plaintext."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials.channel_credentials(), options=list(options))


def aio_channel(address: str, credentials: Credentials | None, options=()) -> grpc.aio.Channel:
    """The same on grpc.aio, for a caller on an asyncio event loop (the gateway); made on that loop."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials.channel_credentials(), options=list(options))


def add_arguments(parser: argparse.ArgumentParser, client: bool = False, cert_help: str | None = None) -> None:
    """--tls-cert, --tls-key, --tls-ca: every daemon's and client's; `cert_help` says what a
    client's certificate is for when it is more than a client's (the gateway serves HTTPS with it)."""
    if client:
        cert = cert_help or ("this client's certificate (PEM) of the cluster's CA, with --tls-key: optional for a "
                             "coordinator, which needs only --tls-ca and a token; a worker's or kvnode's port "
                             "takes none without one")
        ca = ("the cluster's CA certificate (PEM): connections are then TLS, the servers checked against it "
              "(`kvcache cluster up --secure` writes RUN_DIR/tls/ca.pem)")
    else:
        cert = ("this daemon's certificate (PEM), presented to peers; with --tls-key and --tls-ca every connection "
                "is TLS (kvcache certs DIR makes them)")
        ca = "the cluster's CA certificate (PEM): peers must present a certificate it signed (a coordinator's clients need none)"
    parser.add_argument("--tls-cert", metavar="FILE", default=None, help=cert)
    parser.add_argument("--tls-key", metavar="FILE", default=None,
                        help=f"{'this client' if client else 'this daemon'}'s private key (PEM) for --tls-cert")
    parser.add_argument("--tls-ca", metavar="FILE", default=None, help=ca)


def from_args(args: argparse.Namespace, client: bool = False) -> Credentials | None:
    """Credentials from the options, None when none is given (plaintext); ValueError for a partial set."""
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if client and args.tls_ca and not args.tls_cert and not args.tls_key:
        return Credentials(Path(args.tls_ca))
    if not all(given):
        raise ValueError("give --tls-cert, --tls-key and --tls-ca together"
                         + ("" if not client else " (or --tls-ca alone: a coordinator takes a client without a certificate)"))
    return Credentials(Path(args.tls_ca), Path(args.tls_cert), Path(args.tls_key))


def reload_on_sighup(credentials: Credentials | None) -> None:
    """Re-read the certificate files on SIGHUP; a file that fails keeps the old ones. New gRPC and
    data plane connections use the new certificate, running ones keep theirs: rotation without a
    restart. (The files are also read at start, where a bad one is a clear error.)"""
    if credentials is None:
        return

    def reload(*_):
        try:
            credentials.load()
            log.info("TLS files re-read: new connections use them")
        except ValueError as exc:
            log.warning("TLS files not re-read, the old ones stay: %s", exc)

    signal.signal(signal.SIGHUP, reload)


def warn_if_exposed(host: str, credentials: Credentials | None, logger: logging.Logger) -> None:
    """One warning line at start for a plaintext daemon listening beyond loopback."""
    if credentials is None and not is_loopback(host):
        logger.warning("listening on %s without TLS: anyone who reaches this port can use it "
                       "(give --tls-cert, --tls-key and --tls-ca)", host)


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except (socket.gaierror, ValueError):
            return False


MEMBER_NAME_PREFIX = "kvcache-"
NO_CERTIFICATE = "(no certificate)"  # the role of a TLS caller that presented none (a coordinator's client)


def role_of_common_name(common_name: str) -> str:
    """The role a certificate's common name says, `kvcache-ROLE`; "" for a name not of that form."""
    return common_name[len(MEMBER_NAME_PREFIX):] if common_name.startswith(MEMBER_NAME_PREFIX) else ""


def peer_role(context: grpc.ServicerContext) -> str | None:
    """The role in the calling peer's certificate ("" for none of ours); None for a plaintext call.
    A coordinator under TLS asks its front instead (base/tls_front.py)."""
    auth = context.auth_context()
    if b"ssl" not in auth.get("transport_security_type", []):
        return None
    names = auth.get("x509_common_name", [])
    return role_of_common_name(names[0].decode(errors="replace")) if names else NO_CERTIFICATE


def socket_role(conn: socket.socket) -> str | None:
    """`peer_role` for a data plane connection: None when it is not TLS (a plain socket)."""
    getpeercert = getattr(conn, "getpeercert", None)  # an SSLSocket or kvnode.tls_stream.TlsStream
    if getpeercert is None:
        return None
    subject = dict(item for entry in (getpeercert() or {}).get("subject", ()) for item in entry)
    return role_of_common_name(subject.get("commonName", ""))


def not_member_reason(role: str | None, roles: tuple[str, ...], what: str) -> str | None:
    """Why a peer of `role` may not do `what`; None when it may (or the call is plaintext: a loopback
    development cluster is not checked).

    A certificate says who the peer is, not only that the CA signed it: a member's has the common
    name `kvcache-ROLE` (`kvcache certs` writes them so; a deployment's own CA must too). Only
    kvnodes and workers may Register, Heartbeat and Deregister with a coordinator, and only workers
    may look up, get and put pages on a kvnode. A client needs no certificate; one it presents
    reaches only client calls, which its token then names; a scraper's (`kvcache-monitor`) is the only one the metrics port
    takes."""
    if role is None or role in roles:
        return None
    if role == NO_CERTIFICATE:
        whose = "the caller presented no certificate (a member presents its own: --tls-cert, --tls-key)"
    else:
        whose = f"the caller's certificate is {'for ' + role if role else 'not a kvcache member certificate'}"
    return f"{what} is for {' and '.join(roles)} members: {whose}"


def refuse_unless_member(context: grpc.ServicerContext, roles: tuple[str, ...], what: str,
                         logger: logging.Logger, role_of=peer_role) -> None:
    """Abort the call with PERMISSION_DENIED unless its certificate names one of `roles` (see
    not_member_reason); `role_of(context)`: the caller's role (peer_role, or a coordinator's TLS
    front's)."""
    reason = not_member_reason(role_of(context), roles, what)
    if reason is not None:
        logger.info("refused request: PERMISSION_DENIED: %s", reason)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)


# ---- a TLS mismatch, said as one (the module's docstring says why) --------------

PROBE_TIMEOUT_S = 2.0


def speaks_tls(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the server at `address` answers a TLS ClientHello with TLS records; None when it
    cannot be reached or says nothing within `timeout_s`."""
    try:
        host, port = addresses.split_host_port(address)
    except ValueError:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only the kind of answer counts
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    try:
        context.wrap_bio(incoming, outgoing).do_handshake()
    except ssl.SSLWantReadError:
        pass
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(outgoing.read())
            answer = sock.recv(2)
    except socket.timeout:
        return None
    except ConnectionResetError:
        return False  # a plaintext server that cut the garbage short
    except OSError:
        return None
    # A TLS record (handshake 0x16 or alert 0x15, version 3.x); a plaintext gRPC server sends an
    # HTTP/2 frame or closes.
    return len(answer) == 2 and answer[0] in (0x15, 0x16) and answer[1] == 0x03


def tls_mismatch(address: str, credentials: Credentials | None, what: str = "the cluster",
                 member: bool = False, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """One line saying how this caller's TLS (`credentials`, None for plaintext) and the server's
    at `address` differ, with what to do; None when they agree or the server cannot be asked.
    `member`: the caller is a daemon (its advice names its own certificate), not a client."""
    tls = speaks_tls(address, timeout_s)
    if tls is None:
        return None
    if tls and credentials is None:
        give = ("start this daemon with --tls-cert, --tls-key and --tls-ca (its role's certificate and the "
                "cluster's CA, as `kvcache certs` writes them)") if member else (
                "pass --tls-ca FILE, the cluster's CA (`kvcache cluster up --secure` wrote RUN_DIR/tls/ca.pem; "
                "in Python Client(tls_ca=FILE)), and its token")
        return f"{what} at {address} speaks TLS and this {'daemon' if member else 'client'} does not: {give}"
    if not tls and credentials is not None:
        drop = "this daemon's --tls-cert, --tls-key and --tls-ca" if member else "--tls-ca, --tls-cert and --tls-key"
        return (f"{what} at {address} speaks plaintext, not TLS, and this {'daemon' if member else 'client'} "
                f"connected with TLS: leave out {drop}, or start {what} with TLS")
    if tls:
        return _certificate_mismatch(address, credentials, what, "daemon" if member else "client", timeout_s)
    return None


def _certificate_mismatch(address: str, credentials: Credentials, what: str, who: str,
                          timeout_s: float) -> str | None:
    """Why the server's certificate fails this caller's check, or the caller's the server's, if one does."""
    host, port = addresses.split_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            with credentials.client_context().wrap_socket(sock, server_hostname=host) as tls:
                # A gRPC server sends its settings at once; one refusing this caller's certificate (or
                # its want of one) an alert, or closes (a coordinator's front).
                if tls.recv(1):
                    return None
                alert = "closed"
    except ssl.SSLCertVerificationError as exc:
        return (f"{what} at {address} presents a certificate that --tls-ca {credentials.ca} does not accept "
                f"({exc.verify_message}): give the CA that signed the cluster's certificates, which must name "
                f"{host}")
    except ssl.SSLError as exc:
        alert = str(exc).upper()
    except OSError:
        return None
    if credentials.cert is None and ("CERTIFICATE_REQUIRED" in alert or alert == "closed"):
        return (f"{what} at {address} takes only callers with a certificate of the cluster's CA: pass "
                f"--tls-cert and --tls-key too (or go through a coordinator, which needs none)")
    if credentials.cert is not None and (alert == "closed" or any(
            a in alert for a in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN", "DECRYPT_ERROR"))):
        return (f"{what} at {address} does not accept this {who}'s certificate, --tls-cert {credentials.cert}: "
                f"give one signed by the cluster's CA")
    return None
