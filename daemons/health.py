"""The node's aggregated health port (default 9256): /health, /readyz, /status, /metrics.

It listens from the supervisor's first second, so an operator or router can
see a node that is loading, degraded or stopping, not just a dark port.
Reads the supervisor's state; never changes it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from .children import ChildState

if TYPE_CHECKING:
    from .supervisor import Supervisor

_encode = msgspec.json.Encoder().encode


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


class HealthServer:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/ready", self.readyz)
        app.router.add_get("/status", self.status)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_port=False)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        bad = self.sup.unhealthy_children()
        if bad:
            return _json({"status": "unhealthy", "unhealthy": bad}, 503)
        return _json({"status": "ok", "phase": self.sup.phase})

    async def readyz(self, request: web.Request) -> web.Response:
        ready, reason = self.sup.node_ready()
        body = {"status": "ready" if ready else "not ready", "phase": self.sup.phase, "reason": reason}
        return _json(body, 200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        return _json(self.sup.status_dict())

    async def metrics(self, request: web.Request) -> web.Response:
        sup = self.sup
        now = time.monotonic()
        lines = [
            "# HELP dpserve_child_up 1 when the child process is running and passes its probes.",
            "# TYPE dpserve_child_up gauge",
        ]
        children = list(sup.children.values())
        for c in children:
            up = 1 if c.state in (ChildState.READY, ChildState.STARTING) and c.consecutive_failures < sup.cfg.probe_failure_threshold else 0
            lines.append(f'dpserve_child_up{{child="{c.name}",kind="{c.kind}"}} {up}')
        lines += ["# HELP dpserve_child_restarts_total Restarts of each child.", "# TYPE dpserve_child_restarts_total counter"]
        lines += [f'dpserve_child_restarts_total{{child="{c.name}",kind="{c.kind}"}} {c.restarts}' for c in children]
        lines += ["# HELP dpserve_child_probe_failures_total Failed probes of each child.", "# TYPE dpserve_child_probe_failures_total counter"]
        lines += [f'dpserve_child_probe_failures_total{{child="{c.name}",kind="{c.kind}"}} {c.probe_failures_total}' for c in children]
        lines += ["# HELP dpserve_child_uptime_seconds Seconds since the child started.", "# TYPE dpserve_child_uptime_seconds gauge"]
        lines += [f'dpserve_child_uptime_seconds{{child="{c.name}",kind="{c.kind}"}} {c.uptime(now):.3f}' for c in children]
        engines = [c for c in children if c.kind == "engine"]
        lines += ["# HELP dpserve_rank_running Running sequences per local rank.", "# TYPE dpserve_rank_running gauge"]
        lines += [f'dpserve_rank_running{{rank="{c.rank}"}} {c.num_running}' for c in engines]
        lines += ["# HELP dpserve_rank_waiting Waiting requests per local rank.", "# TYPE dpserve_rank_waiting gauge"]
        lines += [f'dpserve_rank_waiting{{rank="{c.rank}"}} {c.num_waiting}' for c in engines]
        lines += ["# HELP vllm:kv_cache_usage_perc KV-cache usage per local rank (1 = every block in use).", "# TYPE vllm:kv_cache_usage_perc gauge"]
        lines += [f'vllm:kv_cache_usage_perc{{rank="{c.rank}"}} {c.kv_usage:.4f}' for c in engines]
        ready, _ = sup.node_ready()
        lines += ["# HELP dpserve_node_ready 1 when the node serves.", "# TYPE dpserve_node_ready gauge", f"dpserve_node_ready {int(ready)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")
