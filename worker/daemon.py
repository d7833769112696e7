"""`kvcache worker`: serve a model over gRPC, with kvnodes as a remote KV tier.

SIGTERM or Ctrl-C drains: stop taking requests and beating to coordinators, health
NOT_SERVING, let running requests finish within --drain-timeout seconds, hand the rest
back (UNAVAILABLE: coordinators resume them elsewhere), write back pending pages, stop the
engine's loop, the KV connector's and the remote tier's threads (each wait bounded), exit 0.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

from base import member, observability, security, serving, startup, tokens
from base.pages import DEFAULT_PAGE_TOKENS, KV_DTYPES
from base.pool_sizes import (MAX_WORKER_POOL_BYTES, MIN_POOL_BYTES, describe, full_context_pages, prompt_cap,
                             worker_pool)
from base.units import format_size, parse_size
from protos import kvcache_pb2 as pb
from worker.engine.engine import Engine
from worker.metrics import WorkerMetrics
from worker.model import blas, load_model
from worker.observe import ObservedRemoteTier, attach
from worker.remote.tier import RemoteTier
from worker.engine.scheduler import ALONE_PREFILL_TOKENS, PREFILL_TOKENS_PER_STEP
from worker.service import (DEFAULT_MAX_STREAMS, DEFAULT_STEP_TIMEOUT_S, SERVICE_NAME, TRACE_ROOTS, WorkerService,
                            handler)
from worker.step_log import StepLog

log = logging.getLogger("worker")

CONTROL_THREADS = 8  # gRPC threads beyond --max-streams: health and Info never wait behind streams
LOOP_STOP_WAIT_S = 10.0  # on stop, how long the engine's loop gets to leave its step (--step-timeout if shorter)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serving.add_listen_arguments(parser, default_port=50061)
    parser.add_argument("--model", default="tiny", help="tiny, gpt2-small-shape, or a Hugging Face checkpoint folder")
    parser.add_argument(
        "--kv-dtype", choices=KV_DTYPES, default="float32",
        help="KV dtype of the local pool and on the wire (default float32; float16 fits twice the pages, "
             "int8 1.9x float16's, int4 3x: quantized as computed, docs/benchmarks.md says at what cost)"
    )
    parser.add_argument(
        "--kv-cache", default=None, metavar="SIZE",
        help="memory for the local paged KV pool, written at start (default: one sequence of the model's full "
             f"context, at least {describe(MIN_POOL_BYTES)} and at most {describe(MAX_WORKER_POOL_BYTES)}: "
             "360MiB for smollm2-135m in float32; the start line says the size and the longest prompt it takes)",
    )
    parser.add_argument("--page-tokens", type=int, default=DEFAULT_PAGE_TOKENS,
                        help=f"tokens per page (default {DEFAULT_PAGE_TOKENS})")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="most requests decoding at once (default 32)")
    parser.add_argument(
        "--max-batched-tokens", type=int, default=1024,
        help="tokens per step at most, decodes and the prefill chunk together (default 1024)",
    )
    parser.add_argument(
        "--max-prefill-tokens", type=int, default=PREFILL_TOKENS_PER_STEP,
        help="prompt tokens at most in a step that has decodes: longer prompts are computed in chunks of "
             "this size, so decoding requests and one arriving meanwhile wait one chunk, not a whole prompt "
             "(default %(default)s)",
    )
    parser.add_argument(
        "--alone-prefill-tokens", type=int, default=ALONE_PREFILL_TOKENS,
        help="prompt tokens at most in a step that has no decode, so no running request waits on it: a "
             "prompt alone is computed in these larger, faster chunks (default %(default)s; at least "
             "--max-prefill-tokens)",
    )
    parser.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    parser.add_argument("--lease-ms", type=int, default=2000, help="how long kvnodes hold looked-up pages for the fetch")
    parser.add_argument("--layerwise-fill", action=argparse.BooleanOptionalAction, default=False,
                        help="fetch a request's remote pages layer by layer and compute each layer of its suffix "
                             "as soon as that layer landed (issue 19; off by default: it pays only with a core "
                             "to spare, see docs/benchmarks.md)")
    parser.add_argument("--read-in-place", action=argparse.BooleanOptionalAction, default=True,
                        help="read a request's fetched pages where they lie in the shared pool of a kvnode on this "
                             "host for its first step, and copy them into its blocks after its first token "
                             "(default on; needs the node's shared pool and --kv-dtype as the pages')")
    parser.add_argument("--invariant-numerics", action=argparse.BooleanOptionalAction, default=True,
                        help="a token's logits and K/V bit-identical whatever its batch, chunking or cache "
                             "(worker/model/invariant.py; default on). Off: the BLAS's own fastest kernels, whose "
                             "last bits depend on the batch")
    parser.add_argument("--worker-id", default=None, help="name shown in Info and logs (default: random)")
    parser.add_argument(
        "--blas-threads", type=int, default=None,
        help="most BLAS threads for the model's matmuls (default: one per core); give cores / workers "
             "when several workers share a machine",
    )
    parser.add_argument(
        "--step-log", metavar="FILE", default=None,
        help="append one JSON line per engine step to FILE (its requests and tokens, scheduling and forward "
             "ms): where each request's time goes",
    )
    parser.add_argument(
        "--max-streams", type=int, default=DEFAULT_MAX_STREAMS,
        help="most Generate calls served at once (running and waiting); one more is refused with "
             "RESOURCE_EXHAUSTED so a coordinator tries another worker (default %(default)s)",
    )
    parser.add_argument(
        "--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
        help="seconds one engine step may take before the worker declares itself broken: health NOT_SERVING, "
             "no more beats, its requests ended with UNAVAILABLE to resume elsewhere (default %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout", "--grace", dest="drain_timeout", type=float, default=30.0,
        help="on SIGTERM, seconds running requests get to finish before they are handed back to resume "
             "elsewhere (default %(default)s)",
    )
    member.add_arguments(parser)
    security.add_arguments(parser)
    tokens.add_arguments(parser)
    observability.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    startup.log_to_stderr()
    try:
        kv_cache_bytes = parse_size(args.kv_cache) if args.kv_cache is not None else None
        if args.page_tokens < 1:
            raise ValueError(f"--page-tokens must be at least 1, got {args.page_tokens}")
        if args.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be at least 1, got {args.max_prefill_tokens}")
        if args.alone_prefill_tokens < 1:
            raise ValueError(f"--alone-prefill-tokens must be at least 1, got {args.alone_prefill_tokens}")
        if args.max_streams < 1:
            raise ValueError(f"--max-streams must be at least 1, got {args.max_streams}")
        if not args.step_timeout > 0 or args.drain_timeout < 0:
            raise ValueError(f"--step-timeout must be positive and --drain-timeout not negative, got "
                             f"{args.step_timeout} and {args.drain_timeout}")
        if args.blas_threads is not None:
            if args.blas_threads < 1:
                raise ValueError(f"--blas-threads must be at least 1, got {args.blas_threads}")
            blas.cap_threads(args.blas_threads)
            log.info("BLAS capped at %d thread(s)", args.blas_threads)
        member.advertised_address(args, args.port)  # refused before the model loads
        credentials = security.from_args(args)
        client_tokens = tokens.from_args(args)  # the coordinators' file: they send their caller's token on
        step_log = None
        if args.step_log:  # opened before the model loads: a bad path is refused in a moment, not after seconds
            try:
                step_log = StepLog(args.step_log)
            except OSError as exc:
                raise OSError(f"--step-log {args.step_log}: {exc.strerror or exc}") from None
        serving.tune_allocator()
        model = load_model(args.model, invariant=args.invariant_numerics)
        if kv_cache_bytes is None:  # sized to the model (base/pool_sizes.py)
            kv_cache_bytes = worker_pool(model.page_bytes(args.kv_dtype, args.page_tokens),
                                         model.config.max_positions, args.page_tokens).bytes
        engine = Engine(
            model,
            kv_dtype=args.kv_dtype,
            page_tokens=args.page_tokens,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
            max_prefill_tokens=args.max_prefill_tokens,
            alone_prefill_tokens=args.alone_prefill_tokens,
        )
        log.info("numerics: %s", "invariant (a token's bits do not depend on its batch)" if engine.model.invariant
                 else "fast (a token's last bits depend on its batch and chunking)")
        tracing = observability.setup_tracing(args, "kvcache-worker")
        observed = tracing or args.metrics_port is not None
        if observed:
            tier = ObservedRemoteTier(engine.kv_pool, args.kv_dtype, lease_ms=args.lease_ms, tracing=tracing,
                                      credentials=credentials, layerwise_fill=args.layerwise_fill,
                                      read_in_place=args.read_in_place)
        else:
            tier = RemoteTier(engine.kv_pool, args.kv_dtype, lease_ms=args.lease_ms, credentials=credentials,
                              layerwise_fill=args.layerwise_fill, read_in_place=args.read_in_place)
        engine.attach_remote_tier(tier)
        if step_log is not None:
            engine.on_step = step_log.write
            log.info("logging every engine step to %s", args.step_log)
        broken = threading.Event()
        service = WorkerService(engine, args.worker_id, args.max_tokens_limit, args.max_streams, args.step_timeout,
                                on_broken=lambda reason: broken.set(), tokens=client_tokens)
        metrics = WorkerMetrics(engine, tier) if args.metrics_port is not None else None
        if observed:
            attach(service, tier, metrics, tracing)
        # Threads for every stream, plus a few that health checks and Info always find free (WorkerService.generate).
        server, health = serving.make_server(
            [handler(service)], [SERVICE_NAME], max_workers=args.max_streams + CONTROL_THREADS,
            interceptors=tokens.interceptors(client_tokens)
            + observability.server_interceptors(SERVICE_NAME, metrics and metrics.request_duration, TRACE_ROOTS))
        port = serving.bind(server, args.host, args.port, credentials)
        address = member.advertised_address(args, port)
        metrics_server = (observability.start_metrics(metrics.registry, args, credentials)
                          if metrics is not None else None)
    except (ValueError, OSError, MemoryError) as exc:
        return startup.refuse("worker", exc)

    stopping = startup.answer_signals(args.host, credentials, log)
    service.start()
    server.start()
    serving.freeze_startup_objects()
    page_bytes = engine.model.page_bytes(args.kv_dtype, args.page_tokens)
    print(
        f"worker {service.worker_id} listening on {serving.host_port(args.host, port)} (model {engine.model.name}, "
        f"{args.kv_dtype} KV, pages of {page_bytes} bytes, {engine.pool.num_blocks} blocks, "
        f"{format_size(engine.pool.num_blocks * page_bytes)}: {pool_says(engine, args)})",
        flush=True,
    )
    registration = pb.RegisterRequest(
        role="worker", page_bytes=page_bytes, model=engine.model.name, fingerprint=engine.fingerprint.hex()
    )
    membership = member.start_from_args(args, address, registration, lambda: worker_load(engine), credentials)
    while not stopping.wait(0.5) and not broken.is_set():
        pass
    service.accepting = False
    if membership is not None:
        membership.stop()  # coordinators stop routing here within a few beats
    health.enter_graceful_shutdown()
    if broken.is_set():
        # The engine cannot serve (its loop died or stalled): calls end UNAVAILABLE and resume
        # elsewhere; the daemon stays up, NOT_SERVING, for its operator to look at, until stopped.
        serving.wait_until(stopping)
    else:
        drain(service, args.drain_timeout)
    if not tier.flush(timeout_s=10.0):
        log.warning("some pages were not written back to kvnodes within 10s")
    serving.stop(server, health, grace_s=1.0)
    # The loop gets 10 s to leave its step, or --step-timeout when shorter: a step that outlasts
    # that is stalled by this worker's own measure, and waiting on only delays its restart.
    loop_wait_s = min(LOOP_STOP_WAIT_S, args.step_timeout)
    if not service.stop(timeout_s=loop_wait_s):
        # Closing the tier would unmap the node pools' windows a step may still read (a crash):
        # exit instead; the nodes let go of the pages when its connections close.
        log.warning("the engine's loop is still inside a step after %gs; exiting without closing the remote tier",
                    loop_wait_s)
    else:
        if engine.connector is not None:
            engine.connector.close(wait_s=5.0)  # before the tier: its lookups and loads use the tier's clients
        tier.close()
    if metrics_server is not None:
        metrics_server.stop()
    if step_log is not None:
        step_log.close()
    left = own_threads_alive()
    if left:
        log.warning("threads still running at exit (they end with their calls' deadlines): %s", ", ".join(left))
    log.info("stopped")
    return 0


def pool_says(engine: Engine, args: argparse.Namespace) -> str:
    """The longest prompt the pool takes, and when it is below the model's, what raises it."""
    max_positions = engine.model.config.max_positions
    says = prompt_cap(engine.pool.num_blocks * args.page_tokens, max_positions)
    if engine.pool.num_blocks * args.page_tokens >= max_positions:
        return says
    full_bytes = full_context_pages(max_positions, args.page_tokens) * engine.model.page_bytes(args.kv_dtype,
                                                                                                args.page_tokens)
    cap = ("" if args.kv_cache is not None
           else f", the default's cap of {describe(MAX_WORKER_POOL_BYTES)}")
    return f"{says}{cap}; --kv-cache {describe(full_bytes)} holds a full context"


OWN_THREADS = ("engine-", "kv-", "membership")  # name prefixes of the threads the worker starts


def own_threads_alive() -> list[str]:
    """The worker's own threads still running; a clean stop leaves none."""
    return sorted(t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(OWN_THREADS))


def drain(service: WorkerService, timeout_s: float) -> None:
    """Give running requests timeout_s seconds; hand the rest back to resume elsewhere."""
    engine = service.engine
    log.info("draining: %d requests running, waiting up to %.1fs", engine.num_running() + engine.num_waiting(),
             timeout_s)
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = len(engine.live_request_ids())
    if not left:
        log.info("drained: every request finished")
        return
    service.hand_back(f"stopped: its drain timeout of {timeout_s:.1f}s ran out")
    deadline = time.monotonic() + 3.0  # each call sees it within a second and cancels its request
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    for request_id in engine.live_request_ids():  # calls already gone: nobody waits for these
        engine.abort(request_id)
    log.info("drain timeout: handed %d requests back to resume elsewhere", left)


def worker_load(engine: Engine) -> pb.MemberLoad:
    return pb.MemberLoad(
        running=engine.num_running(), waiting=engine.num_waiting(),
        free_blocks=engine.get_num_free_blocks(), total_blocks=engine.pool.num_blocks,
    )
