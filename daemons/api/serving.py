"""What every OpenAI endpoint shares: from a validated request to a rank and back.

Owns auth (as aiohttp middleware), rank pinning (X-data-parallel-rank), sending
with a bounded wait for a rank, engine failures, and the one wrapper around a
request's life that counts it, times it and aborts what is left of it. The
endpoints (completions.py, chat.py) build on ServingBase; it must never know a
response body's shape. Hot path habits: one JSON decode straight into a Struct,
one ZeroMQ send per engine request, no logging per request; errors leave as
OpenAI-style bodies (see ApiError).
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import zmq
from aiohttp import web
from dpserve.daemons.aiohttp_compat import EventStream
from dpserve.daemons.api import sampling_defaults
from dpserve.daemons.api.admission import Admission, HoldRefused, soonest_rank
from dpserve.daemons.api.backpressure import StreamBudget, StreamCollector, StreamStalled
from dpserve.daemons.api.engine_client import EngineClient
from dpserve.daemons.api.generation import EngineFailure, Generation
from dpserve.daemons.api.metrics import ApiMetrics
from dpserve.daemons.api.migration import MigrationCollector
from dpserve.daemons.api.openai_types import ApiError, ErrorBody, ErrorResponse, StreamOptions, encode
from dpserve.daemons.api.refusals import hold_refused_error, parse_rank_header, routing_error
from dpserve.daemons.api.request_checks import check_unsupported, decode_request
from dpserve.daemons.api.request_state import RequestState
from dpserve.daemons.api.reserve import ALONE, HOLD, SOONEST
from dpserve.daemons.api.router import NoRankAvailable, QueueFull, RankNotEligible, RoutingError
from dpserve.daemons.api.tenants import DEFAULT_TENANT, Tenant
from dpserve.daemons.api.tenants.gate import CALL as TENANT_CALL
from dpserve.daemons.api.tenants.gate import UNAUTHORIZED, TenantGate
from dpserve.daemons.api.tenants.metrics import AdmissionCollector
from dpserve.daemons.api.tokenizer import TextTokenizer
from dpserve.daemons.config import ApiServerConfig
from dpserve.engine.common.protocol import AddRequest, SamplingParams

RANK_HEADER = "X-data-parallel-rank"
DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Bodies up to this size are tokenized on the event loop: the thread hop costs
# ~0.13 ms of CPU (measured), four times a short prompt's tokenization, while 8 KiB
# stalls the loop ~3 ms at most (the demo tokenizer, a slow one). Larger bodies go
# to a small thread pool, so a 4 MiB prompt never stalls the loop that answers
# everyone else.
_INLINE_TOKENIZE_BYTES = 8192
_TOKENIZE_THREADS = 2
_MAX_UNKNOWN_LOGGED = 32
# The engine requests of the request this task serves (run() sets it), for the pacing
# of its stream (finish_response); each aiohttp handler runs in a task of its own.
_IN_FLIGHT: contextvars.ContextVar[list[RequestState]] = contextvars.ContextVar("in_flight")


def failure_kind(status: int) -> tuple[str, str | None]:
    """(error type, code) of an engine-side failure: the rank failed (503), it never
    answered (504), or it refused the request (4xx)."""
    if status == 503:
        return "service_unavailable", "engine_error"
    if status == 504:
        return "server_error", "first_token_timeout"
    return "invalid_request_error", None


def failure_error(exc: EngineFailure) -> ApiError:
    """An engine failure before the response started: an error response."""
    kind, code = failure_kind(exc.status)
    return ApiError(exc.status, str(exc), type=kind, code=code)


def failure_event(exc: EngineFailure) -> bytes:
    """An engine failure after a stream started: its last event, then [DONE]."""
    kind, code = failure_kind(exc.status)
    return b"data: " + encode(ErrorResponse(ErrorBody(str(exc), kind, None, code or "engine_error"))) + b"\n\n" + DONE


def auth_middleware(api_key: str | None, gate: TenantGate | None = None):
    """Middleware that asks every /v1/ route and /invocations (it generates) for
    `Authorization: Bearer <api_key>`, or None without a key. A path no route serves
    keeps its 404 (or 405) without a key. vLLM's /tokenize and /detokenize stay open, as there.
    Each accepted request carries its Tenant as request["tenant"]; with a tenants file
    (`gate`) the key says which, and the tenant's limits are held here (tenants/gate.py)."""
    if gate is not None:
        return gate.middleware()
    if not api_key:
        return None
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if (request.path.startswith("/v1/") or request.path == "/invocations") and request.match_info.http_exception is None:
            # aiohttp keeps undecodable header bytes as surrogates: turn them back into
            # the bytes that came, so any header compares instead of raising.
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, expected):
                raise ApiError(401, UNAUTHORIZED[0], type=UNAUTHORIZED[1], code=UNAUTHORIZED[2])
            request["tenant"] = DEFAULT_TENANT
        return await handler(request)

    return check_api_key


class ServingBase:
    """State and steps every endpoint shares. The endpoints' requests are counted in
    `num_active` from before their first send until their response is complete."""

    def __init__(self, cfg: ApiServerConfig, tokenizer: TextTokenizer, client: EngineClient, metrics: ApiMetrics, log) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.client = client
        self.router = client.router
        self.metrics = metrics
        self.log = log
        self.model_name = cfg.served_model_name
        self.max_model_len = cfg.max_model_len
        # a request's unset sampling parameters (vLLM's --generation-config; checked at the CLI)
        self.defaults = sampling_defaults.load(cfg.model_dir, cfg.generation_config, cfg.override_generation_config)
        self.vocab_size = tokenizer.vocab_size
        self.draining = False
        self.num_active = 0  # requests between routing and their response (the drain waits on them)
        self.idle = asyncio.Event()  # set while num_active == 0
        self.idle.set()
        self._unknown_fields: set[str] = set()
        self._id_prefix = f"{cfg.index:x}{os.urandom(4).hex()}"
        self._ids = itertools.count()
        self._created = int(time.time())
        # Response headers per serving rank, built once: aiohttp copies them per response anyway.
        self.json_headers = [{"Content-Type": "application/json", RANK_HEADER: str(r)} for r in range(self.router.size)]
        self.sse_headers = [{**_SSE_HEADERS, RANK_HEADER: str(r)} for r in range(self.router.size)]
        self._tokenize_pool = ThreadPoolExecutor(_TOKENIZE_THREADS, thread_name_prefix="tokenize")
        # A prompt longer than this many bytes needs more than max_model_len tokens
        # whatever it says, so it is refused without tokenizing (None: no such bound).
        per_token = tokenizer.max_bytes_per_token
        self.max_prompt_bytes = self.max_model_len * per_token if per_token else None
        self.streams = StreamBudget(client, cfg.stream_buffer_bytes, cfg.stream_buffer_total_bytes, cfg.stream_write_timeout_s)
        metrics.registry.register(StreamCollector(self.streams, cfg.index))
        metrics.registry.register(MigrationCollector(client.migrator, cfg.index))
        # Admission held here while every rank is full (admission.py): the router's waiting
        # limit becomes the hold threshold, and its room reports release held requests.
        self.admission: Admission | None = None
        if cfg.admission_hold:
            self.admission = Admission.of_config(cfg, self.router)
            metrics.registry.register(AdmissionCollector(self.admission, cfg.index))

    def new_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids):x}"

    def finish_response(self, resp: web.StreamResponse) -> web.StreamResponse:
        """A response about to be sent: while draining, its connection closes after it.
        A stream's writes are paced against its client's reading (backpressure.py)."""
        if self.draining:
            resp.force_close()
        if isinstance(resp, EventStream):
            resp.pacer = self.streams.pacer(_IN_FLIGHT.get(()))
        return resp

    # ---------------------------------------------------------------- checks

    async def read_request(self, request: web.Request, kind: type):
        """The body as a validated `kind` (CompletionRequest or ChatCompletionRequest) for
        the served model, with no unsupported parameter set; else a 4xx ApiError."""
        req = decode_request(await self.read_body(request), kind, self.note_unknown_field)
        check_unsupported(req)
        self.check_model(req.model)
        if req.stream and self.cfg.enable_force_include_usage:  # vLLM's: usage on every chunk of every stream
            req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
        return req

    async def read_body(self, request: web.Request) -> bytes:
        if request.content_type != "application/json":
            # Also keeps browsers' cross-site "simple" POSTs (form or text/plain bodies) out.
            got = request.headers.get("Content-Type")
            raise ApiError(
                415,
                f"Content-Type must be application/json; got {got!r}." if got else "Content-Type must be application/json; none was sent.",
                code="unsupported_media_type",
            )
        limit = self.cfg.max_request_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"Request body of {request.content_length} bytes exceeds the limit of {limit} bytes.", code="request_too_large")
        try:
            async with asyncio.timeout(self.cfg.http_body_timeout_s):
                return await request.read()
        except TimeoutError:
            # (a Content-Length larger than what comes would otherwise wait forever)
            raise ApiError(408, f"The request body did not arrive within {self.cfg.http_body_timeout_s:g} s.", code="request_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large") from None

    def note_unknown_field(self, name: str) -> None:
        """Unknown fields are ignored, as vLLM does; each name is logged once, and at
        most _MAX_UNKNOWN_LOGGED names, so random names cannot flood the log."""
        if name in self._unknown_fields or len(self._unknown_fields) >= _MAX_UNKNOWN_LOGGED:
            return
        self._unknown_fields.add(name)
        more = " (no further names will be logged)" if len(self._unknown_fields) == _MAX_UNKNOWN_LOGGED else ""
        self.log.warning(f"ignoring an unknown request field; logged once per name{more}", field=name[:80])

    def check_model(self, model: str | None) -> None:
        if model is None:
            raise ApiError(400, "model is required.", param="model")
        if model != self.model_name:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r}.", param="model", code="model_not_found")

    def sampling(self, req, num_prompt: int, max_tokens: int) -> SamplingParams:
        """The parameters every request has, checked against the model's limits."""
        limit = self.max_model_len
        if num_prompt == 0:
            raise ApiError(400, "The prompt is empty.", param="prompt")
        if num_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion).",
                param="max_tokens" if num_prompt < limit else "prompt",
                code="context_length_exceeded",
            )
        if req.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).", param="min_tokens")
        defaults = self.defaults
        top_k = max(defaults.top_k if req.top_k is None else req.top_k, 0)  # vLLM's -1 and 0: off
        stop_ids = tuple(req.stop_token_ids or ())
        if any(t >= self.vocab_size for t in stop_ids):
            raise ApiError(400, f"stop_token_ids must be in [0, {self.vocab_size}).", param="stop_token_ids")
        priority = req.priority
        if (call := TENANT_CALL.get()) is not None:  # a tenants file: its cap, its tokens, its default priority
            max_tokens = call.max_tokens(req, num_prompt, max_tokens)
            priority = priority or call.tenant.priority
        if req.priority and self.cfg.scheduling_policy != "priority":
            raise ApiError(400, f"priority {req.priority} needs --scheduling-policy priority; this server schedules "
                           f"{self.cfg.scheduling_policy} (first come, first served).", param="priority")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            top_k=top_k,
            seed=req.seed,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            priority=priority,
        )

    # ---------------------------------------------------------------- tokenization

    async def tokenize(self, request: web.Request, fn, *args) -> list[int]:
        """fn(*args) inline for small bodies, else on the tokenizer threads.

        The tokenizer releases the GIL while it works (TextTokenizer), so the
        event loop keeps serving meanwhile; the pool's size bounds the CPU that
        long prompts take from the rest.
        """
        size = request.content_length
        if size is not None and size <= _INLINE_TOKENIZE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _check_prompt_size(self, text: str, param: str) -> None:
        limit = self.max_prompt_bytes
        if limit is None or len(text) * 4 <= limit:  # UTF-8 takes at most 4 bytes a character
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt of "
                f"{size} bytes needs more than that: no token of this tokenizer covers more than "
                f"{limit // self.max_model_len} bytes.",
                param=param,
                code="context_length_exceeded",
            )

    def prompt_ids(self, prompt: str) -> list[int]:
        self._check_prompt_size(prompt, "prompt")
        return self.tokenizer.encode(prompt)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool, template_args: dict | None = None) -> list[int]:
        tok = self.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **(template_args or {}))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        self._check_prompt_size(text, "messages")
        return tok.encode_chat_prompt(text)

    # ---------------------------------------------------------------- a request's life

    def pinned_rank(self, request: web.Request) -> int | None:
        """The rank X-data-parallel-rank pins the request to (checked), or None. The
        header twice (even twice the same) is a 400: which one a proxy saw is unknown."""
        values = request.headers.getall(RANK_HEADER, ())
        if len(values) > 1:
            raise ApiError(400, f"{RANK_HEADER} was sent {len(values)} times; send it at most once.",
                           param=RANK_HEADER, code="invalid_rank")
        pinned = parse_rank_header(values[0] if values else None, self.router.size)
        if pinned is not None:
            try:
                self.router.check_pin(pinned)
            except RankNotEligible as exc:
                raise routing_error(exc) from None
        return pinned

    async def run(self, endpoint: str, t0: float, gens: Sequence[Generation], pinned: int | None,
                  respond: Callable[[], Awaitable[web.StreamResponse]], tenant: Tenant | None = None) -> web.StreamResponse:
        """Send `gens`, then answer with `respond()`; counts, times and cleans up.

        The one `finally` of every request: whatever ends it (the answer, an engine
        failure, the client leaving, a stop string), an engine request that has not
        finished is aborted, so its rank stops working for nobody.
        """
        sent: list[RequestState] = []
        in_flight = _IN_FLIGHT.set(sent)
        self.request_began()
        answered = False
        try:
            for gen in gens:
                gen.state.owner, gen.state.pinned = gen, pinned is not None  # what a move needs (migration.py)
                if tenant is not None:
                    gen.state.tenant = tenant
                rank = await self.send(gen, pinned)
                sent.append(gen.state)
                self.metrics.routed_to(rank)
            resp = await respond()
            answered = True
            self.metrics.observe(endpoint, resp.status, time.perf_counter() - t0)
            return resp
        except EngineFailure as exc:
            self.metrics.observe(endpoint, exc.status)
            raise failure_error(exc) from None
        except StreamStalled as exc:  # the client read nothing for the write timeout: its connection is closed
            self.metrics.observe("stream", 408)
            return exc.response
        finally:
            _IN_FLIGHT.reset(in_flight)
            self.request_ended()
            self.metrics.requests_ended(gens[: len(sent)], answered)  # vLLM's request metrics, once per request
            if (call := TENANT_CALL.get()) is not None:
                call.ended(gens[: len(sent)])  # its tenant is charged what it used
            for state in sent:
                if not state.is_finished:
                    self.client.abort(state)  # client went away, or a stop string ended it early
                if state.held is not None or state.urgency is not None:  # charged what it used
                    self.admission.ended(state)

    def request_began(self) -> None:
        self.num_active += 1
        self.idle.clear()

    def request_ended(self) -> None:
        self.num_active -= 1
        if not self.num_active:
            self.idle.set()

    async def send(self, gen: Generation, pinned: int | None) -> int:
        """Send to the best rank, waiting (bounded) while none can take it.

        Before any rank is ready (the node starts) or while the ranks restart, a
        request waits up to --wait-for-engine-s for one instead of failing at
        once, as clients of a server whose port opens only when it serves expect.
        """
        state, add = gen.state, gen.add_request()
        try:
            return await self._admit(state, add, pinned)
        except HoldRefused as exc:
            raise hold_refused_error(exc) from None
        except NoRankAvailable as exc:
            if self.draining:
                raise routing_error(exc) from None
            first = routing_error(exc)
        except RoutingError as exc:
            raise routing_error(exc) from None
        deadline = time.monotonic() + self.cfg.wait_for_engine_s
        while await self.client.wait_routes(deadline - time.monotonic()):
            if self.draining:
                break
            try:
                return await self._admit(state, add, pinned)  # (held if the ranks that came back are full)
            except NoRankAvailable:
                pass
            except HoldRefused as exc:
                raise hold_refused_error(exc) from None
            except RoutingError as exc:
                raise routing_error(exc) from None
        if self.draining:
            raise ApiError(503, "The server is shutting down.", type="service_unavailable", code="shutting_down", headers={"Retry-After": "1"})
        waited = f" (waited {self.cfg.wait_for_engine_s:g} s)" if self.cfg.wait_for_engine_s > 0 else ""
        raise ApiError(503, first.message + waited, type=first.type, code=first.code, headers=first.headers)

    async def _admit(self, state: RequestState, add: AddRequest, pinned: int | None) -> int:
        """Send now, or, while every rank is full (QueueFull at the hold threshold) or others are held,
        wait in the tenant's held queue for a release in fair order (admission.py). A pinned request never
        waits there (the client chose its rank); under --scheduling-policy priority, neither does one more
        urgent than a held request: it goes where it starts soonest; the engine preempts for it (urgency)."""
        admission = self.admission
        if admission is None or pinned is not None:
            return self._send_once(state, add, pinned)
        priority = add.params.priority
        go = (HOLD if admission.num_held else ALONE) if admission.reserve is None else admission.may_pass(state.tenant, priority)
        base, add = add, admission.urgency(add, go)
        if go:  # (under its reservation, NOW: the rank with the fewest running + waiting, which a fcfs rank serves first)
            try:
                return admission.started(state, priority, self._send_once(state, add, soonest_rank(self.router) if go in SOONEST else None))
            except QueueFull:
                pass
        if priority < admission.least_urgent():  # (priority policy) less urgent work is held or runs
            return admission.started(state, priority, self._send_once(state, add, soonest_rank(self.router)))
        held = admission.enqueue(state.tenant, priority, state.remaining, lambda: self._send_once(
            state, admission.urgency(base, held.go), soonest_rank(self.router) if held.go in SOONEST else None))
        state.held = held
        try:
            return admission.started(state, priority, await admission.wait(held))
        except BaseException:
            if held.sent:  # released as its client went away: admission forgot it; the engine stops it
                self.client.abort(state)
            state.held = None
            raise

    def _send_once(self, state: RequestState, add: AddRequest, pinned: int | None) -> int:
        """Send to the best rank; a rank whose socket is gone is skipped, not fatal.
        Raises RoutingError when no rank takes it."""
        for _ in range(self.router.size):
            # Where it starts soonest: more urgent than the default (priority policy).
            pick = self.router.pick_urgent if add.params.priority < 0 else self.router.pick
            rank = pick(pinned, add.prompt_token_ids)
            try:
                self.client.send(state, add, rank)
                return rank
            except zmq.ZMQError:
                # The engine's connection closed before the table said so (it just
                # died): stop routing to it until it says hello again.
                self.router.engine_dead(rank, self.router.hello[rank])
                if pinned is not None:
                    break
        raise NoRankAvailable(unreachable=True)
