"""AsyncClient: coordinator.client.Client on grpc.aio, for callers on an asyncio event loop (the
gateway). Same coordinators tried in turn, same resume of a greedy or seeded request through
another coordinator; its replies are read on the caller's loop, with no thread between them and it.

Made, used and closed on one running event loop: grpc.aio's channels belong to the loop they were
made on. While tracing is on, each call carries the caller's trace context (`traceparent`), read
on the caller's task as the call is made (grpc.aio takes no sync interceptor), so the
coordinator's span is a child of the gateway's.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Mapping, Sequence

import grpc

from base import security
from base.generation import Finished, Piece
from base.observability import trace_metadata
from base.tokens import authorization
from coordinator.client import (TRY_ELSEWHERE, ClusterError, client_credentials, first_prompt, may_be_tls_mismatch,
                                none_served, not_resumable, resumable, resumed, tls_mismatch)
from protos import kvcache_pb2 as pb
from protos import kvcache_pb2_grpc as pb_grpc
from worker.client import generate_request, parse_reply

__all__ = ["AsyncClient", "ClusterError"]


class AsyncClient:
    def __init__(self, coordinators: Sequence[str], timeout: float = 600.0, token: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None):
        credentials = client_credentials(coordinators, tls_ca, tls_cert, tls_key)
        self.timeout = timeout
        self._credentials = credentials
        self._metadata = authorization(token)
        self._channels = [(address, security.aio_channel(address, credentials, security.KEEPALIVE_OPTIONS))
                          for address in dict.fromkeys(coordinators)]
        self._stubs = [(address, pb_grpc.CoordinatorStub(channel)) for address, channel in self._channels]
        self._preferred = 0

    async def generate(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]], session_id: str = "",
                       token: str | None = None, **options) -> AsyncIterator[Piece | Finished]:
        """Pieces as they come, then one Finished; as Client.generate. Leaving the loop early (closing
        it, or cancelling the task that reads it) cancels the call: the coordinator cancels the
        worker's stream and the worker frees the request's blocks."""
        metadata = (self._metadata if token is None else authorization(token)) + trace_metadata()
        request = generate_request(prompt, **options)
        request.session_id = session_id
        sent: list[int] = []
        prompt_sent = False  # echo: the prompt goes to the caller once
        errors, codes, unreachable = [], set(), []
        for index, (address, stub) in self._in_order():
            call = stub.Generate(resumed(request, sent), timeout=self.timeout, metadata=metadata)
            try:
                while (reply := await call.read()) is not grpc.aio.EOF:
                    if (event := first_prompt(parse_reply(reply), prompt_sent)) is None:
                        continue
                    if isinstance(event, Piece):
                        sent.extend(event.token_ids)
                        prompt_sent |= event.prompt is not None
                    yield event
                    if isinstance(event, Finished):
                        self._preferred = index
                        return
                errors.append(f"{address}: stream ended without finishing")
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in TRY_ELSEWHERE:
                    raise ClusterError(exc.code(), exc.details() or "no details") from None
                errors.append(f"{address}: {exc.code().name}: {exc.details()}")
                codes.add(exc.code())
                if may_be_tls_mismatch(exc) and not sent:
                    unreachable.append(address)
            finally:
                call.cancel()   # a no-op once finished
            if sent and not resumable(request):
                raise not_resumable(sent, errors)
        if codes == {grpc.StatusCode.UNAVAILABLE}:
            await self._raise_if_mismatch(unreachable)
        raise none_served(codes, errors)

    async def status(self, timeout: float = 5.0, token: str | None = None) -> pb.ClusterStatusReply:
        metadata = (self._metadata if token is None else authorization(token)) + trace_metadata()
        errors, unreachable = [], []
        for _, (address, stub) in self._in_order():
            try:
                return await stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=timeout, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # another coordinator would say the same
                    raise ClusterError(exc.code(), exc.details() or "no details") from None
                errors.append(f"{address}: {exc.code().name}")
                if may_be_tls_mismatch(exc):
                    unreachable.append(address)
        await self._raise_if_mismatch(unreachable)
        raise ClusterError(grpc.StatusCode.UNAVAILABLE, "no coordinator answered: " + "; ".join(errors))

    async def _raise_if_mismatch(self, unreachable: list[str]) -> None:
        """TlsMismatch when a coordinator that did not answer speaks TLS otherwise (asked on a thread:
        the probe's sockets block)."""
        mismatch = await asyncio.to_thread(tls_mismatch, unreachable, self._credentials)
        if mismatch is not None:
            raise mismatch

    def _in_order(self) -> list[tuple[int, tuple[str, object]]]:
        numbered = list(enumerate(self._stubs))
        return numbered[self._preferred:] + numbered[:self._preferred]

    async def close(self) -> None:
        for _, channel in self._channels:
            await channel.close()
