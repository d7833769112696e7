"""`kvcache gateway`: an OpenAI-compatible HTTP API in front of the coordinators.

Serves GET /v1/models, POST /v1/completions and /v1/chat/completions (stream: true sends
server-sent events ending in `data: [DONE]`), vLLM's POST /tokenize, POST /detokenize and GET
/tokenizer_info, GET /health, and with --metrics GET /metrics, on uvicorn. In front of a secure
cluster (--tls-*), /metrics wants a key the coordinators know (`Authorization: Bearer KEY`), as
the OpenAI routes do. With --tls-cert and --tls-key it serves HTTPS only, with that certificate
(`kvcache cluster up --secure` gives it the run directory's tls/gateway.pem), answering a plain
HTTP request 400, and presents it to the coordinators; with --tls-ca alone it serves plain HTTP
and reaches the coordinators over TLS without a certificate. Prints `gateway listening on http(s)://HOST:PORT` once it serves; stops on
SIGTERM, giving running requests --grace seconds."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

from base import addresses, observability, security, serving, startup
from base.addresses import DEFAULT_COORDINATORS
from base.units import parse_size

log = logging.getLogger("gateway")

DEFAULT_MAX_STREAMS = 64
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_SEND_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serving.add_listen_arguments(parser, default_port=8000, reached=True)
    parser.add_argument("--coordinators", default=None,
                        help="coordinator addresses, tried in turn: A,B (default $KVCACHE_COORDINATORS, else the "
                             "cluster `kvcache cluster up` started in this folder, ./.kvcache/cluster.json, with its "
                             "client certificate when it runs --secure and its model's tokenizer, else "
                             f"{DEFAULT_COORDINATORS})")
    parser.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS,
                        help=f"requests served at once; one more is answered 429 (default {DEFAULT_MAX_STREAMS})")
    parser.add_argument("--max-body-bytes", default=str(DEFAULT_MAX_BODY_BYTES),
                        help="largest request body; a larger one is answered 413 (default 4MiB)")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help="seconds a request's head may take to arrive (then its connection is closed), and "
                             f"its body (then 408) (default {DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds one generation may take on the cluster (default 600)")
    parser.add_argument("--tokenizer", action="append", default=[], metavar="MODEL",
                        help="a model the workers run, as their --model names it (a GGUF file or folder): "
                             "/tokenize, /detokenize, /tokenizer_info and continuous usage stats load its tokenizer "
                             "from there; repeatable. Presets and named models need none (default: none)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds running requests get on stop (default 5)")
    parser.add_argument("--send-timeout", type=float, default=DEFAULT_SEND_TIMEOUT_S,
                        help="seconds a client may take nothing the gateway sends it (it stopped reading, or is "
                             "gone without a word) before its connection is dropped and its request cancelled on "
                             f"its worker; Linux's TCP_USER_TIMEOUT (default {DEFAULT_SEND_TIMEOUT_S:g})")
    # A secure cluster: the gateway reaches the coordinators over TLS (its certificate, when given,
    # presented), and each caller's `Authorization: Bearer KEY` goes on with its calls.
    security.add_arguments(parser, client=True, cert_help=(
        "the gateway's certificate (PEM) of the cluster's CA, with --tls-key: it then serves HTTPS only, with "
        "this certificate (which must name the host its clients reach it at), and presents it to the "
        "coordinators; without, it serves plain HTTP (default)"))
    parser.add_argument("--metrics", action="store_true",
                        help="serve Prometheus metrics at /metrics on the gateway's own port (default: off)")
    observability.add_tracing_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: every `kvcache` command builds this parser, and only this one needs them.
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from coordinator.aio_client import AsyncClient
    from gateway.app import create_app
    from gateway.connections import LimitedWarnings, guarded
    from gateway.tokenizers import Tokenizers
    from gateway.upstream import Upstream

    startup.log_to_stderr()
    logging.getLogger("uvicorn.error").addFilter(LimitedWarnings())
    try:
        coordinators = _addresses(args.coordinators)
        max_body_bytes = parse_size(args.max_body_bytes)
        for name in ("max_streams", "body_timeout", "request_timeout", "send_timeout"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        credentials = security.from_args(args, client=True)  # checks the TLS options come together
        https = credentials is not None and credentials.cert is not None
        server_tls = credentials.https_context if https else None
        sock = _listen(args.host, args.port, args.send_timeout)
        host, port = sock.getsockname()[:2]
        reached = addresses.reached_at(host, port, args.advertise)
        observability.setup_tracing(args, "kvcache-gateway")
    except (ValueError, OSError) as exc:
        return startup.refuse("gateway", exc)
    url = f"{'https' if https else 'http'}://{addresses.host_port(host, port)}"
    metrics = None
    if args.metrics:
        from gateway.metrics import GatewayMetrics

        metrics = GatewayMetrics()

    def started() -> None:
        if metrics is not None:
            log.info("metrics on %s/metrics", url)
        api = f"{url.split('://')[0]}://{reached}/v1" if args.advertise else f"{url}/v1"
        print(f"gateway listening on {url} (OpenAI API at {api}, coordinators {','.join(coordinators)}, "
              f"up to {args.max_streams} requests)", flush=True)

    tls = {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key} if credentials else {}
    upstream = Upstream(lambda: AsyncClient(coordinators, timeout=args.request_timeout, **tls), args.max_streams)
    if metrics is not None:
        metrics.watch(upstream)
    app = create_app(upstream, max_body_bytes, args.body_timeout, on_startup=started, metrics=metrics,
                     metrics_need_key=credentials is not None, tokenizers=Tokenizers(args.tokenizer))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=args.grace,
                            # Connections beyond this get 503 from uvicorn before any work is done.
                            limit_concurrency=args.max_streams * 2 + 16,
                            # Request heads bounded in time; HTTPS started by the guard, which answers a
                            # plain HTTP request 400 (gateway/connections.py).
                            http=guarded(AutoHTTPProtocol, args.body_timeout, server_tls))
    # uvicorn raises the signal that stopped it again once it has shut down; with the default
    # action that killed the gateway (exit 143, no last line). This handler turns it, or a stop
    # that comes before uvicorn has installed its own, into SystemExit, so a stop ends like every
    # daemon's: one "stopped" line, exit 0.
    def stop(signum, frame):
        raise SystemExit(0)

    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, stop)
    if https:   # the HTTPS certificate for new connections; those to the coordinators keep theirs
        security.reload_on_sighup(credentials)
    try:
        serving.freeze_startup_objects()
        uvicorn.Server(config).run(sockets=[sock])
    except SystemExit:
        pass
    log.info("stopped")
    return 0


def _addresses(text: str | None) -> list[str]:
    text = text or os.environ.get("KVCACHE_COORDINATORS") or DEFAULT_COORDINATORS
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--coordinators names no address")
    return addresses


def _listen(host: str, port: int, send_timeout_s: float) -> socket.socket:
    """The listening socket, bound before uvicorn starts, so --port 0 can be printed.

    Its TCP_USER_TIMEOUT, which every connection accepted from it inherits, bounds how long the
    kernel keeps a connection whose peer takes nothing: sent data unacknowledged, or held back
    by a receive window closed since, for send_timeout_s. Then it drops the connection, the
    gateway sees the client gone, and the request is cancelled on its worker as for a hang-up.
    Without it, a client that opened a stream and stopped reading held its worker slot until the
    request's deadline: uvicorn waits as long as it takes for room to write, the kernel too (it
    probes a closed window forever)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it Nagle held each first event until the client's delayed ACK (~40 ms per response).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):   # Linux; elsewhere a stalled reader waits for its deadline
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(send_timeout_s * 1000)))
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {addresses.host_port(host, port)}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
