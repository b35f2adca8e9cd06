"""The node's aggregated health port (default 9256): /health, /readyz, /status, /metrics,
and POST /drain, /undrain (draining.py: checked there, applied by the loop).

It listens from the supervisor's first second, so an operator or router can
see a node that is loading, degraded or stopping, not just a dark port.
Reads a NodeView; never changes the node's state itself.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web
from dpserve.daemons.supervisor.cluster import RANK_STATES
from dpserve.daemons.supervisor.views import NodeView
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage per rank of the cluster (1 = every block in use).", labels=["rank"])
        kv_by_rank = {r.rank: r.load.kv_usage for r in view.cluster.members if r.state != "absent"}
        for c in view.children("engine"):
            running.add_metric([str(c.rank)], c.num_running)
            waiting.add_metric([str(c.rank)], c.num_waiting)
            kv_by_rank[c.rank] = c.kv_usage  # a local rank's own heartbeat is the freshest
        for rank in sorted(kv_by_rank):
            kv.add_metric([str(rank)], round(kv_by_rank[rank], 4))
        yield from (running, waiting, kv)
        yield GaugeMetricFamily("dpserve_node_ready", "1 when the node serves.", value=int(view.node_ready()[0]))
        yield from cluster_metrics(view)


def cluster_metrics(view: NodeView):
    """Every rank of the deployment, from the coordinator's table: one scrape of
    any node (the head, typically) sees the whole cluster. vLLM's names where
    vLLM has one (vllm:num_requests_running/waiting, label `rank` as above)."""
    cluster = view.cluster
    wall = time.time()
    yield GaugeMetricFamily("dpserve_cluster_data_parallel_size", "Ranks of the deployment now: those it started with and those that joined, less the retired.", value=cluster.num_members)
    yield GaugeMetricFamily("dpserve_cluster_data_parallel_size_max", "Ranks the deployment may grow to (--data-parallel-size-max).", value=cluster.size)
    yield GaugeMetricFamily("dpserve_cluster_ranks_routable", "Ranks in the coordinator's routing table (0 while the head is lost).", value=cluster.routable())
    yield GaugeMetricFamily("dpserve_cluster_min_ready_ranks", "Routable ranks this node's /readyz needs (0: it runs no API server).", value=view.readiness()["min_ready_ranks"])
    yield GaugeMetricFamily("dpserve_cluster_head_connected", "1 while this node receives the coordinator's load table.", value=int(cluster.head_connected))
    by_state = GaugeMetricFamily("dpserve_cluster_ranks", "Ranks in each state (absent, registered, ready, lost).", labels=["state"])
    for state in RANK_STATES:
        by_state.add_metric([state], cluster.count(state))
    yield by_state
    labels = ["rank", "node"]
    state = GaugeMetricFamily("dpserve_cluster_rank_state", "1 for the rank's current state, 0 for the others.", labels=[*labels, "state"])
    state_s = GaugeMetricFamily("dpserve_cluster_rank_state_seconds", "Seconds the rank has been in its current state.", labels=labels)
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests running on each rank of the cluster.", labels=labels)
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting on each rank of the cluster.", labels=labels)
    finished = CounterMetricFamily("dpserve_cluster_rank_requests_finished", "Requests finished by each rank (its current incarnation).", labels=labels)
    for r in cluster.members:
        lv = [str(r.rank), str(r.load.node_rank) if r.load.node_rank >= 0 else ""]
        for s in RANK_STATES:
            state.add_metric([*lv, s], int(r.state == s))
        state_s.add_metric(lv, round(max(0.0, wall - r.since), 1))
        running.add_metric(lv, r.load.num_running)
        waiting.add_metric(lv, r.load.num_waiting)
        finished.add_metric(lv, r.load.num_requests_finished)
    yield from (state, state_s, running, waiting, finished)


class HealthServer:
    def __init__(self, view: NodeView, admin=None) -> None:
        self.view = view
        self.admin = admin  # draining.DrainEndpoints: the only verbs that ask the node to change
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
        if self.admin is not None:
            self.admin.add_routes(app)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_port=False)
        await site.start()
        self.port = self.runner.addresses[0][1]
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
        body = self.view.readiness()
        return _json(body, 200 if body["status"] == "ready" else 503)

    async def status(self, request: web.Request) -> web.Response:
        return _json(self.view.status_dict())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
