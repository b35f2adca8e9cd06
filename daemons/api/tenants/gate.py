"""The door of every /v1/ request when a tenants file is given: who is asking,
and may they now. Owns the current KeyBook and Limits, the per-request Call
(what the request reserved and used, for its tenant's buckets), and reloading
the file (SIGHUP). Must never put a key, a digest or an Authorization header
into a log line or an error body: errors name the tenant and the limit only.
"""

from __future__ import annotations

import contextvars

from aiohttp import web
from dpserve.daemons.api.openai_types import ApiError
from dpserve.daemons.api.tenants import Tenant
from dpserve.daemons.api.tenants.keyfile import KeyBook, changes, read_key_file, single_key_book
from dpserve.daemons.api.tenants.limits import Limited, Limits, TenantState

UNAUTHORIZED = ("Missing or invalid API key (send 'Authorization: Bearer <key>').", "authentication_error", "invalid_api_key")


class Call:
    """One request of a tenant, from the middleware to its end: what it reserved
    (prompt + max_tokens of each generation) and what it used."""

    __slots__ = ("st", "limits", "reserved", "prompt", "completion")

    def __init__(self, st: TenantState, limits: Limits) -> None:
        self.st, self.limits, self.reserved, self.prompt, self.completion = st, limits, 0, 0, 0

    @property
    def tenant(self) -> Tenant:
        return self.st.tenant

    def max_tokens(self, req, num_prompt: int, max_tokens: int) -> int:
        """A generation's max_tokens within the tenant's cap (a cap the client did not
        ask past clamps the default; one it asked past is a 400), then reserved."""
        cap = self.st.tenant.max_tokens
        if cap is not None and max_tokens > cap:
            asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
            if asked:
                raise ApiError(400, f"max_tokens {asked} is over this API key's limit of {cap} "
                               f"(tenant {self.st.tenant.name!r}).", param="max_tokens", code="max_tokens_limit")
            max_tokens = cap
        try:
            self.reserved += self.limits.reserve(self.st, num_prompt, max_tokens)
        except Limited as exc:
            raise limit_error(exc) from None
        return max_tokens

    def finish(self) -> None:
        """The request is over (the middleware's finally): settle the tenant's buckets."""
        self.limits.done(self.st, self.reserved, self.prompt, self.completion)

    def ended(self, gens) -> None:
        """The engine requests this call sent have ended (serving.run's finally)."""
        for gen in gens:
            self.prompt += gen.state.prompt_tokens
            self.completion += gen.state.num_output_tokens


# The Call of the request the current task serves (the middleware sets it; handlers
# run in the middleware's task). None without a tenants file.
CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("tenant_call", default=None)

_LIMIT_WORDS = {
    "requests_per_s": "requests per second",
    "tokens_per_min": "tokens (prompt + completion) per minute",
    "max_concurrent": "concurrent requests",
}


def limit_error(exc: Limited) -> ApiError:
    """429 naming the limit, with Retry-After from the tenant's bucket (OpenAI's code)."""
    return ApiError(
        429,
        f"Rate limit reached for tenant {exc.tenant.name!r} on {exc.limit} ({_LIMIT_WORDS[exc.limit]}): "
        f"limit {exc.value:g}. Retry after {exc.retry_after} s.",
        type="rate_limit_error",
        param=exc.limit,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(exc.retry_after)},
    )


class TenantGate:
    """The current reading of the key file and the limits it sets."""

    def __init__(self, path: str, book: KeyBook, log) -> None:
        self.path, self.book, self.log = path, book, log
        self.limits = Limits(book.tenants)

    @classmethod
    def open(cls, path: str, fallback: KeyBook | None, log) -> TenantGate:
        """Read the file; if it cannot be read now, serve the reading the node started with."""
        try:
            book = _read(path)
        except ValueError as exc:
            if fallback is None:
                raise
            log.error("cannot read the key file; serving the tenants the node started with", error=str(exc))
            book = fallback
        return cls(path, book, log)

    def authenticate(self, header: bytes) -> Tenant | None:
        if header[:7].lower() != b"bearer ":
            return None
        return self.book.lookup(header[7:])

    def admit(self, tenant: Tenant) -> Call:
        try:
            return Call(self.limits.admit(tenant), self.limits)
        except Limited as exc:
            raise limit_error(exc) from None

    def middleware(self):
        """auth_middleware's with a tenants file: the key names the tenant, whose limits
        are held here; request["tenant"] and CALL carry it to the handler."""

        @web.middleware
        async def check_tenant(request: web.Request, handler):
            if not (request.path.startswith("/v1/") or request.path == "/invocations") or request.match_info.http_exception is not None:
                return await handler(request)
            # (aiohttp keeps undecodable header bytes as surrogates: the bytes that came)
            tenant = self.authenticate(request.headers.get("Authorization", "").encode("utf-8", "surrogateescape"))
            if tenant is None:
                raise ApiError(401, UNAUTHORIZED[0], type=UNAUTHORIZED[1], code=UNAUTHORIZED[2])
            request["tenant"] = tenant
            call = self.admit(tenant)  # 429 naming the limit, with Retry-After
            token = CALL.set(call)
            try:
                return await handler(request)
            finally:
                CALL.reset(token)
                call.finish()

        return check_tenant

    def reload(self) -> bool:
        """SIGHUP: read the file again. A file that fails keeps the current tenants."""
        try:
            book = _read(self.path)
        except ValueError as exc:
            self.log.error("key file reload failed; keeping the current tenants", error=str(exc))
            return False
        diff = changes(self.book.tenants, book.tenants)
        self.limits.reload(book.tenants)
        self.book = book
        for name, what, fields in diff:
            self.log.info(f"tenant {what}", tenant=name, **fields)
        self.log.info("key file reloaded", tenants=len(book.tenants), changed=len(diff))
        return True


def _read(path: str) -> KeyBook:
    key, book = read_key_file(path)
    return book if book is not None else single_key_book(key)
