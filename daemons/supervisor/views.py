"""Read-only views of the node: what /health, /readyz, /status, /metrics, the
prober and systemd's STATUS= line see. Nothing here changes a child record;
the health server and the prober get a NodeView, never the supervisor."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from dpserve.daemons.coordinator.routing import routed_by
from dpserve.daemons.supervisor.children import Child, ChildState

if TYPE_CHECKING:
    from dpserve.daemons.supervisor.core import Supervisor


class NodeView:
    def __init__(self, sup: Supervisor) -> None:
        self._sup = sup
        cfg = sup.cfg
        self.data_parallel_size = cfg.data_parallel_size
        self.probe_interval_s = cfg.probe_interval_s
        self.probe_timeout_s = cfg.probe_timeout_s
        self.probe_failure_threshold = cfg.probe_failure_threshold
        self.heartbeat_interval_s = sup.heartbeat_interval_s

    @property
    def phase(self) -> str:
        return self._sup.phase

    def children(self, kind: str | None = None) -> list[Child]:
        """The child records (read them, never write them), optionally of one kind."""
        return [c for c in self._sup.children.values() if kind is None or c.kind == kind]

    def is_up(self, child: Child) -> bool:
        """Running and passing its probes (dpserve_child_up)."""
        return child.state in (ChildState.READY, ChildState.STARTING) and child.consecutive_failures < self.probe_failure_threshold

    def unhealthy_children(self) -> list[dict]:
        bad = []
        for c in self.children():
            if self.phase == "starting" and c.state in (ChildState.NEW, ChildState.STARTING):
                continue
            if c.drained:
                continue  # down on purpose (`dpserve drain`): /status says so, /health need not
            # One failed probe is a blip; the child is unhealthy once it reaches the threshold.
            if c.state != ChildState.READY or c.consecutive_failures >= self.probe_failure_threshold:
                bad.append({"name": c.name, "state": c.state.value, "consecutive_failures": c.consecutive_failures, "last_exit": c.last_exit or None})
        return bad

    # ------------------------------------------------------------ the cluster

    @property
    def cluster(self):
        return self._sup.cluster

    @property
    def min_ready_ranks(self) -> int:
        """Routable ranks this node's API servers need to be ready (--min-ready-ranks, 0: one)."""
        return min(self._sup.cfg.min_ready_ranks or 1, len(self._sup.cfg.eligible_ranks()))

    def node_ready(self) -> tuple[bool, str]:
        """The one readiness verdict: /readyz, /status, the STATUS= line and `dpserve status` read it."""
        cfg = self._sup.cfg
        if self.phase != "serving":
            return False, self.phase
        if cfg.runs_api_servers and not any(c.state == ChildState.READY for c in self.children("api")):
            return False, "no API server is ready"
        if not any(c.state == ChildState.READY for c in self.children("engine")):
            return False, "no local rank is ready"
        cluster = self.cluster
        if not cluster.head_reached:
            return False, "the head has not been reached yet: no load table from the coordinator"
        if not cluster.head_connected:
            return False, f"lost the head: no load table from the coordinator for {cluster.head_silence_s:.0f} s"
        if cfg.runs_api_servers:
            eligible = cfg.eligible_ranks()
            routable, need = cluster.routable(eligible), self.min_ready_ranks
            if routable < need:
                return False, f"{routable}/{self.num_members(eligible)} ranks routable, below --min-ready-ranks {need}"
        return True, ""

    def num_members(self, ranks: list[int]) -> int:
        """Members of the cluster among `ranks` (all of them: the deployment's size now)."""
        cluster = self.cluster
        if len(ranks) == cluster.size:
            return cluster.num_members
        return sum(cluster.is_member(cluster.ranks[r]) for r in ranks)

    def unroutable(self) -> dict[str, list[int]]:
        """API server name -> ranks alive in the table that it cannot route to, from its
        last /readyz probe (a rank whose sends fail there, or whose hello it never took)."""
        return {c.name: c.last_probe["unroutable_ranks"] for c in self.children("api")
                if c.state == ChildState.READY and c.last_probe.get("unroutable_ranks")}

    def readiness(self) -> dict:
        ready, reason = self.node_ready()
        cluster = self.cluster
        return {
            "unroutable": self.unroutable(),
            "status": "ready" if ready else "not ready",
            "phase": self.phase,
            "reason": reason,
            "ranks_routable": cluster.routable(),
            "ranks_registered": cluster.count("registered") + cluster.count("ready"),
            "ranks_lost": cluster.count("lost"),
            "ranks_drained": cluster.count("drained"),
            "data_parallel_size": cluster.num_members,
            "data_parallel_size_max": cluster.size,
            "min_ready_ranks": self.min_ready_ranks if self._sup.cfg.runs_api_servers else 0,
            "head_connected": cluster.head_connected,
        }

    def status_line(self) -> str:
        sup = self._sup
        engines = self.children("engine")
        apis = self.children("api")
        ready_e = sum(c.state == ChildState.READY for c in engines)
        ready_a = sum(c.state == ChildState.READY for c in apis)
        text = f"{ready_e}/{len(engines)} ranks ready, {ready_a}/{len(apis)} API servers ready"
        if sup.cfg.is_multi_node:
            cluster = self.cluster
            text = f"{ready_e}/{len(engines)} local ranks ready"
            if apis:
                text += f", {ready_a}/{len(apis)} API servers ready"
            registered = cluster.count("registered") + cluster.count("ready")
            text += f", {registered}/{cluster.num_members} ranks registered, {cluster.routable()} routable"
            lost, drained = cluster.count("lost"), cluster.count("drained")
            if lost:
                text += f", {lost} lost"
            if drained:
                text += f", {drained} drained"
            if not cluster.head_connected and self.phase != "starting":
                text += ", HEAD LOST" if cluster.head_reached else ", head not reached yet"
        if self.phase == "starting":
            loading = [str(c.rank) for c in engines if c.state == ChildState.STARTING]
            if loading:
                text += f", loading rank {','.join(loading)}"
        elif self.phase == "serving":
            ready, reason = self.node_ready()
            text = (f"serving on port {sup.port}: " if apis else "serving: ") + text
            if not ready:
                text += f"; NOT READY: {reason}"
        return text

    def rank_rows(self, wall: float) -> list[dict]:
        """Every rank of the deployment (README "Status" documents the fields)."""
        local = set(self._sup.cfg.local_ranks)
        not_routed: dict[int, list[str]] = {}
        for name, ranks in self.unroutable().items():
            for rank in ranks:
                not_routed.setdefault(rank, []).append(name)
        rows = []
        for r in self.cluster.members:
            e = r.load
            rows.append({
                "rank": r.rank,
                "node": e.node_rank if e.node_rank >= 0 else None,
                "host": e.host or None,
                "address": e.address or None,
                "local": r.rank in local,
                "state": r.state,
                "since": round(r.since, 3),
                "for_s": round(max(0.0, wall - r.since), 1),
                "reason": e.down_reason if r.state in ("lost", "drained") else "",
                "running": e.num_running,
                "waiting": e.num_waiting,
                "waiting_prefill_tokens": e.num_waiting_prefill_tokens,
                "remaining_decode_tokens": e.num_remaining_decode_tokens,
                "kv_cache_usage_perc": round(e.kv_usage, 4),
                "requests_finished": e.num_requests_finished,
                "requests_aborted": e.num_requests_aborted,
                "preemptions": e.num_preemptions,
                "routed_by": routed_by(self._sup.cfg.lb_mode, r.rank, e.node_rank),
                "not_routed_by": not_routed.get(r.rank, []),  # this node's API servers that cannot route to it now
            })
        return rows

    def _child_dict(self, child: Child, now: float) -> dict:
        d = child.as_dict(now)
        if child.kind == "api":
            # `rank` is the DP rank everywhere: an API server has none, it routes to some.
            cfg = self._sup.cfg
            d["rank"] = None
            d["index"] = child.rank
            d["routes_to"] = [cfg.data_parallel_start_rank + child.rank] if cfg.lb_mode == "external" else cfg.eligible_ranks()
        return d

    def status_dict(self) -> dict:
        sup = self._sup
        cfg = sup.cfg
        now, wall = time.monotonic(), time.time()
        cluster = self.cluster
        readiness = self.readiness()
        return {
            "phase": self.phase,
            "ready": readiness["status"] == "ready",
            "reason": readiness["reason"],
            "pid": os.getpid(),
            "role": cfg.role,
            "node_rank": cfg.data_parallel_start_rank,
            "node_address": getattr(sup, "node_address", "") or None,
            "local_ranks": list(cfg.local_ranks),
            "port": sup.port if cfg.runs_api_servers else None,
            "supervisor_port": sup.health.port,
            "model": cfg.served_model_name,
            "data_parallel_size": cluster.num_members,  # the ranks of the deployment now (members)
            "data_parallel_size_max": cluster.size,
            "lb_mode": cfg.lb_mode,
            "api_server_count": cfg.api_server_count if cfg.runs_api_servers else 0,
            "cluster": {
                "head_connected": cluster.head_connected,
                "head_reached": cluster.head_reached,
                "head_since": round(cluster.head_since, 3),
                "last_table_age_s": round(now - cluster.last_table_at, 1) if cluster.last_table_at else None,
                "ranks_routable": readiness["ranks_routable"],
                "ranks_registered": readiness["ranks_registered"],
                "ranks_lost": readiness["ranks_lost"],
                "ranks_drained": readiness["ranks_drained"],
                "ranks_absent": cluster.count("absent"),
                "unroutable": readiness["unroutable"],
                "min_ready_ranks": readiness["min_ready_ranks"],
                "ranks": self.rank_rows(wall),
            },
            "children": [self._child_dict(c, now) for c in self.children()],
            "launcher": sup.launcher.as_dict() if sup.launcher is not None else None,
        }
