"""The node's aggregated health port (default 9256): /health, /readyz, /status, /metrics.

It listens from the supervisor's first second, so an operator or router can
see a node that is loading, degraded or stopping, not just a dark port.
Reads a NodeView; never changes the node's state.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .supervisor.views import NodeView

_encode = msgspec.json.Encoder().encode


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


class NodeCollector:
    """The node's children as Prometheus metrics, read from the view at scrape time.

    Names, labels and values are a contract with existing dashboards: keep them.
    """

    def __init__(self, view: NodeView) -> None:
        self.view = view

    def collect(self):
        view = self.view
        now = time.monotonic()
        children = view.children()
        by_child = ["child", "kind"]
        up = GaugeMetricFamily("dpserve_child_up", "1 when the child process is running and passes its probes.", labels=by_child)
        restarts = CounterMetricFamily("dpserve_child_restarts", "Restarts of each child.", labels=by_child)
        failures = CounterMetricFamily("dpserve_child_probe_failures", "Failed probes of each child.", labels=by_child)
        uptime = GaugeMetricFamily("dpserve_child_uptime_seconds", "Seconds since the child started.", labels=by_child)
        for c in children:
            labels = [c.name, c.kind]
            up.add_metric(labels, int(view.is_up(c)))
            restarts.add_metric(labels, c.restarts)
            failures.add_metric(labels, c.probe_failures_total)
            uptime.add_metric(labels, round(c.uptime(now), 3))
        yield from (up, restarts, failures, uptime)
        running = GaugeMetricFamily("dpserve_rank_running", "Running sequences per local rank.", labels=["rank"])
        waiting = GaugeMetricFamily("dpserve_rank_waiting", "Waiting requests per local rank.", labels=["rank"])
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage per local rank (1 = every block in use).", labels=["rank"])
        for c in view.children("engine"):
            running.add_metric([str(c.rank)], c.num_running)
            waiting.add_metric([str(c.rank)], c.num_waiting)
            kv.add_metric([str(c.rank)], round(c.kv_usage, 4))
        yield from (running, waiting, kv)
        yield GaugeMetricFamily("dpserve_node_ready", "1 when the node serves.", value=int(view.node_ready()[0]))


class HealthServer:
    def __init__(self, view: NodeView) -> None:
        self.view = view
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(view))
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
        bad = self.view.unhealthy_children()
        if bad:
            return _json({"status": "unhealthy", "unhealthy": bad}, 503)
        return _json({"status": "ok", "phase": self.view.phase})

    async def readyz(self, request: web.Request) -> web.Response:
        ready, reason = self.view.node_ready()
        body = {"status": "ready" if ready else "not ready", "phase": self.view.phase, "reason": reason}
        return _json(body, 200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        return _json(self.view.status_dict())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
