"""The one place dpserve touches aiohttp below its documented API.

Each use here exists because aiohttp offers no public switch for it, and each is
checked by name in tests/unit/test_dependency_internals.py, so an aiohttp release
that renames or drops one fails a named test instead of changing behaviour
silently (pyproject.toml pins an upper bound; raise it only with that file green).
No other module may import aiohttp.web_protocol or set an underscored aiohttp
attribute; callers use the names below.

The internals, and why:

- `StreamResponse._send_headers_immediately` (class attribute, True in aiohttp):
  False makes a response's headers leave with its first body write, one socket
  write instead of two; aiohttp's own `Response` uses the same switch. EventStream
  sets it for server-sent events.
- `BaseRunner._make_server` (the runner's undocumented, abstract factory of its
  `web.Server`): JsonErrorRunner overrides it to swap the server's class, so that
  every protocol handler it makes can be adopted (see the next item) whatever
  public site serves the runner.
- `RequestHandler.__slots__` and `__class__` assignment: aiohttp has no option for
  the handler class of a connection; a subclass with `__slots__ = ()` has the same
  layout, so an instance can take it on (`set_handler_class`). JsonErrorRunner uses
  it for `handle_error` (the answers aiohttp makes itself to a bad request line, too
  many headers, a handler timeout), and the connection guard to count connections.
- `RequestHandler.handle_error(request, status, exc, message)`: the method those
  answers come from, overridden by `json_error_handler_class`.
- `RequestHandler._request_handler` and `_keepalive_timeout` (slots): the handler a
  connection's requests go to and its idle timeout; the connection guard answers an
  over-cap connection with its own handler and a short idle time
  (`answer_requests_with`, `cap_keepalive`).
- `aiohttp.http_exceptions.HttpProcessingError`: the parser's error for a request
  it cannot read; its `message` is the detail a 400 shows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

__all__ = [
    "EventStream",
    "Pacer",
    "HttpProcessingError",
    "JsonErrorRunner",
    "answer_requests_with",
    "cap_keepalive",
    "handler_subclass",
    "json_error_handler_class",
    "set_handler_class",
]

# (request, status, exc, message) -> the response aiohttp sends for its own errors
ErrorAnswer = Callable[[web.BaseRequest, int, "BaseException | None", "str | None"], web.StreamResponse]


class Pacer(Protocol):
    """What paces an EventStream's writes (daemons/api/backpressure.StreamPacer)."""

    def attach(self, response: web.StreamResponse, request: web.BaseRequest) -> None: ...

    def fits(self, size: int) -> bool: ...

    async def write_waiting(self, write: Callable[[bytes], Awaitable[None]], data: bytes) -> None: ...


class EventStream(web.StreamResponse):
    """A streamed response whose headers leave with its first write: one socket write,
    not two (the bytes on the wire are unchanged). With a `pacer`, a write that does
    not fit what the client has read goes through pacer.write_waiting (public API
    only: the transport's write-buffer size and limits, and request.writer.drain())."""

    _send_headers_immediately = False
    pacer: Pacer | None = None

    async def prepare(self, request: web.BaseRequest):
        writer = await super().prepare(request)
        if self.pacer is not None:
            self.pacer.attach(self, request)
        return writer

    async def write(self, data) -> None:
        pacer = self.pacer
        if pacer is None or pacer.fits(len(data)):
            await super().write(data)
        else:
            await pacer.write_waiting(super().write, data)

    async def write_eof(self, data: bytes = b"") -> None:
        pacer = self.pacer
        if pacer is None or pacer.fits(len(data)):
            await super().write_eof(data)
        else:
            await pacer.write_waiting(super().write_eof, data)


def handler_subclass(base: type, name: str, methods: dict) -> type:
    """A subclass of aiohttp's protocol handler class `base` with the same slots, so that
    an instance of `base` can take it on (set_handler_class)."""
    return type(name, (base,), {"__slots__": (), **methods})


def set_handler_class(handler: web.RequestHandler, cls: type) -> None:
    """Make `handler`, a protocol handler aiohttp just made, an instance of `cls`
    (a handler_subclass of its class)."""
    handler.__class__ = cls


def answer_requests_with(handler: web.RequestHandler, fn: Callable) -> None:
    """Send every request of this connection to `fn` instead of the application."""
    handler._request_handler = fn


def cap_keepalive(handler: web.RequestHandler, seconds: float) -> None:
    """Close this connection after at most `seconds` idle (waiting for a request)."""
    handler._keepalive_timeout = min(handler._keepalive_timeout, seconds)


def json_error_handler_class(answer: ErrorAnswer) -> type:
    """aiohttp's protocol handler, but its own error answers come from `answer`.
    Logging stays aiohttp's (engine.common.logs rate-limits it)."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        web.RequestHandler.handle_error(self, request, status, exc, message)  # logs; raises if a response already started
        resp = answer(request, status, exc, message)
        resp.force_close()
        return resp

    return handler_subclass(web.RequestHandler, "JsonErrorHandler", {"handle_error": handle_error})


class _AdoptingServer(web.Server):
    """A web.Server whose new protocol handlers take `handler_class` and then pass to `adopt`."""

    handler_class: type = web.RequestHandler
    adopt: Callable[[web.RequestHandler], None] | None = None

    def __call__(self) -> web.RequestHandler:
        handler = super().__call__()
        set_handler_class(handler, self.handler_class)
        if self.adopt is not None:
            self.adopt(handler)
        return handler


class JsonErrorRunner(web.AppRunner):
    """An AppRunner whose connections answer aiohttp's own protocol errors through
    `answer` and are handed to `adopt` (a connection guard) as they open, whatever
    public site serves them."""

    def __init__(self, app: web.Application, answer: ErrorAnswer,
                 adopt: Callable[[web.RequestHandler], None] | None = None, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._handler_class = json_error_handler_class(answer)
        self._adopt = adopt

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _AdoptingServer
        server.handler_class = self._handler_class
        server.adopt = self._adopt
        return server
