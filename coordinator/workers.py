"""The relay's gRPC side: one channel per worker, and Generate streams that end with
AttemptFailed instead of grpc.RpcError and are cancelled when the client's call ends."""

from __future__ import annotations

import threading
from typing import Iterator

import grpc

from coordinator.relay import AttemptFailed, ClientCall
from protos import kvcache_pb2 as pb
from protos import security
from worker.client import WorkerClient


class WorkerStreams:
    def __init__(self, credentials: security.Credentials | None = None):
        self.credentials = credentials
        self._clients: dict[str, WorkerClient] = {}
        self._lock = threading.Lock()

    def open(self, address: str, request: pb.GenerateRequest, timeout: float,
             call: ClientCall) -> Iterator[pb.GenerateReply]:
        stream = self._client(address).generate_stream(request, timeout=timeout, metadata=call.metadata)
        call.on_end(stream.cancel)  # the client went away: the worker frees the request's blocks at once
        try:
            yield from stream
        except grpc.RpcError as exc:
            raise AttemptFailed(exc.code(), exc.details() or "no details") from None
        finally:
            stream.cancel()  # no-op once finished; frees the worker when the relay stops early

    def _client(self, address: str) -> WorkerClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = WorkerClient(address, credentials=self.credentials)
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
