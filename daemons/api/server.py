"""One API-server process: aiohttp on the shared port, OpenAI-compatible endpoints.

It decodes and validates each request once, tokenizes, picks a rank, sends
one message to that engine and streams the answer back. It must never import
torch or transformers (it starts in well under a second). Lifecycle:
setup -> start sites (shared port, private probe socket) -> serve -> drain on
SIGTERM -> cleanup, exit 0.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import socket
import time
from functools import partial
from http import HTTPStatus

import zmq
import zmq.asyncio
from aiohttp import web
from dpserve.daemons.aiohttp_compat import HttpProcessingError, JsonErrorRunner
from dpserve.daemons.api.endpoints import OpenAIServing
from dpserve.daemons.api.engine_client import EngineClient
from dpserve.daemons.api.http_limits import ConnectionGuard, connection_limits
from dpserve.daemons.api.metrics import ApiMetrics
from dpserve.daemons.api.openai_types import ApiError, encode, error_body
from dpserve.daemons.api.openapi import BUDGETS_400, build_openapi
from dpserve.daemons.api.router import Router
from dpserve.daemons.api.serving import auth_middleware
from dpserve.daemons.api.tenants.service import TenantService
from dpserve.daemons.api.tokenizer import TextTokenizer
from dpserve.daemons.config import ApiServerConfig
from dpserve.engine.common.auth import CurveKeys, start_authenticator
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.logs import setup_logging
from dpserve.engine.common.procutil import (
    EXIT_OK,
    EXIT_STARTUP,
    SupervisorLink,
    child_config_from_env,
    die_with_parent,
    set_process_name,
)
from dpserve.engine.common.protocol import ApiServerRegister, GreetAgain, PrefixRouted
from dpserve.engine.common.sockets import make_socket


def _package_version() -> str:
    """/version and the OpenAPI document report the installed package, never a constant."""
    try:
        return importlib.metadata.version("dpserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "0+unknown"


VERSION = _package_version()
FAULT_STARTUP_DELAY_ENV = "DPSERVE_FAULT_API_STARTUP_DELAY_S"
_ACCEPTED_GRACE_S = 0.25
PREFIX_FLUSH_S = 0.005  # cache-aware: routed prefixes reach the other API servers this late at most

CFG = web.AppKey("cfg", ApiServerConfig)
SERVING = web.AppKey("serving", OpenAIServing)
LOG = web.AppKey("log", object)


def _json(body: bytes, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def error_response(err: ApiError) -> web.Response:
    return _json(error_body(err), err.status, err.headers)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error leaves as an OpenAI-style JSON body, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_http_error(exc.status, request, exc))
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        # A body aiohttp could not read (Content-Encoding: gzip on a body that is not,
        # broken chunking): the connection's stream is broken, so answer and close it.
        # Marking the body read stops aiohttp from reading it again after the answer,
        # which would raise once more and log a traceback at error level.
        cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) else exc
        detail = cause.message if isinstance(cause, HttpProcessingError) else str(exc)
        request.content.feed_eof()
        resp = error_response(ApiError(400, f"Could not read the request body: {' '.join(str(detail).split())}"))
        resp.force_close()
        return resp
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        request.app[LOG].exception("unexpected error", path=request.path)
        return error_response(ApiError(500, f"Internal server error: {type(exc).__name__}", type="server_error"))


async def expect_handler(request: web.Request) -> web.Response | None:
    """`Expect: 100-continue` is answered as aiohttp does; any other expectation gets an
    OpenAI-style JSON 417 (aiohttp's own is text/plain) before the body is read."""
    expect = request.headers.get("Expect", "")
    if expect.strip().lower() == "100-continue":
        if request.version == (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the 100 is no part of the answer's size
        return None
    resp = error_response(_expectation_failed(request))
    resp.force_close()  # the body, if any, was never read
    return resp


def _expectation_failed(request: web.BaseRequest) -> ApiError:
    shown = " ".join(request.headers.get("Expect", "").split())[:100]
    return ApiError(417, f"Unsupported Expect header {shown!r}: only 100-continue is supported.", param="Expect", code="expectation_failed")


async def json_417(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: aiohttp's own text/plain 417, made where no route's expect_handler
    runs (a path no route serves), leaves as the same JSON as expect_handler's."""
    if response.status == 417 and response.content_type == "text/plain" and isinstance(response, web.Response):
        response.body = error_body(_expectation_failed(request))
        response.content_type = "application/json"
        response.headers["Content-Length"] = str(len(response.body))


def _http_error(status: int, request: web.BaseRequest, exc: BaseException | None = None, message: str | None = None) -> ApiError:
    """An aiohttp-made error (routing, limits, protocol) as an ApiError; 405 keeps its Allow header."""
    path = request.path[:200]
    headers = None
    if status == 404:
        message = f"No route for {request.method} {path}."
    elif status == 405 and isinstance(exc, web.HTTPException):
        allow = exc.headers.get("Allow", "")
        headers = {"Allow": allow}
        message = f"Method {request.method} is not allowed for {path}; allowed: {allow}."
    elif isinstance(exc, HttpProcessingError) and exc.message:
        message = f"Bad request: {exc.message}"
    elif isinstance(exc, web.HTTPException):
        message = exc.reason
    if not message:
        try:
            message = HTTPStatus(status).phrase
        except ValueError:
            message = "Error"
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ApiError(status, message, type=kind, headers=headers)


def _protocol_error_response(request: web.BaseRequest, status: int, exc: BaseException | None, message: str | None) -> web.Response:
    return error_response(_http_error(status, request, exc, message))


class ApiAppRunner(JsonErrorRunner):
    """An AppRunner whose connections answer protocol errors (bad request line, too many
    headers, no Host, handler timeout) in OpenAI-style JSON like every other error, and
    pass through a ConnectionGuard, whatever public site serves them."""

    def __init__(self, app: web.Application, guard: ConnectionGuard | None = None, **kwargs) -> None:
        super().__init__(app, _protocol_error_response, guard.adopt if guard is not None else None, **kwargs)


class ApiServer:
    """Owns the process: sockets, app, serving state, and the drain on shutdown."""

    def __init__(self, cfg: ApiServerConfig, log) -> None:
        self.cfg = cfg
        self.log = log
        self.zctx = zmq.asyncio.Context()
        self.supervisor = SupervisorLink(self.zctx, cfg.supervisor_address, cfg.name)
        self.tokenizer = TextTokenizer.from_dir(cfg.model_dir)
        self.router = Router(cfg.data_parallel_size, cfg.lb_policy, cfg.max_waiting_per_rank, cfg.eligible_ranks, kv_events=cfg.kv_events)
        self.keys = CurveKeys.from_file(cfg.key_file, log) if cfg.key_file else None
        self.auth = start_authenticator(self.zctx, self.keys, log)
        self.client = EngineClient(
            self.zctx, self.router, cfg.engine_address, cfg.table_address, log, self.keys, cfg.request_first_token_timeout_s,
            cfg.max_migrations, cfg.migrate_pinned, cfg.wait_for_engine_s
        )
        self.client.peers.greet_again = self._greet_again
        # Tell the coordinator (maybe on another node) where engines reach us, every
        # second, so a restarted coordinator relearns it without anyone's help.
        self.coordinator = make_socket(self.zctx, zmq.DEALER, self.keys, connect=cfg.coordinator_address, sndhwm=10)
        incarnation = os.urandom(6).hex()
        self._register = Codec(ApiServerRegister).encode(ApiServerRegister(cfg.node_rank, cfg.index, cfg.engine_address, incarnation))
        # cache-aware routing: what this API server routes, every other one learns (and back)
        self._routed: list[tuple[int, list[int]]] = []
        self._routed_codec = Codec(PrefixRouted)
        self._greet_codec = Codec(GreetAgain)
        if self.router.prefix is not None:
            self.router.origin = incarnation
            self.router.on_routed = self._prefix_routed
        self.metrics = ApiMetrics(cfg, self.router)
        # tenants (--api-key-file as TOML): keys, limits held across the cluster, per-tenant metrics
        self.tenants = TenantService(cfg, log, self.coordinator, self.metrics.registry, incarnation) if cfg.tenants_file else None
        self.client.on_step = self.metrics.vllm.step
        self.serving = OpenAIServing(cfg, self.tokenizer, self.client, self.metrics, log)
        if self.tenants is not None:  # the others' usage, and the cluster's shares for admission (issue 28)
            self.client.on_tenants, self.tenants.sync.admission = self.tenants.sync.apply, self.serving.admission
        self.stop_event = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.probe_runner: web.AppRunner | None = None
        self.port_site: web.BaseSite | None = None
        cap, ceiling = connection_limits(cfg.http_max_connections)
        if cap < cfg.http_max_connections:
            log.warning("connection cap lowered to fit the open-file limit", requested=cfg.http_max_connections, cap=cap)
        busy = ApiError(503, "This server has too many open connections; retry shortly.", type="service_unavailable", code="too_many_connections")
        self.guard = ConnectionGuard(cap, ceiling, error_body(busy), log)
        self._openapi: bytes | None = None  # built on first ask

    def build_app(self) -> web.Application:
        auth = auth_middleware(self.cfg.api_key, self.tenants.gate if self.tenants is not None else None)
        middlewares = [openai_errors] if auth is None else [openai_errors, auth]
        app = web.Application(client_max_size=self.cfg.max_request_body_bytes, middlewares=middlewares)
        app.on_response_prepare.append(json_417)
        app[CFG] = self.cfg
        app[SERVING] = self.serving
        app[LOG] = self.log
        s = self.serving
        post = partial(app.router.add_post, expect_handler=expect_handler)
        get = partial(app.router.add_get, expect_handler=expect_handler)
        post("/v1/completions", s.completions)
        post("/v1/chat/completions", s.chat_completions)
        get("/v1/models", s.models)
        post("/tokenize", s.tokenize_endpoint)
        post("/detokenize", s.detokenize_endpoint)
        if self.cfg.enable_tokenizer_info_endpoint:
            get("/tokenizer_info", s.tokenizer_info)
        get("/load", s.load)
        post("/invocations", s.invocations)
        post("/v1/chat/completions/batch", s.chat_batch)
        get("/health", self.health)
        get("/readyz", self.readyz)
        get("/ready", self.readyz)
        get("/version", self.version)
        get("/metrics", self.metrics.handler)
        get("/openapi.json", self.openapi)
        return app

    # ---------------------------------------------------------------- probes

    def build_probe_app(self) -> web.Application:
        """The supervisor's private socket: liveness and readiness, apart from the port's
        limits and from the port's /health, which answers whether requests can be served."""
        app = web.Application()
        app.router.add_get("/health", self.liveness)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/ready", self.readyz)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics.handler)
        return app

    async def liveness(self, request: web.Request) -> web.Response:
        # Answered by the event loop that serves requests: if it answers, it lives.
        return _json(b'{"status":"ok"}')

    async def health(self, request: web.Request) -> web.Response:
        # As vLLM's /health: 200 only while a request sent now can be served.
        if self.serving.draining:
            return _json(b'{"status":"draining"}', 503)
        if not self.router.num_routable:  # O(1): a load balancer asks often
            return _json(b'{"status":"no engine rank is ready"}', 503)
        return _json(b'{"status":"ok"}')

    async def readyz(self, request: web.Request) -> web.Response:
        ranks = self.router.routable_ranks
        body = {"routable_ranks": ranks, "eligible_ranks": self.router.eligible, "alive_ranks": self.router.alive_ranks,
                "unroutable_ranks": self.client.peers.unroutable_ranks(time.monotonic())}
        if self.serving.draining:
            return _json(encode({"status": "draining", **body}), 503)
        if not ranks:
            return _json(encode({"status": "no routable rank", **body}), 503)
        return _json(encode({"status": "ready", **body}))

    async def version(self, request: web.Request) -> web.Response:
        return _json(encode({"version": VERSION}))

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            s = self.serving
            limits = {field: getattr(self.cfg, field) for field, _, _ in BUDGETS_400 if hasattr(self.cfg, field)}
            doc = build_openapi(s.model_name, s.vocab_size, s.max_model_len, api_key=bool(self.cfg.api_key or self.cfg.tenants_file), version=VERSION, limits=limits,
                                tokenizer_info=self.cfg.enable_tokenizer_info_endpoint)
            self._openapi = encode(doc)
        return _json(self._openapi)

    # ---------------------------------------------------------------- lifecycle

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        if self.tenants is not None:  # SIGHUP: read the key file again (a supervisor's SIGHUP restarts us instead)
            loop.add_signal_handler(signal.SIGHUP, self.tenants.on_signal)
            self.tenants.start()
        self.client.start()
        await self.coordinator.send(self._register)
        # keepalive_timeout bounds the wait for a request's headers, on a new connection
        # and between keep-alive requests alike (aiohttp closes a connection idle that
        # long, counted from its start or its last response, partial headers or not).
        self.runner = ApiAppRunner(
            self.build_app(), self.guard, access_log=None, handler_cancellation=True, shutdown_timeout=1.0, keepalive_timeout=self.cfg.http_idle_timeout_s
        )
        await self.runner.setup()
        self.probe_runner = web.AppRunner(self.build_probe_app(), access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self.probe_runner.setup()
        sock = socket.socket(fileno=self.cfg.listen_fd)
        sock.setblocking(False)
        self.port_site = web.SockSite(self.runner, sock)
        probe_site = web.UnixSite(self.probe_runner, self.cfg.probe_path)
        try:
            if os.path.exists(self.cfg.probe_path):
                os.unlink(self.cfg.probe_path)
            await probe_site.start()
            await self._wait_for_routes()
            await self.port_site.start()
        except OSError as exc:
            self.log.error("could not start serving", error=str(exc))
            return EXIT_STARTUP
        delay = float(os.environ.get(FAULT_STARTUP_DELAY_ENV, "0") or 0)
        if delay > 0:  # fault injection for the startup-timeout tests
            self.log.warning("delaying readiness on purpose", env=FAULT_STARTUP_DELAY_ENV, seconds=delay)
            await asyncio.sleep(delay)
        self.supervisor.ready(f"api server {self.cfg.index}")
        self.log.info("api server ready", pid=os.getpid())
        heartbeat = asyncio.create_task(self._heartbeat())
        await self.stop_event.wait()
        heartbeat.cancel()
        await self.drain()
        if self.tenants is not None:
            self.tenants.stop()
        self.metrics.vllm.save()
        await self.runner.cleanup()
        await self.probe_runner.cleanup()
        await self.client.close()
        self.coordinator.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.zctx.destroy(linger=0)
        self.log.info("api server stopped")
        return EXIT_OK

    async def _wait_for_routes(self, timeout: float = 10.0) -> None:
        """Accept on the shared port only once this process can route what it accepts.

        A replacement API server (restart, SIGHUP) must not take connections from
        its healthy siblings only to answer 503 while engines still say hello.
        When the table shows no live rank at all (the node is starting), waiting
        would gain nothing, so it starts at once.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.routable_ranks:
                return
            if self.client.table_received.is_set() and not self.router.alive_ranks:
                return
            await asyncio.sleep(0.01)
        self.log.warning("no routable rank yet; accepting anyway", waited_s=timeout)

    def _prefix_routed(self, rank: int, keys: list[int]) -> None:
        """Batch this API server's routed prefixes for the others, sent within PREFIX_FLUSH_S."""
        if not self._routed:
            asyncio.get_running_loop().call_later(PREFIX_FLUSH_S, self._flush_routed)
        self._routed.append((rank, keys))

    def _flush_routed(self) -> None:
        routed, self._routed = self._routed, []
        try:
            self.coordinator.send(self._routed_codec.encode(PrefixRouted(self.router.origin, routed)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the coordinator is away: the others miss these, routing stays correct, only less sticky

    def _greet_again(self, rank: int, reason: str) -> None:
        """Ask `rank`, through the coordinator, to reconnect to us and say hello. A plea that
        cannot leave (the coordinator is away) is dropped: the next heal round pleads again."""
        sent = self.coordinator.send(self._greet_codec.encode(GreetAgain(rank, self.cfg.engine_address, reason)), zmq.NOBLOCK)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, so asyncio never logs it

    async def _heartbeat(self) -> None:
        while True:
            self.supervisor.heartbeat(len(self.client.requests))
            self.metrics.vllm.save()  # vLLM's request metrics, for the node's other API servers' scrapes
            self.client.probe_idle()
            self.client.peers.heal(time.monotonic())
            try:
                await self.coordinator.send(self._register, zmq.NOBLOCK)
            except zmq.Again:
                pass
            await asyncio.sleep(1.0)

    async def drain(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then return."""
        self.serving.draining = True
        self.client.notify_routes()  # requests waiting for a rank fail now
        if self.port_site is not None:
            await self.port_site.stop()
        # Connections accepted just before the stop may not have sent their request
        # yet; closing them now would break a client mid-write (seen in the reload
        # test as a broken pipe). aiohttp's own graceful shutdown (runner.cleanup)
        # closes exactly those as idle, so they get a short grace to become
        # requests; after that the drain waits on the in-flight count's event.
        await asyncio.sleep(min(_ACCEPTED_GRACE_S, self.cfg.shutdown_timeout_s))
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        n = len(self.client.requests)
        if n:
            self.log.info("draining", in_flight=n, timeout_s=self.cfg.shutdown_timeout_s)
        try:
            await asyncio.wait_for(self.serving.idle.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass
        if self.serving.num_active:
            self.log.warning("drain timed out; failing the rest", in_flight=self.serving.num_active)
            self.client.fail_all("server shutting down")
            await asyncio.sleep(0.05)


def main() -> None:
    cfg = child_config_from_env(ApiServerConfig)
    # One tokenization is one item: the tokenizer's own thread pool would only add a
    # thread hop (and a thread per core); our pool bounds the threads (serving.py).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    die_with_parent(cfg.parent_pid)
    set_process_name(f"dpserve-{cfg.name}")
    log = setup_logging(cfg.name, cfg.log_level).bind(api_server=cfg.index)
    async def run() -> int:
        server = ApiServer(cfg, log)
        return await server.serve()

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        code = runner(run())
    except Exception:
        log.exception("api server failed")
        code = 1
    os._exit(code)


if __name__ == "__main__":
    main()
