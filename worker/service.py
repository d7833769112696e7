"""The Worker gRPC service: validates requests, hands them to the engine, relays its deltas.

One loop thread steps the engine; each Generate call waits on its request's handle and relays
what arrives. A worker that cannot serve, or whose drain ran out of time, ends its calls with
UNAVAILABLE, so coordinators resume their requests on another worker with the tokens they have.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import uuid
from typing import Callable

import grpc

from base import serving
from base import version
from protos import kvcache_pb2 as pb
from protos.methods import service_name
from worker.client import DRAINING_KEY, generate_reply, usage_to_proto
from worker.engine.engine import Engine
from worker.model.chat import MAX_MESSAGES, ChatError, Message
from worker.engine.outputs import RequestIdInUse
from worker.remote.tier import Placement
from worker.engine.sampling import FINISH_ERROR, SamplingParams

log = logging.getLogger("worker")

SERVICE_NAME = service_name("Worker")
TRACE_ROOTS = ("Generate",)  # where a request's trace starts when its caller sent none (base/observability.py)
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")
MAX_PLACEMENT = 8  # kvnodes a request may name (replicas); more is refused
MAX_REQUEST_ID_CHARS = 128
MAX_PROMPT_CHARS_PER_TOKEN = 32  # a text prompt longer than this many characters a position is refused unread
DEFAULT_MAX_STREAMS = 128
DEFAULT_STEP_TIMEOUT_S = 60.0
_WAKE_S = 1.0  # a call's wait on its request wakes this often: is it still wanted, the worker serving?


class WorkerService:
    def __init__(self, engine: Engine, worker_id: str | None = None, max_tokens_limit: int = 4096,
                 max_streams: int = DEFAULT_MAX_STREAMS, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 on_broken: Callable[[str], None] | None = None, tokens=None):
        self.engine = engine
        self.tokens = tokens  # base.tokens.Tokens (--tokens-file): the caller's tenant roots its page keys
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self.max_tokens_limit = max_tokens_limit
        self.max_streams = max_streams
        self.step_timeout_s = step_timeout_s
        self.on_broken = on_broken
        self.accepting = True
        self.broken: str | None = None  # why the engine cannot serve (_break)
        self.handed_back: str | None = None  # why running requests are sent elsewhere (a drain out of time)
        self._streams = threading.BoundedSemaphore(max_streams)
        self._step_started: float | None = None  # monotonic time the running step began, None between steps
        self.metrics = None  # worker.metrics.WorkerMetrics (--metrics-port): step times
        self.spans = None  # worker.observe.RequestSpans while tracing: each request's trace context
        self._stopping = threading.Event()
        self._loop = threading.Thread(target=self._run_engine, name="engine-loop", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._loop.start()
        self._watchdog.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the engine's loop; False if it is still inside a step after `timeout_s` (stalled)."""
        self._stopping.set()
        self._loop.join(timeout=timeout_s)
        self._watchdog.join(timeout=2.0)
        return not self._loop.is_alive()

    def _run_engine(self) -> None:
        while not self._stopping.is_set() and self.broken is None:
            if not self.engine.wait_for_work(timeout=0.2):
                continue
            self._step_started = started = time.monotonic()
            try:
                self.engine.step()
            except Exception as exc:  # not pinned on any request: the engine's state is in doubt
                log.exception("engine step failed outside any request")
                self._break(f"its engine failed: {exc!r}")
            finally:
                self._step_started = None
                if self.metrics is not None:
                    self.metrics.step.observe(time.monotonic() - started)

    def _watch(self) -> None:
        """The watchdog: the worker is broken when the loop dies or one step runs past step_timeout_s."""
        while not self._stopping.wait(0.5) and self.broken is None:
            started = self._step_started
            if not self._loop.is_alive():
                self._break("its engine loop died")
            elif started is not None and time.monotonic() - started > self.step_timeout_s:
                self._break(f"an engine step has run for over {self.step_timeout_s:.0f}s")

    def _break(self, reason: str) -> None:
        """The worker cannot serve: `on_broken` runs once (the daemon turns health NOT_SERVING and stops
        beating, so coordinators stop routing here), and every call, waiting or new, ends with
        UNAVAILABLE so its request resumes elsewhere. A step failure that the engine pins on some
        requests fails only those, with INTERNAL (StepRunner._run_isolated): this is for the rest."""
        if self.broken is not None:
            return
        self.broken = reason
        log.error("worker cannot serve: %s; ending its requests with UNAVAILABLE so they resume elsewhere", reason)
        if self.on_broken is not None:
            self.on_broken(reason)

    def hand_back(self, reason: str) -> None:
        """End every call with UNAVAILABLE within a second, so its request resumes elsewhere (a drain
        that ran out of time)."""
        self.handed_back = reason

    # ---- handlers ------------------------------------------------------------

    def generate(self, request, context):
        serving.abort_if_malformed(request, context, log)
        self._check_serving(context)
        # Streams are bounded: one more is refused at once, so a coordinator tries another worker, and
        # the server keeps threads of its own for health checks and Info (the daemon sizes it so).
        if not self._streams.acquire(blocking=False):
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"this worker is serving its limit of {self.max_streams} streams: send the request to another "
                   f"worker or retry later")
        try:
            yield from self._generate(request, context)
        finally:
            self._streams.release()

    def _namespace(self, context) -> str:
        tenant = self.tokens.tenant_of(context.invocation_metadata()) if self.tokens is not None else None
        return tenant.namespace if tenant else ""

    def _generate(self, request, context):
        prompt, resumed, params, placement = self._parse(request, context)
        request_id = request.request_id or uuid.uuid4().hex[:16]
        if self.spans is not None:
            self.spans.begin(request_id, placement)
        try:
            handle = self.engine.add_request(prompt, params, request_id=request_id, tier_context=placement,
                                             bypass_cache=request.no_cache, resumed_token_ids=resumed,
                                             namespace=self._namespace(context), priority=request.priority)
        except RequestIdInUse as exc:
            _abort(context, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Runs when the call ends for any reason (the caller disconnected or cancelled too), on gRPC's one
        # event thread: it must not wait for the engine's lock, so it cancels (Engine.cancel), and the
        # engine frees the request's blocks before its next step.
        if not context.add_callback(lambda: self.engine.cancel(handle)):
            self.engine.cancel(handle)  # the call ended already: nobody will read the request's tokens
            return
        while True:
            if self.handed_back is not None or self.broken is not None:
                self._check_serving(context)
            try:
                delta = handle.queue.get(timeout=_WAKE_S)
            except queue.Empty:  # no handler thread waits forever (_WAKE_S)
                if not context.is_active():
                    return
                self._check_serving(context)
                continue
            if delta.token_ids or delta.text or delta.prompt is not None:
                yield generate_reply(delta.text, delta.token_ids, delta.logprobs, delta.prompt)
            if delta.finished:
                completion = delta.completion
                if completion.finish_reason == FINISH_ERROR:
                    _abort(context, grpc.StatusCode.INTERNAL, f"request {request_id} failed: {completion.error}")
                yield pb.GenerateReply(usage=usage_to_proto(completion.usage), finish_reason=completion.finish_reason)
                return

    def _check_serving(self, context) -> None:
        if self.broken is not None:
            _abort(context, grpc.StatusCode.UNAVAILABLE,
                   f"worker {self.worker_id} cannot serve ({self.broken}): send the request to another worker")
        if self.handed_back is not None:
            _abort(context, grpc.StatusCode.UNAVAILABLE,
                   f"worker {self.worker_id} {self.handed_back}: resume the request on another worker")
        if not self.accepting:
            context.set_trailing_metadata(((DRAINING_KEY, "1"),))  # what a coordinator checks; the message is for people
            _abort(context, grpc.StatusCode.UNAVAILABLE, "this worker is shutting down: send the request to another")

    def info(self, request, context) -> pb.WorkerInfo:
        serving.abort_if_malformed(request, context, log)
        engine = self.engine
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            version=version.installed(),
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

    def _parse(self, request, context) -> tuple[object, list[int], SamplingParams, Placement]:
        prompt = list(request.prompt_token_ids) or request.prompt
        if request.messages and prompt:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "send a prompt or chat messages, not both")
        if not prompt and not request.messages:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty: send text, token ids or messages")
        if len(request.messages) > MAX_MESSAGES:  # before anything is built from them
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"the chat has {len(request.messages)} messages; at most {MAX_MESSAGES}")
        max_chars = self.engine.max_total_tokens * MAX_PROMPT_CHARS_PER_TOKEN
        chars = sum(len(m.content) + len(m.role) for m in request.messages) if request.messages else len(request.prompt)
        if chars > max_chars:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"the prompt has {chars} characters; this worker reads at most {max_chars}")
        if request.messages:
            try:   # the worker renders the chat (a coordinator never tokenizes)
                prompt = self.engine.model.chat_token_ids([Message(m.role, m.content) for m in request.messages])
            except ChatError as exc:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"request_id has {len(request.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
        if not (0 if request.echo else 1) <= request.max_tokens <= self.max_tokens_limit:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_tokens must be between 1 and {self.max_tokens_limit} (0 with echo: the prompt alone), "
                f"got {request.max_tokens}",
            )
        if request.HasField("prompt_logprobs") and not request.echo:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   "prompt_logprobs come back with the prompt: set echo too")
        if len(request.placement) > MAX_PLACEMENT:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"placement names {len(request.placement)} kvnodes; at most {MAX_PLACEMENT}")
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
                echo=request.echo,
                logprobs=request.logprobs if request.HasField("logprobs") else None,
                prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
            )
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return prompt, list(request.resume_token_ids), params, Placement(list(dict.fromkeys(request.placement)))


def _abort(context, code: grpc.StatusCode, message: str):
    serving.abort(context, code, message, log)


def handler(service: WorkerService) -> grpc.GenericRpcHandler:
    parse, serialize = serving.parser_for, serving.serialize
    methods = {
        "Generate": grpc.unary_stream_rpc_method_handler(service.generate, parse(pb.GenerateRequest), serialize),
        "Info": grpc.unary_unary_rpc_method_handler(service.info, parse(pb.WorkerInfoRequest), serialize),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
