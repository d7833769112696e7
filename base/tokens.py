"""Client tokens: who is calling, and so which tenant's pages a request may share.

A tokens file has one `TENANT TOKEN` per line (`# ...` comments and blank lines ignored); a
third word `shared` puts that tenant's pages in the shared namespace, which every `shared` tenant
reads and writes (a public system prompt). Other tenants each have a namespace of their own,
their name, mixed into the root of the page-key chain and into the coordinator's placement key,
so the same prompt from two tenants has unrelated keys. A caller sends `authorization: Bearer
TOKEN` metadata; tokens are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc

from base.log_limits import CountedEvent

log = logging.getLogger("security")

HEADER = "authorization"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
SHARED = "shared"


@dataclass(frozen=True)
class Tenant:
    name: str
    shared: bool = False

    @property
    def namespace(self) -> str:
        """What the page keys and placement mix in: "" (the shared namespace) or the tenant's name."""
        return "" if self.shared else self.name


class Tokens:
    def __init__(self, entries: Iterable[tuple[str, str, bool]]):
        self._entries = [(hashlib.sha256(token.encode()).digest(), Tenant(name, shared)) for name, token, shared in entries]
        if not self._entries:
            raise ValueError("the tokens file names no token")

    @classmethod
    def load(cls, path: str | Path) -> "Tokens":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"--tokens-file {path}: {exc.strerror or exc}") from None
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) not in (2, 3) or (len(words) == 3 and words[2] != SHARED):
                raise ValueError(f"--tokens-file {path} line {number}: expected TENANT TOKEN [shared], "
                                 f"got {len(words)} words")  # never echo the line: it holds a token
            if len(words[1]) < 16:
                raise ValueError(f"--tokens-file {path} line {number}: a token needs at least 16 characters")
            entries.append((words[0], words[1], len(words) == 3))
        return cls(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def tenant(self, token: str | None) -> Tenant | None:
        """The token's tenant, or None; the same work for any token: compared with every known one in
        constant time (digests, no early exit), so the time taken says nothing of the tokens."""
        if not token:
            return None
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(presented, digest) and found is None:
                found = tenant
        return found

    def tenant_of(self, metadata) -> Tenant | None:
        return self.tenant(bearer_token(metadata))


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == HEADER and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


def authorization(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (nothing without one)."""
    return ((HEADER, f"Bearer {token}"),) if token else ()


def forwarded(metadata) -> tuple[tuple[str, str], ...]:
    """The caller's authorization, to send on to a worker (it finds the same tenant)."""
    return authorization(bearer_token(metadata))


class TokenCheck(grpc.ServerInterceptor):
    """UNAUTHENTICATED for any call without a known token, before its handler runs, but health (open
    for probes) and `open_methods`: a coordinator's Register, Heartbeat and Deregister, which
    members, not clients, call, and which mutual TLS keeps strangers out of. Refusals say only
    that the token was missing or unknown."""

    def __init__(self, tokens: Tokens, open_methods: Iterable[str] = ()):
        self.tokens = tokens
        self.open_methods = frozenset(open_methods)
        self._refusals = CountedEvent()  # anyone can send calls without a token: a line per interval

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method in self.open_methods or method.startswith(_OPEN_PREFIXES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if self.tokens.tenant(token) is not None:
            return handler
        reason = "a known token" if token else "a token"
        self._refusals.happened()
        count = self._refusals.to_log()
        if count:  # never the token itself
            log.info("refused %d call(s) without a known token since the last such line, the last to %s", count, method)
        return _refusal(handler, f"this call needs {reason}: send the metadata `authorization: Bearer TOKEN`")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def refuse_stream(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # a generator, as a streaming handler is

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=refuse)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=refuse_stream)
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=refuse)
    return handler._replace(stream_stream=refuse_stream)


def interceptors(tokens: Tokens | None, open_methods: Iterable[str] = ()) -> list[grpc.ServerInterceptor]:
    return [] if tokens is None else [TokenCheck(tokens, open_methods)]


def add_arguments(parser) -> None:
    parser.add_argument("--tokens-file", metavar="FILE", default=None,
                        help="client tokens, one `TENANT TOKEN` a line (a third word `shared` puts the tenant's "
                             "pages in the namespace every shared tenant reads): every client call then needs "
                             "`authorization: Bearer TOKEN` and gets UNAUTHENTICATED without a known one, and "
                             "tenants never share pages (default: none, no token needed)")


def from_args(args) -> Tokens | None:
    return Tokens.load(args.tokens_file) if args.tokens_file else None


def client_token(token_file: str | None) -> str | None:
    """A client's token: the first word of --token-file, else $KVCACHE_TOKEN, else None."""
    if token_file:
        try:
            words = Path(token_file).read_text().split()
        except OSError as exc:
            raise ValueError(f"--token-file {token_file}: {exc.strerror or exc}") from None
        if not words:
            raise ValueError(f"--token-file {token_file} is empty")
        return words[0]
    return os.environ.get("KVCACHE_TOKEN") or None


def new_token() -> str:
    return secrets.token_urlsafe(24)
