"""Liveness and readiness probes of every child, every probe interval.

API servers are probed over HTTP (/health for liveness, /readyz for
readiness) on their private unix socket, because behind the shared port a
probe would reach a random API server (vLLM #35066). Engines and the
coordinator are judged by heartbeats that only their working loop sends: a
heartbeat later than its interval plus the probe timeout fails the probe.
The prober reads a NodeView and posts ProbeResult and ClusterSeen events;
counting failures and declaring a child dead is the supervisor loop's job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import msgspec
from dpserve.daemons.supervisor.children import Child, ChildState
from dpserve.daemons.supervisor.events import ClusterSeen, Event, ProbeResult
from dpserve.daemons.supervisor.views import NodeView

STARTUP_CHECK_INTERVAL_S = 0.2


class Prober:
    def __init__(self, view: NodeView, post: Callable[[Event], None]) -> None:
        self.view = view
        self.post = post
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._readyz: dict[str, tuple[int, bytes]] = {}  # this cycle's /readyz answers, by API server

    def _session(self, path: str) -> aiohttp.ClientSession:
        session = self._sessions.get(path)
        if session is None or session.closed:
            session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path))
            self._sessions[path] = session
        return session

    async def _get(self, child: Child, route: str, timeout: float) -> tuple[int, bytes]:
        session = self._session(child.probe_path)
        async with session.get(f"http://localhost{route}", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()

    async def run(self) -> None:
        """While starting: is the cluster routable yet? While serving: probe every READY child."""
        view = self.view
        try:
            while True:
                if view.phase == "starting":
                    await asyncio.sleep(STARTUP_CHECK_INTERVAL_S)
                    children = view.children()
                    if view.phase == "starting" and children and all(c.state == ChildState.READY for c in children):
                        await self.check_routable()
                    continue
                await asyncio.sleep(view.probe_interval_s)
                self._readyz.clear()
                await asyncio.gather(*(self._probe(c) for c in view.children() if c.state == ChildState.READY))
                # The probes' own /readyz answers say what the cluster looks like;
                # asking again would wait on a hung API server a second time.
                apis = view.children("api")
                if apis and len(self._readyz) == len(apis):
                    self.post(self._judge(list(self._readyz.values())))
        finally:
            for session in self._sessions.values():
                await session.close()

    async def check_routable(self) -> None:
        """During startup: does every API server route to every rank it should,
        and does the cluster hold all data-parallel-size ranks?"""
        apis = self.view.children("api")
        if not apis:
            # a headless worker: its engines' readiness is the test
            self.post(ClusterSeen(True, self.view.data_parallel_size))
            return
        try:
            results = await asyncio.gather(*(self._get(c, "/readyz", 1.0) for c in apis))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        self.post(self._judge(results))

    def _judge(self, results: list[tuple[int, bytes]]) -> ClusterSeen:
        """Routability of the cluster from API servers' /readyz answers (all of them)."""
        size = self.view.data_parallel_size  # the ranks the deployment starts with (--data-parallel-size)
        ok = True
        alive = size
        for status, body in results:
            info = msgspec.json.decode(body) if body else {}
            routable, eligible = set(info.get("routable_ranks", [])), info.get("eligible_ranks", [None])
            alive = min(alive, len(info.get("alive_ranks", [])))
            # every starting rank it routes to; slots past the starting size are for ranks that may join
            ok = ok and status == 200 and all(r in routable for r in eligible if r is None or r < size)
        return ClusterSeen(ok and alive >= size, alive)

    async def _probe(self, child: Child) -> None:
        view = self.view
        name, pid = child.name, child.pid
        started = time.monotonic()
        unroutable: tuple[int, ...] = ()
        if child.kind == "api":
            ok, detail, ready = await self._probe_api(child)
            unroutable = self._unroutable(child.name)
            if unroutable:
                detail += f"; cannot route to rank(s) {', '.join(map(str, unroutable))}"
        else:
            age = started - child.last_heartbeat
            ok = age <= view.heartbeat_interval_s + view.probe_timeout_s
            detail = f"last heartbeat {age:.1f} s ago"
            ready = ok
        latency_ms = round((time.monotonic() - started) * 1000, 1)
        self.post(ProbeResult(name, pid, ok, ready, detail, latency_ms, time.time(), unroutable))

    def _unroutable(self, name: str) -> tuple[int, ...]:
        """The ranks an API server's last /readyz says it cannot route to (alive, not routable there)."""
        _, body = self._readyz.get(name, (0, b""))
        try:
            rows = msgspec.json.decode(body).get("unroutable_ranks", []) if body else []
            return tuple(int(row["rank"]) for row in rows)
        except (msgspec.DecodeError, AttributeError, TypeError, KeyError, ValueError):
            return ()

    async def _probe_api(self, child: Child) -> tuple[bool, str, bool]:
        timeout = self.view.probe_timeout_s
        try:
            status, _ = await self._get(child, "/health", timeout)
            if status != 200:
                return False, f"/health answered {status}", False
            status, body = await self._get(child, "/readyz", timeout)
            self._readyz[child.name] = (status, body)
            return True, "ok" if status == 200 else f"/readyz answered {status}", status == 200
        except asyncio.TimeoutError:
            return False, f"/health timed out after {timeout} s", False
        except (aiohttp.ClientError, OSError) as exc:
            return False, f"/health failed: {exc}", False
