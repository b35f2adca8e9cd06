"""Read-only views of the node: what /health, /readyz, /status, /metrics, the
prober and systemd's STATUS= line see. Nothing here changes a child record;
the health server and the prober get a NodeView, never the supervisor."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from ..children import Child, ChildState

if TYPE_CHECKING:
    from .core import Supervisor


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
            # One failed probe is a blip; the child is unhealthy once it reaches the threshold.
            if c.state != ChildState.READY or c.consecutive_failures >= self.probe_failure_threshold:
                bad.append({"name": c.name, "state": c.state.value, "consecutive_failures": c.consecutive_failures, "last_exit": c.last_exit or None})
        return bad

    def node_ready(self) -> tuple[bool, str]:
        if self.phase != "serving":
            return False, self.phase
        if self._sup.cfg.runs_api_servers and not any(c.state == ChildState.READY for c in self.children("api")):
            return False, "no API server is ready"
        if not any(c.state == ChildState.READY for c in self.children("engine")):
            return False, "no rank is ready"
        return True, ""

    def status_line(self) -> str:
        sup = self._sup
        engines = self.children("engine")
        apis = self.children("api")
        ready_e = sum(c.state == ChildState.READY for c in engines)
        ready_a = sum(c.state == ChildState.READY for c in apis)
        text = f"{ready_e}/{len(engines)} ranks ready, {ready_a}/{len(apis)} API servers ready"
        if sup.cfg.is_multi_node:
            text = f"{ready_e}/{len(engines)} local ranks ready"
            if apis:
                text += f", {ready_a}/{len(apis)} API servers ready, {sup.num_alive_ranks}/{self.data_parallel_size} ranks registered"
        if self.phase == "starting":
            loading = [str(c.rank) for c in engines if c.state == ChildState.STARTING]
            if loading:
                text += f", loading rank {','.join(loading)}"
        elif self.phase == "serving":
            text = (f"serving on port {sup.port}: " if apis else "serving: ") + text
        return text

    def status_dict(self) -> dict:
        sup = self._sup
        now = time.monotonic()
        ready, reason = self.node_ready()
        return {
            "phase": self.phase,
            "ready": ready,
            "reason": reason,
            "pid": os.getpid(),
            "port": sup.port,
            "supervisor_port": sup.health.port,
            "model": sup.cfg.served_model_name,
            "data_parallel_size": self.data_parallel_size,
            "api_server_count": sup.cfg.api_server_count,
            "children": [c.as_dict(now) for c in self.children()],
            "launcher": sup.launcher.as_dict() if sup.launcher is not None else None,
        }
