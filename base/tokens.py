"""Client tokens: who is calling, and so which tenant's pages a request may share.

A tokens file has one `TENANT TOKEN` per line (`# ...` comments and blank lines ignored); a
third word `shared` puts that tenant's pages in the shared namespace, which every `shared` tenant
reads and writes (a public system prompt). Other tenants each have a namespace of their own,
their name, mixed into the root of the page-key chain and into the coordinator's placement key,
so the same prompt from two tenants has unrelated keys. A caller sends `authorization: Bearer
TOKEN` metadata; tokens are never logged.

A client's --token-file holds its token alone (`cluster up --secure` writes RUN_DIR/client.token
so), or is a tokens file: the run directory's `tokens` works as it is, its `default` tenant being
the clients' (`--tenant NAME` picks another; a file of one tenant needs none).
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
        return cls(tenant_lines(_read(path, "--tokens-file"), path, "--tokens-file"))

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


def _read(path: str | Path, option: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{option} {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _lines(text: str) -> list[tuple[int, list[str]]]:
    """(line number, words) of each line with words, `# ...` comments left out."""
    numbered = ((number, line.split("#", 1)[0].split()) for number, line in enumerate(text.splitlines(), start=1))
    return [(number, words) for number, words in numbered if words]


def tenant_lines(text: str, path: str | Path, option: str,
                 expected: str = "TENANT TOKEN [shared]") -> list[tuple[str, str, bool]]:
    """(tenant, token, shared) of a tokens file's lines (the format: the module's docstring);
    ValueError naming the line that is not one, never echoing it (it holds a token)."""
    entries = []
    for number, words in _lines(text):
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != SHARED):
            raise ValueError(f"{option} {path} line {number}: expected {expected}, got {len(words)} "
                             f"word{'' if len(words) == 1 else 's'}"
                             + (f" (a third word can only be `{SHARED}`)" if len(words) == 3 else ""))
        if len(words[1]) < 16:
            raise ValueError(f"{option} {path} line {number}: a token needs at least 16 characters")
        entries.append((words[0], words[1], len(words) == 3))
    return entries


DEFAULT_TENANT = "default"  # the clients' tenant of the tokens file `kvcache cluster up --secure` writes


def client_token(token_file: str | None, tenant: str | None = None) -> str | None:
    """A client's token: from --token-file, else $KVCACHE_TOKEN, else None.

    The file holds the token alone, or is a daemons' tokens file (`TENANT TOKEN [shared]` lines):
    then the token is `tenant`'s, or the only tenant's, or that of `default` (the clients'
    tenant of `kvcache cluster up --secure`). ValueError for a file that is neither, or a tenant
    it does not name; no message echoes a token."""
    if not token_file:
        if tenant is not None:
            raise ValueError("--tenant picks a tenant of a tokens file: give that file as --token-file")
        return os.environ.get("KVCACHE_TOKEN") or None
    text = _read(token_file, "--token-file")
    lines = _lines(text)
    if not lines:
        raise ValueError(f"--token-file {token_file} is empty: it should hold the token alone, or "
                         f"`TENANT TOKEN` lines (a daemons' --tokens-file)")
    if len(lines) == 1 and len(lines[0][1]) == 1:
        if tenant is not None:
            raise ValueError(f"--token-file {token_file} holds a token alone, not tenants: --tenant has none to pick")
        return lines[0][1][0]
    entries = tenant_lines(text, token_file, "--token-file",
                           expected="the token alone, or `TENANT TOKEN [shared]` lines (a daemons' --tokens-file)")
    names = [name for name, _, _ in entries]
    wanted = tenant if tenant is not None else (names[0] if len(names) == 1 else DEFAULT_TENANT)
    for name, token, _ in entries:
        if name == wanted:
            return token
    if tenant is not None:
        raise ValueError(f"--token-file {token_file} names no tenant {tenant!r}; it names {', '.join(names)}")
    raise ValueError(f"--token-file {token_file} names the tenants {', '.join(names)}: give --tenant NAME "
                     f"to pick the one this client is")


def new_token() -> str:
    return secrets.token_urlsafe(24)
