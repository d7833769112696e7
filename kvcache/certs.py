"""`kvcache certs DIR`: a development CA and one certificate per member role, for TLS and
mutual TLS between the cluster's members (base/security.py reads them).

Writes DIR/ca.pem (give it to every daemon and client as --tls-ca), DIR/ca.key (keep it to sign
more; no daemon needs it), and DIR/ROLE.pem + DIR/ROLE.key for coordinator, node, worker,
client (optional: a coordinator takes clients without one), gateway (its HTTPS port's) and
monitor (a Prometheus scraping the daemons' metrics ports). Every certificate names 127.0.0.1, ::1, localhost and each --host as subject
alternative names (TLS checks the address a member is reached at against them), and may serve
and be presented as a client (members are both). Keys are ECDSA P-256, files 0600.

For development and tests: a real deployment signs its members' certificates with its own CA.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

ROLES = ("coordinator", "node", "worker", "client", "gateway", "monitor")
DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")
DEFAULT_DAYS = 365


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="folder to write the CA and certificates into (created if missing)")
    parser.add_argument("--host", action="append", default=[], metavar="NAME",
                        help="a host name or address members are reached at, besides 127.0.0.1, ::1 and "
                             "localhost (repeat for several)")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity (default {DEFAULT_DAYS})")
    parser.add_argument("--force", action="store_true", help="overwrite certificates already in DIR")


def run(args: argparse.Namespace) -> int:
    try:
        written = make_certs(Path(args.dir), args.host, args.days, args.force)
    except (ValueError, OSError) as exc:
        print(f"kvcache certs: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(p.name for p in written)} to {args.dir}")
    print(f"daemons: --tls-cert {args.dir}/ROLE.pem --tls-key {args.dir}/ROLE.key --tls-ca {args.dir}/ca.pem")
    print(f"clients: --tls-ca {args.dir}/ca.pem (and a token: a coordinator needs no client certificate)")
    return 0


def make_certs(folder: Path, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS, force: bool = False,
               extra: Mapping[str, str] | None = None) -> list[Path]:
    """The CA and every role's certificate in `folder`, plus `extra`'s {file name: role}: a second
    certificate of a role for another kind of process (a vLLM connector acting as a worker), so the
    members' own keys need not be handed to it; the paths written."""
    # Imported here: every `kvcache` command builds this one's parser, and cryptography takes ~0.1 s.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError(f"--days must be at least 1, got {days}")
    certificates = [*((role, role) for role in ROLES), *(extra or {}).items()]
    unknown = [f"{name} ({role})" for name, role in certificates if role not in ROLES]
    if unknown:
        raise ValueError(f"certificates of unknown roles: {', '.join(unknown)}; roles are {', '.join(ROLES)}")
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "ca.pem").exists() and not force:
        raise ValueError(f"{folder / 'ca.pem'} exists: give --force to make a new CA and certificates")
    names = list(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvcache development CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (_builder(ca_name, ca_name, ca_key.public_key(), now, days)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    written = [_write_pem(folder / "ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
               _write_key(folder / "ca.key", ca_key)]
    for name, role in certificates:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvcache-{role}")])
        cert = (_builder(subject, ca_name, key.public_key(), now, days)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        written += [_write_pem(folder / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
                    _write_key(folder / f"{name}.key", key)]
    return written


def _builder(subject, issuer, public_key, now: datetime.datetime, days: int):
    from cryptography import x509

    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # a peer's clock a little behind
            .not_valid_after(now + datetime.timedelta(days=days)))


def _general_name(name: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def _write_pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _write_key(path: Path, key) -> Path:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)  # also when the file existed with looser bits
    return path
