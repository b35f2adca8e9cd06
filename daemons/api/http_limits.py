"""Connection limits for an API server's public port: a cap with a clear answer, never fd exhaustion.

aiohttp has no connection cap, and an API server that runs out of file
descriptors fails every accept (asyncio then logs each failure). This module
counts the port's connections and keeps them below the open-file limit: past
the cap a connection's request is answered 503 (OpenAI-style JSON) and the
connection closed; past a hard ceiling a connection is closed at once, so the
fds it took come back before anything else needs them. It must never touch a
connection that is under the cap (the hot path pays a set insert and remove).
"""

from __future__ import annotations

import asyncio
import os
import resource
import time

from aiohttp import web
from dpserve.daemons.aiohttp_compat import answer_requests_with, cap_keepalive, handler_subclass, set_handler_class

# File descriptors kept for everything but connections: ZeroMQ sockets (one per
# engine connection), the probe socket, logs, the tokenizer threads' libraries.
FD_RESERVE = 128
# Seconds an over-cap connection gets to send the request that is answered 503.
OVER_CAP_IDLE_S = 2.0
_LOG_EVERY_S = 10.0


def connection_limits(max_connections: int) -> tuple[int, int]:
    """(cap, ceiling) for this process: connections served normally, and all connections.

    Both stay below the soft open-file limit minus what the process already uses
    and FD_RESERVE; between cap and ceiling connections get a 503.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    budget = max(soft - used - FD_RESERVE, 16) if soft != resource.RLIM_INFINITY else 1 << 20
    cap = max(1, min(max_connections, budget * 3 // 4))
    ceiling = min(budget, cap + max(64, cap // 4))
    return cap, ceiling


class ConnectionGuard:
    """Counts the public port's open connections and decides each new one's fate."""

    def __init__(self, cap: int, ceiling: int, reject_body: bytes, log) -> None:
        self.cap = cap
        self.ceiling = ceiling
        self.open: set[object] = set()
        self.num_rejected = 0  # answered 503 since the last log line
        self.num_dropped = 0  # closed at once since the last log line
        self.num_rejected_total = 0
        self.num_dropped_total = 0
        self._reject_body = reject_body
        self._log = log
        self._logged_at = 0.0
        self._classes: dict[type, type] = {}

    async def reject(self, request: web.BaseRequest) -> web.StreamResponse:
        """The request handler of a connection over the cap."""
        resp = web.Response(body=self._reject_body, status=503, content_type="application/json", headers={"Retry-After": "1"})
        resp.force_close()
        return resp

    def _note(self) -> None:
        # One line per _LOG_EVERY_S at most, whatever the rate of connections.
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            self._log.warning(
                "connection limit reached",
                open=len(self.open),
                cap=self.cap,
                ceiling=self.ceiling,
                answered_503=self.num_rejected,
                closed_at_once=self.num_dropped,
            )
            self.num_rejected = self.num_dropped = 0

    def adopt(self, handler) -> None:
        """Count and cap `handler`, a protocol handler aiohttp's web.Server just made for a
        new connection (the API server's runner calls this from its Server's factory)."""
        set_handler_class(handler, self._guarded(type(handler)))

    def _guarded(self, base: type) -> type:
        """A subclass of aiohttp's handler class (whatever the runner made) that counts its
        connections and answers those over the cap with 503 (aiohttp offers no
        handler-class option: the internals it takes are fenced in daemons/aiohttp_compat)."""
        cls = self._classes.get(base)
        if cls is not None:
            return cls
        guard = self

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            n = len(guard.open)
            if n >= guard.ceiling:
                guard.num_dropped += 1
                guard.num_dropped_total += 1
                guard._note()
                base.connection_made(self, transport)
                transport.abort()  # the fd comes back now; nothing is read or logged
                return
            guard.open.add(self)
            if n >= guard.cap:
                guard.num_rejected += 1
                guard.num_rejected_total += 1
                guard._note()
                answer_requests_with(self, guard.reject)
                cap_keepalive(self, OVER_CAP_IDLE_S)
            base.connection_made(self, transport)

        def connection_lost(self, exc: BaseException | None) -> None:
            guard.open.discard(self)
            base.connection_lost(self, exc)

        cls = handler_subclass(base, f"Guarded{base.__name__}", {"connection_made": connection_made, "connection_lost": connection_lost})
        self._classes[base] = cls
        return cls
