"""The Worker gRPC service: validates requests, hands them to the engine, relays its deltas.

One loop thread steps the engine; each Generate call waits on its request's handle.
A caller that disconnects or cancels aborts its request: the engine frees its blocks before its
next step (engine note 1: the abort is queued, never waited for on gRPC's event thread).
"""

from __future__ import annotations

import logging
import re
import threading
import uuid

import grpc

from kvcache import __version__
from protos import kvcache_pb2 as pb
from protos import serving
from worker.client import usage_to_proto
from worker.engine import Engine
from worker.remote import Placement
from worker.sampling import SamplingParams

log = logging.getLogger("worker")

SERVICE_NAME = "kvcache.v1.Worker"
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


class WorkerService:
    def __init__(self, engine: Engine, worker_id: str | None = None, max_tokens_limit: int = 4096):
        self.engine = engine
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self.max_tokens_limit = max_tokens_limit
        self.accepting = True
        self._stopping = threading.Event()
        self._loop = threading.Thread(target=self._run_engine, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._stopping.set()
        self._loop.join(timeout=10.0)

    def _run_engine(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.wait_for_work(timeout=0.2):
                continue
            try:
                self.engine.step()
            except Exception:  # a bug of ours: fail the running requests, keep serving
                log.exception("engine step failed; aborting running requests")
                for request_id in self.engine.live_request_ids():
                    self.engine.abort(request_id)

    # ---- handlers ------------------------------------------------------------

    def generate(self, request, context):
        serving.abort_if_malformed(request, context, log)
        if not self.accepting:
            _abort(context, grpc.StatusCode.UNAVAILABLE, "this worker is shutting down: send the request to another")
        prompt, params, placement = self._parse(request, context)
        request_id = request.request_id or uuid.uuid4().hex[:16]
        try:
            handle = self.engine.add_request(
                prompt, params, request_id=request_id, tier_context=placement, bypass_cache=request.no_cache
            )
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Runs when the call ends for any reason, on gRPC's event thread: must not wait (engine note 1).
        context.add_callback(lambda: self.engine.cancel(handle))
        for delta in handle:
            if delta.token_ids or delta.text:
                yield pb.GenerateReply(text=delta.text, token_ids=delta.token_ids)
            if delta.finished:
                completion = delta.completion
                yield pb.GenerateReply(usage=usage_to_proto(completion.usage), finish_reason=completion.finish_reason)

    def info(self, request, context) -> pb.WorkerInfo:
        serving.abort_if_malformed(request, context, log)
        engine = self.engine
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            version=__version__,
            model=engine.model.name,
            fingerprint=engine.fingerprint.hex(),
            kv_dtype=engine.kv_dtype,
            page_tokens=engine.page_tokens,
            page_bytes=engine.model.page_bytes(engine.kv_dtype, engine.page_tokens),
            running=engine.num_running(),
            waiting=engine.num_waiting(),
            free_blocks=engine.get_num_free_blocks(),
            total_blocks=engine.pool.num_blocks,
            max_tokens_limit=self.max_tokens_limit,
            max_positions=engine.model.config.max_positions,
        )

    # ---- validation ----------------------------------------------------------

    def _parse(self, request, context) -> tuple[object, SamplingParams, Placement]:
        prompt = list(request.prompt_token_ids) or request.prompt
        if not prompt:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty: send text or token ids")
        if request.resume_token_ids:  # another worker generated these; continue after them
            if isinstance(prompt, str):
                prompt = list(self.engine.tokenizer.encode(prompt))
            prompt = prompt + list(request.resume_token_ids)
        if not 1 <= request.max_tokens <= self.max_tokens_limit:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_tokens must be between 1 and {self.max_tokens_limit}, got {request.max_tokens}",
            )
        bad = [a for a in request.placement if not _ADDRESS.match(a) or not 0 < int(_ADDRESS.match(a).group(2)) < 65536]
        if bad:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"placement addresses must be host:port, got {bad[:3]}")
        try:
            params = SamplingParams(
                max_new_tokens=request.max_tokens,
                temperature=request.temperature,
                top_k=request.top_k,
                top_p=request.top_p if request.top_p > 0 else 1.0,
                seed=request.seed if request.HasField("seed") else None,
                stop=tuple(request.stop),
                stop_token_ids=tuple(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
            )
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return prompt, params, Placement(list(dict.fromkeys(request.placement)))


def _abort(context, code: grpc.StatusCode, message: str):
    serving.abort(context, code, message, log)


def handler(service: WorkerService) -> grpc.GenericRpcHandler:
    parse, serialize = serving.parser_for, serving.serialize
    methods = {
        "Generate": grpc.unary_stream_rpc_method_handler(service.generate, parse(pb.GenerateRequest), serialize),
        "Info": grpc.unary_unary_rpc_method_handler(service.info, parse(pb.WorkerInfoRequest), serialize),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
