"""Which cluster a client command (`generate`, `status`) talks to, and with which credentials.

In order: `--coordinators A,B`; `--run-dir DIR` (the cluster file `kvcache cluster up --run-dir DIR`
wrote); $KVCACHE_COORDINATORS; ./.kvcache/cluster.json, the one a plain `kvcache cluster up` in
this folder wrote. A cluster found through a file is named in one line on stderr, so a user
always knows which one answered; when it runs `--secure`, the run directory's CA and client token
(as `cluster up --secure` wrote them) are used unless --tls-* or a token is given.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.cluster_file import (CLIENT_TOKEN_FILE, CLUSTER_FILE, DEFAULT_RUN_DIR, ClusterFileError,
                                  read_cluster_file)
from base import security, tokens

ENV_COORDINATORS = "KVCACHE_COORDINATORS"


@dataclass
class Target:
    """Coordinator addresses and the Client keywords (TLS files, token) to reach them with;
    `found_in`: the cluster file they came from, None when given on the command line or $KVCACHE_COORDINATORS."""

    coordinators: list[str]
    options: dict = field(default_factory=dict)
    found_in: Path | None = None
    model: str | None = None  # the workers' --model, as the cluster file says it

    def describe(self) -> str:
        """The one line said on stderr for a cluster found through its file."""
        secure = ", TLS with the CA and client token of its run directory" if self.options.get("tls_ca") else ""
        return f"using the cluster in {self.found_in} (coordinators {','.join(self.coordinators)}{secure})"

    def hint(self) -> str:
        """What to add to a connection error: a file left by a cluster that has stopped names dead ports."""
        if self.found_in is None:
            return ""
        return (f" (addresses from {self.found_in}: if that cluster has stopped, `kvcache cluster down "
                f"--run-dir {self.found_in.parent}` removes the file)")


def add_arguments(parser: argparse.ArgumentParser, coordinators_help: str | None = None):
    """--coordinators, --run-dir, --token-file and --tls-*: what every client command takes. Returns
    the group --coordinators and --run-dir exclude each other in, for a command's other targets."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--coordinators", default=None, metavar="A,B",
                       help=coordinators_help or
                       f"coordinator addresses, tried in turn (default: ${ENV_COORDINATORS}, else the cluster "
                       f"`kvcache cluster up` started from this folder, ./{DEFAULT_RUN_DIR}/{CLUSTER_FILE})")
    where.add_argument("--run-dir", default=None, metavar="DIR",
                       help="talk to the cluster `kvcache cluster up --run-dir DIR` started (its cluster file, and "
                            "its certificates and client token when it runs --secure)")
    add_token_argument(parser)
    security.add_arguments(parser, client=True)
    return where


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="FILE", default=None,
                        help="this client's token, sent as `authorization: Bearer TOKEN`: a file holding it alone "
                             f"(`cluster up --secure` writes RUN_DIR/{CLIENT_TOKEN_FILE}), or a tokens file of "
                             "`TENANT TOKEN` lines such as RUN_DIR/tokens, whose `default` tenant (or only one) is "
                             "taken unless --tenant names another (default: $KVCACHE_TOKEN, else the token of a "
                             "secure cluster found by its run directory, else none)")
    parser.add_argument("--tenant", metavar="NAME", default=None,
                        help="the tenant whose token to take from a --token-file of `TENANT TOKEN` lines")


def resolve(args: argparse.Namespace) -> Target:
    """The cluster the options name (module docstring); ValueError saying what to do when none is."""
    run_dir = args.run_dir
    if args.coordinators is None and run_dir is None:
        if os.environ.get(ENV_COORDINATORS, "").strip():
            return _given(args, os.environ[ENV_COORDINATORS])
        run_dir = DEFAULT_RUN_DIR
        if not (Path(run_dir) / CLUSTER_FILE).is_file():
            raise ValueError(f"no cluster given, and none in ./{DEFAULT_RUN_DIR}/{CLUSTER_FILE}: start one here "
                             f"with `kvcache cluster up`, or give --coordinators A,B (or --run-dir DIR, or set "
                             f"${ENV_COORDINATORS})")
    if run_dir is None:
        return _given(args, args.coordinators)
    return _from_run_dir(args, Path(run_dir).resolve())


def _given(args: argparse.Namespace, text: str) -> Target:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--coordinators names no address: give host:port,host:port")
    return Target(addresses, {**tls_options(args), "token": client_token(args)})


def _from_run_dir(args: argparse.Namespace, run_dir: Path) -> Target:
    cluster_file = run_dir / CLUSTER_FILE
    try:
        cluster = read_cluster_file(cluster_file, "start a cluster with `kvcache cluster up --run-dir DIR`")
    except ClusterFileError as exc:
        raise ValueError(str(exc).removeprefix("error: ")) from None
    # A member still starting has no address yet (kvcache.cluster.start_cluster).
    addresses = [m["address"] for m in cluster.get("members", []) if m.get("role") == "coordinator" and m.get("address")]
    if not addresses:
        raise ValueError(f"{cluster_file} names no coordinator: start the cluster again with `kvcache cluster up`")
    options = tls_options(args)
    token = client_token(args)
    if cluster.get("secure"):
        ca = run_dir / "tls" / "ca.pem"  # a client needs no certificate of its own (security: a coordinator takes clients without one)
        if not any(options.values()) and ca.is_file():
            options = {**options, "tls_ca": str(ca)}
        if token is None and (run_dir / CLIENT_TOKEN_FILE).is_file():
            token = tokens.client_token(str(run_dir / CLIENT_TOKEN_FILE))
    return Target(addresses, {**options, "token": token}, cluster_file, cluster.get("model"))


def cluster_here(tls: dict) -> Target | None:
    """The cluster `kvcache cluster up` started in this folder (./.kvcache/cluster.json), with its
    CA and the gateway's certificate when it runs --secure and `tls` (--tls-*) gives none; None
    without the file. For the gateway, whose callers bring their own tokens. ValueError for a file
    that cannot be used."""
    if not (Path(DEFAULT_RUN_DIR) / CLUSTER_FILE).is_file():
        return None
    args = argparse.Namespace(token_file=None, tenant=None,
                              **{name: tls.get(name) for name in ("tls_ca", "tls_cert", "tls_key")})
    run_dir = Path(DEFAULT_RUN_DIR).resolve()
    target = _from_run_dir(args, run_dir)
    target.options.pop("token", None)
    cert, key = run_dir / "tls" / "gateway.pem", run_dir / "tls" / "gateway.key"
    if target.options.get("tls_ca") and not tls.get("tls_cert") and cert.is_file() and key.is_file():
        target.options.update(tls_cert=str(cert), tls_key=str(key))  # HTTPS, as `cluster up --secure` starts it
    return target


def tls_options(args: argparse.Namespace) -> dict:
    """Client's TLS keywords from --tls-ca, --tls-cert and --tls-key."""
    return {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}


def client_token(args: argparse.Namespace) -> str | None:
    """The token of --token-file and --tenant, else $KVCACHE_TOKEN, else None (tokens.client_token)."""
    return tokens.client_token(args.token_file, getattr(args, "tenant", None))
