"""The node's start: every child spawned at once, each against its own deadline.

While the node starts, systemd hears STATUS= lines and EXTEND_TIMEOUT_USEC=
so the unit's start timeout follows the slowest child's budget; READY=1
comes once every child is READY and every API server routes to every rank
of the cluster. A child that dies or is late halts the node (exit 2 or 3):
restarting cannot fix a model that does not load.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from dpserve.daemons.supervisor.children import Child, ChildState
from dpserve.engine.common.procutil import EXIT_STARTUP

if TYPE_CHECKING:
    from dpserve.daemons.config import ServeConfig
    from dpserve.daemons.supervisor.core import Supervisor

EXTEND_EVERY_S = 5.0


def timeout(cfg: ServeConfig, child: Child) -> float:
    """The child's startup budget; API servers' scales with their count (config.py)."""
    if child.kind == "placement":  # Ray backend: connect, then wait for the cluster's resources
        return cfg.ray_connect_timeout_s + cfg.ray_placement_timeout_s + 30.0
    if child.kind == "engine" and cfg.uses_ray:  # the actor waits for the placement group first
        return cfg.engine_startup_timeout_s + cfg.ray_connect_timeout_s + cfg.ray_placement_timeout_s
    return {"engine": cfg.engine_startup_timeout_s, "api": cfg.api_server_startup_timeout_s}.get(child.kind, cfg.coordinator_startup_timeout_s)


async def begin(sup: Supervisor) -> None:
    """Deadlines, the launcher, then a spawn task per child; the loop does the rest."""
    now = sup.clock()
    for child in sup.children.values():
        child.deadline = now + timeout(sup.cfg, child)
    if sup.launcher is not None:
        await sup.launcher.start(sys.stderr.buffer)  # an exec; API-server forks wait for its imports
    for child in sup.children.values():
        sup.spawn(child)
    sup.notifier.extend_timeout(max(c.deadline for c in sup.children.values()) - now + 5)
    sup.last_extend = now


def check(sup: Supervisor, now: float) -> None:
    """A loop verb while starting: READY=1 once every child serves and the cluster routes; a late child halts."""
    children = sup.children.values()
    if all(c.state == ChildState.READY for c in children) and sup.all_ranks_routable:
        sup.phase = "serving"
        status = sup.view.status_line()
        sup.notifier.ready(status)
        sup.log.info("node ready", status=status, seconds=round(now - min(c.started_at for c in children), 2))
        return
    late = [c for c in children if c.state != ChildState.READY and now > c.deadline]
    if late:
        sup.log.error("startup timed out", children=", ".join(c.name for c in late), timeouts_s={c.name: round(c.deadline - c.started_at, 1) for c in late})
        sup.stop(EXIT_STARTUP)
    elif now > max(c.deadline for c in children):
        sup.log.error("startup timed out waiting for the cluster", ranks_registered=sup.num_alive_ranks, data_parallel_size=sup.cfg.data_parallel_size)
        sup.stop(EXIT_STARTUP)
    elif now - sup.last_extend > EXTEND_EVERY_S:
        sup.notifier.extend_timeout(max(c.deadline for c in children) - now + 5)
        sup.last_extend = now
