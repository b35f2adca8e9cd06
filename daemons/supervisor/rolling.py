"""SIGHUP: restart the API servers one at a time, each replaced before the next stops;
`dpserve rolling-restart --ranks` (POST /rolling-restart): the same for the node's ranks.

A state machine the loop advances on every tick (no task of its own, so the
loop stays the only writer of child state): [fresh launcher] -> for each child
that is READY: stop it (planned restart) -> wait until its new process is READY
(a rank: and routable again in the coordinator's table) or the step's deadline
passes -> next -> done. A rank stops at once on its SIGTERM and its API servers
move its requests, so a rolling restart of ranks takes about ranks x restart
time, whatever the answers' lengths.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

from dpserve.daemons.supervisor.children import ChildState
from dpserve.daemons.supervisor.events import LauncherRestarted

if TYPE_CHECKING:
    from dpserve.daemons.supervisor.core import Supervisor


def begin(sup: Supervisor, kind: str = "api") -> RollingRestart:
    """A loop verb on SIGHUP (API servers) or a rolling-restart request (kind "engine"):
    tell systemd a reload began; API servers start with a fresh launcher."""
    sup.notifier.reloading()
    names = [c.name for c in sup.children.values() if c.kind == kind and not c.drained]
    sup.log.info("rolling restart of API servers" if kind == "api" else "rolling restart of ranks", count=len(names))
    if kind == "engine":
        return RollingRestart(names, wait_for_launcher=False)
    if sup.launcher is not None:
        # A fresh launcher first, so code upgraded on disk reaches the new API servers.
        sup.tasks.append(asyncio.create_task(_restart_launcher(sup), name="launcher-restart"))
    return RollingRestart(names, wait_for_launcher=sup.launcher is not None)


async def _restart_launcher(sup: Supervisor) -> None:
    try:
        await sup.launcher.restart(sys.stderr.buffer)
    except Exception as exc:  # API servers then start with exec
        sup.log.warning("cannot restart the prefork launcher", error=f"{type(exc).__name__}: {exc}")
    finally:
        sup.post(LauncherRestarted())


class RollingRestart:
    def __init__(self, names: list[str], wait_for_launcher: bool) -> None:
        self.pending = list(names)  # API servers not yet restarted, in order
        self.waiting_for_launcher = wait_for_launcher  # until LauncherRestarted arrives
        self.current = ""  # the API server being replaced now
        self.old_pid = 0
        self.deadline = 0.0

    def advance(self, sup: Supervisor, now: float) -> bool:
        """One step; True once every API server has been replaced (or skipped)."""
        if self.waiting_for_launcher:
            return False
        if self.current:
            child = sup.children[self.current]
            replaced = child.pid != self.old_pid and child.state == ChildState.READY
            if replaced and child.kind == "engine":  # routable again, not just loaded
                replaced = sup.cluster.ranks[child.rank].state == "ready"
            if not replaced and now < self.deadline:
                return False
            self.current = ""
        while self.pending:
            child = sup.children[self.pending.pop(0)]
            if child.state != ChildState.READY:
                continue  # down or restarting anyway
            cfg = sup.cfg
            if child.kind == "engine":
                stop_s, start_s = cfg.kill_grace_s, cfg.engine_startup_timeout_s
            else:
                stop_s, start_s = cfg.shutdown_timeout_s + cfg.kill_grace_s, cfg.api_server_startup_timeout_s
            self.current, self.old_pid = child.name, child.pid
            self.deadline = now + stop_s + start_s
            child.restart_requested = True
            sup.terminate(child, kill_after=stop_s)
            return False
        return True
