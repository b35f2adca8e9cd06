"""Prometheus metrics of one API server, plus the cluster's per-rank view from the load table.

Per-rank figures (finished requests, running, waiting, alive) come from the
coordinator's table, so every API server behind the shared port answers a
scrape with the same cluster-wide numbers. Counters owned by this process
are labelled with its index; vLLM's request metrics (request_metrics.py) are
the node's API servers' sum, whichever of them answers.
"""

from __future__ import annotations

import os

from aiohttp import web
from dpserve.daemons.api.request_metrics import RequestMetrics
from dpserve.daemons.api.router import Router
from dpserve.daemons.config import ApiServerConfig
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _RankCollector:
    def __init__(self, router: Router, model_name: str) -> None:
        self.router = router
        self.model_name = model_name

    def collect(self):
        finished = CounterMetricFamily(
            "dpserve_rank_requests_finished", "Requests finished by each rank (current incarnation).", labels=["rank"]
        )
        aborted = CounterMetricFamily(
            "dpserve_rank_requests_aborted", "Requests aborted on each rank by their API server (client gone, stop string).", labels=["rank"]
        )
        running = GaugeMetricFamily("dpserve_rank_running", "Running sequences per rank.", labels=["rank"])
        waiting = GaugeMetricFamily("dpserve_rank_waiting", "Waiting requests per rank.", labels=["rank"])
        alive = GaugeMetricFamily("dpserve_rank_routable", "1 when this API server routes to the rank.", labels=["rank"])
        inflight = GaugeMetricFamily("dpserve_api_in_flight", "This API server's requests in flight on each rank.", labels=["rank"])
        # vLLM's names, so dashboards built for vLLM read dpserve's ranks too.
        # (rank first, as before; vLLM's model_name and engine too, which its dashboards filter on)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage per rank (1 = every block in use).", labels=["rank", "model_name", "engine"])
        preempted = CounterMetricFamily("vllm:num_preemptions", "Sequences preempted for KV blocks per rank (current incarnation).", labels=["rank"])
        # Prefix caching, in tokens (exposed with _total): the hit rate is hits / queries.
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache per rank (current incarnation).", labels=["rank"])
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache per rank (current incarnation).", labels=["rank"])
        # vLLM's scheduler gauges with vLLM's labels (engine: the rank)
        vllm_running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=["model_name", "engine"])
        vllm_waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=["model_name", "engine"])
        for rank, load in enumerate(self.router.loads):
            label = [str(rank)]
            alive.add_metric(label, 1.0 if self.router.routable(rank) else 0.0)
            inflight.add_metric(label, self.router.inflight[rank])
            if load is None:
                continue
            finished.add_metric(label, load.num_requests_finished)
            aborted.add_metric(label, load.num_requests_aborted)
            running.add_metric(label, load.num_running)
            waiting.add_metric(label, load.num_waiting)
            vllm_running.add_metric([self.model_name, str(rank)], load.num_running)
            vllm_waiting.add_metric([self.model_name, str(rank)], load.num_waiting)
            kv.add_metric([str(rank), self.model_name, str(rank)], load.kv_usage)
            preempted.add_metric(label, load.num_preemptions)
            queries.add_metric(label, load.num_prefix_queries)
            hits.add_metric(label, load.num_prefix_hits)
        yield from (finished, aborted, running, waiting, alive, inflight, kv, preempted, queries, hits, vllm_running, vllm_waiting)


class ApiMetrics:
    def __init__(self, cfg: ApiServerConfig, router: Router) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        idx = str(cfg.index)
        self.requests = Counter(
            "dpserve_api_requests",
            "Requests answered by this API server, by endpoint and HTTP status.",
            ["api_server", "endpoint", "status"],
            registry=self.registry,
        )
        self.routed = Counter(
            "dpserve_api_routed_requests", "Requests this API server sent to each rank.", ["api_server", "rank"], registry=self.registry
        )
        self.latency = Histogram(
            "dpserve_api_request_seconds",
            "End-to-end latency of generation requests.",
            ["api_server"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        ).labels(idx)
        self.registry.register(_RankCollector(router, cfg.served_model_name))
        # vLLM's request metrics, shared with the node's other API servers through the run directory
        probe_path = getattr(cfg, "probe_path", None)
        directory = os.path.join(os.path.dirname(probe_path), "request-metrics") if probe_path else None
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError:
                directory = None
        self.vllm = RequestMetrics(cfg.served_model_name, router.size, cfg.max_model_len, directory, cfg.index)
        self.registry.register(self.vllm)
        self._idx = idx
        self._req_children: dict[tuple[str, int], object] = {}
        self._routed_children = [self.routed.labels(idx, str(r)) for r in range(router.size)]

    def observe(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        key = (endpoint, status)
        child = self._req_children.get(key)
        if child is None:
            child = self._req_children[key] = self.requests.labels(self._idx, endpoint, str(status))
        child.inc()
        if seconds is not None:
            self.latency.observe(seconds)

    def requests_ended(self, gens, answered: bool) -> None:
        """vLLM's request metrics of a request's engine requests (generation.Generation), each
        observed once. One the engine did not finish was ended here: by a stop string when
        the response was answered ('stop'), else by the client or a failure ('abort')."""
        observe = self.vllm.observe
        for gen in gens:
            s = gen.state
            reason = s.finish_reason or ("stop" if answered else "abort")
            observe(s.rank, s.prompt_tokens, s.num_output_tokens, gen.params.max_tokens, reason,
                    s.t_sent, s.t_first, s.t_last, s.queue_s)

    def routed_to(self, rank: int) -> None:
        self._routed_children[rank].inc()

    async def handler(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
