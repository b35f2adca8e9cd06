"""Liveness and readiness probes of every child, every probe interval.

API servers are probed over HTTP (/health for liveness, /readyz for
readiness) on their private unix socket, because behind the shared port a
probe would reach a random API server (vLLM #35066). Engines and the
coordinator are judged by heartbeats that only their working loop sends.
`failure threshold` consecutive failures post a ("dead", ...) event; the
supervisor's main loop acts on it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import aiohttp
import msgspec

from .children import Child, ChildState

if TYPE_CHECKING:
    from .supervisor import Supervisor


class Prober:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.all_ranks_routable = False
        self.num_alive_ranks = 0  # as the API servers see the cluster (coordinator's table)
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

    async def check_routable(self) -> None:
        """During startup: does every API server route to every rank it should,
        and does the cluster hold all data-parallel-size ranks?"""
        size = self.sup.cfg.data_parallel_size
        apis = [c for c in self.sup.children.values() if c.kind == "api"]
        if not apis:
            self.all_ranks_routable = True  # a headless worker: its engines' readiness is the test
            return
        try:
            results = await asyncio.gather(*(self._get(c, "/readyz", 1.0) for c in apis))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        self._judge(results, size)

    def _judge(self, results: list[tuple[int, bytes]], size: int) -> None:
        """Routability of the cluster from API servers' /readyz answers (all of them)."""
        ok = True
        alive = size
        for status, body in results:
            info = msgspec.json.decode(body) if body else {}
            routable, eligible = info.get("routable_ranks", []), info.get("eligible_ranks", [None])
            alive = min(alive, len(info.get("alive_ranks", [])))
            ok = ok and status == 200 and routable == eligible
        self.num_alive_ranks = alive
        self.all_ranks_routable = ok and alive == size

    async def run(self) -> None:
        sup = self.sup
        interval = sup.cfg.probe_interval_s
        try:
            while True:
                await asyncio.sleep(interval)
                children = [c for c in sup.children.values() if c.state == ChildState.READY]
                self._readyz.clear()
                await asyncio.gather(*(self._probe(c) for c in children))
                # The probes' own /readyz answers say what the cluster looks like;
                # asking again would wait on a hung API server a second time.
                apis = [c for c in sup.children.values() if c.kind == "api"]
                if apis and len(self._readyz) == len(apis):
                    self._judge(list(self._readyz.values()), sup.cfg.data_parallel_size)
        finally:
            for session in self._sessions.values():
                await session.close()

    async def _probe(self, child: Child) -> None:
        sup = self.sup
        pid = child.pid
        started = time.monotonic()
        if child.kind == "api":
            ok, detail, ready = await self._probe_api(child)
        else:
            age = started - child.last_heartbeat
            ok = age <= sup.cfg.probe_interval_s
            detail = f"last heartbeat {age:.1f} s ago"
            ready = ok
        if child.pid != pid or child.state != ChildState.READY:
            return  # the child changed while we probed; this verdict is stale
        child.last_probe = {
            "at": time.time(),
            "ok": ok,
            "ready": ready,
            "detail": detail,
            "latency_ms": round((time.monotonic() - started) * 1000, 1),
        }
        if ok:
            child.consecutive_failures = 0
            return
        child.consecutive_failures += 1
        child.probe_failures_total += 1
        sup.log.warning("probe failed", child=child.name, detail=detail, consecutive=child.consecutive_failures)
        if child.consecutive_failures >= sup.cfg.probe_failure_threshold:
            sup.events.put_nowait(("dead", child, pid, f"{child.consecutive_failures} failed probes: {detail}"))

    async def _probe_api(self, child: Child) -> tuple[bool, str, bool]:
        timeout = self.sup.cfg.probe_timeout_s
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
