"""The relay's gRPC side: one channel per worker, and Generate streams that end with
AttemptFailed instead of grpc.RpcError and are cancelled when the client's call ends.

The channels are bounded (MAX_CHANNELS): workers come and go on new addresses, so past the
bound the least recently used channel with no stream open is closed."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Iterator

import grpc

from base import security
from coordinator.relay import AttemptFailed, ClientCall
from protos import kvcache_pb2 as pb
from worker.client import WorkerClient, is_draining


MAX_CHANNELS = 256


class WorkerStreams:
    def __init__(self, credentials: security.Credentials | None = None, max_channels: int = MAX_CHANNELS):
        self.credentials = credentials
        self.max_channels = max_channels
        self._clients: OrderedDict[str, WorkerClient] = OrderedDict()  # least recently used first
        self._open: Counter[str] = Counter()  # streams open per address: their channel stays
        self._lock = threading.Lock()

    def open(self, address: str, request: pb.GenerateRequest, timeout: float,
             call: ClientCall) -> Iterator[pb.GenerateReply]:
        client = self._take(address)
        try:
            stream = client.generate_stream(request, timeout=timeout, metadata=call.metadata)
            call.on_end(stream.cancel)  # the client went away: the worker frees the request's blocks at once
            try:
                yield from stream
            except grpc.RpcError as exc:
                raise AttemptFailed(exc.code(), exc.details() or "no details", is_draining(exc)) from None
            finally:
                stream.cancel()  # no-op once finished; frees the worker when the relay stops early
        finally:
            with self._lock:
                self._open[address] -= 1
                if not self._open[address]:
                    del self._open[address]

    def num_channels(self) -> int:
        with self._lock:
            return len(self._clients)

    def _take(self, address: str) -> WorkerClient:
        """The address's client, counted as in use, made if needed; past the bound an idle one is closed."""
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = WorkerClient(address, credentials=self.credentials)
                idle = [a for a in self._clients if a != address and not self._open[a]]
                for old in idle[: max(0, len(self._clients) - self.max_channels)]:
                    self._clients.pop(old).close()
            self._clients.move_to_end(address)
            self._open[address] += 1
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
