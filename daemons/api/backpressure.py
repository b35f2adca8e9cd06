"""Bounded output for clients that stop reading a stream.

Owns, per API server, the bytes its streamed responses hold for their clients
(StreamBudget), and per stream the pause, resume and abort of its engine
requests (StreamPacer). A stream may hold --stream-buffer-bytes: half in the
kernel's send buffer (SO_SNDBUF is set to a quarter of it; Linux doubles that
for its bookkeeping) and half in the transport's write buffer here. A write
that would pass that half, or any write of a stream already behind while all
streams together hold more than --stream-buffer-total-bytes, pauses the
stream's engine requests (the engine stops stepping them, their KV stays) and
waits until the client has read everything this process holds; then they
resume. A stream that makes no progress for --stream-write-timeout-s is
aborted: its connection closed, its engine requests aborted. It must never
let a request generate for a reader that does not read, nor block a write
without a deadline.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from dpserve.daemons.api.engine_client import EngineClient
from dpserve.daemons.api.request_state import RequestState
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# How often a stream's total is summed at most (a behind stream checks it per write).
_SUM_INTERVAL_S = 0.01
# A paused stream looks for progress this many times per write timeout.
_PROGRESS_CHECKS = 10


class StreamStalled(Exception):
    """A stream's client read nothing for the write timeout; its connection is closed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the client read nothing within the stream write timeout")
        self.response = response


class StreamBudget:
    """One API server's streams: the bound per stream and in total, and its counters.

    `behind` holds the pacers whose transport held bytes at their last write (a
    client keeping up holds none: the kernel takes every write at once)."""

    def __init__(self, client: EngineClient, per_stream_bytes: int, total_bytes: int, write_timeout_s: float) -> None:
        self.client = client
        self.per_stream_bytes = per_stream_bytes
        self.total_bytes = total_bytes
        self.write_timeout_s = write_timeout_s
        self.behind: set[StreamPacer] = set()
        self.num_pauses = 0  # pauses since start (a stream may pause many times)
        self.num_paused = 0  # streams paused now
        self.num_stalled = 0  # streams aborted for the write timeout
        self._held = 0
        self._summed_at = -1.0

    def pacer(self, states: Sequence[RequestState]) -> StreamPacer:
        return StreamPacer(self, states)

    @property
    def held_bytes(self) -> int:
        """Bytes the streams behind hold in this process (summed at most every 10 ms)."""
        now = time.monotonic()
        if now - self._summed_at >= _SUM_INTERVAL_S:
            self._summed_at = now
            held = 0
            for pacer in list(self.behind):
                size = pacer.buffered
                if size:
                    held += size
                else:
                    pacer._is_behind = False
                    self.behind.discard(pacer)
            self._held = held
        return self._held


class StreamPacer:
    """One streamed response's writes against its budget; see the module docstring.

    Invariant: while the pacer waits for its reader, its unfinished engine requests
    are paused (and resumed, or aborted by the caller's cleanup, when it ends)."""

    __slots__ = ("budget", "states", "response", "transport", "writer", "high", "_buffer_size", "_is_behind")

    def __init__(self, budget: StreamBudget, states: Sequence[RequestState]) -> None:
        self.budget = budget
        self.states = states
        self.high = budget.per_stream_bytes // 2  # this process's share
        self.response: web.StreamResponse | None = None
        self.transport: asyncio.Transport | None = None
        self.writer = None
        self._buffer_size: Callable[[], int] = int  # the transport's get_write_buffer_size once attached (int() is 0)
        self._is_behind = False  # in budget.behind

    def attach(self, response: web.StreamResponse, request: web.BaseRequest) -> None:
        """The response was prepared on `request`'s connection: bound its buffers."""
        self.response, self.transport, self.writer = response, request.transport, request.writer
        if self.transport is None:
            return
        self._buffer_size = self.transport.get_write_buffer_size
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, max(4096, self.budget.per_stream_bytes // 4))
            except OSError:
                pass  # not a socket that takes it (a Unix pipe in tests): the kernel's own bound stays
        # high == low: the protocol is paused exactly while more than `high` is held, so a
        # write that fits never waits inside aiohttp (see fits()).
        self.transport.set_write_buffer_limits(high=self.high, low=self.high)

    @property
    def buffered(self) -> int:
        transport = self.transport
        return transport.get_write_buffer_size() if transport is not None and not transport.is_closing() else 0

    def fits(self, size: int) -> bool:
        """Whether `size` more bytes may be written without waiting for the reader (the
        hot path: a client that keeps up holds nothing here, ~0.2 us a write)."""
        held = self._buffer_size()
        if not held:
            if self._is_behind:
                self._is_behind = False
                self.budget.behind.discard(self)
            return size <= self.high
        self._is_behind = True
        self.budget.behind.add(self)
        return held + size <= self.high and self.budget.held_bytes <= self.budget.total_bytes

    async def write_waiting(self, write: Callable[[bytes], Awaitable[None]], data: bytes) -> None:
        """Write `data` with the stream's engine requests paused, and wait until the client
        read everything held here; raises StreamStalled when it reads nothing for the
        write timeout (the connection is then closed)."""
        budget, transport = self.budget, self.transport
        self._is_behind = True
        budget.behind.add(self)
        running = [s for s in self.states if not s.is_finished]
        budget.client.pause(running)
        budget.num_pauses += 1
        budget.num_paused += 1
        if transport is not None and not transport.is_closing():
            transport.set_write_buffer_limits(high=0, low=0)  # paused while anything is held
        try:
            await self._until_drained(write, data)
        finally:
            budget.num_paused -= 1
            if transport is not None and not transport.is_closing():
                transport.set_write_buffer_limits(high=self.high, low=self.high)
        budget.client.resume(running)

    async def _until_drained(self, write: Callable[[bytes], Awaitable[None]], data: bytes) -> None:
        timeout = self.budget.write_timeout_s
        check = timeout / _PROGRESS_CHECKS
        task = asyncio.ensure_future(self._write_and_drain(write, data))
        last, deadline = self.buffered, time.monotonic() + timeout
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=check)
                if done:
                    return task.result()
                now, size = time.monotonic(), self.buffered
                if size < last:  # the client read some: progress
                    deadline = now + timeout
                elif now >= deadline:
                    break
                last = size  # (the first check also sees the write that paused the stream)
        finally:
            if not task.done():
                task.cancel()
        self.budget.num_stalled += 1
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:  # linger 0: the close resets the connection and drops the kernel's queue too
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            self.transport.abort()  # drops what the client never read
        raise StreamStalled(self.response)

    async def _write_and_drain(self, write: Callable[[bytes], Awaitable[None]], data: bytes) -> None:
        await write(data)
        if self.writer is not None:
            await self.writer.drain()


class StreamCollector:
    """The budget's figures on /metrics (labelled with the API server's index)."""

    def __init__(self, budget: StreamBudget, index: int) -> None:
        self.budget, self.label = budget, [str(index)]

    def collect(self):
        b, label = self.budget, self.label
        paused = GaugeMetricFamily("dpserve_api_streams_paused", "Streams paused now: their clients stopped reading.", labels=["api_server"])
        paused.add_metric(label, b.num_paused)
        held = GaugeMetricFamily("dpserve_api_stream_held_bytes", "Output bytes this API server holds for streams behind their clients.", labels=["api_server"])
        held.add_metric(label, b.held_bytes)
        pauses = CounterMetricFamily("dpserve_api_stream_pauses", "Pauses of streams whose clients stopped reading.", labels=["api_server"])
        pauses.add_metric(label, b.num_pauses)
        stalled = CounterMetricFamily("dpserve_api_streams_stalled", "Streams closed (requests aborted) after the write timeout.", labels=["api_server"])
        stalled.add_metric(label, b.num_stalled)
        yield from (paused, held, pauses, stalled)
