"""The node's stop, after the loop has ended: one deadline per group, in order.

API servers first (the listening sockets close at once, so new connections
are refused rather than queued; in-flight requests drain), then the launcher,
then engines and the coordinator, then the Ray backend's placement group;
survivors of a deadline get SIGKILL.
The loop no longer runs, so this is the only writer of child state here.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from typing import TYPE_CHECKING

from dpserve.daemons.supervisor.children import Child
from dpserve.daemons.supervisor.events import Spawned

if TYPE_CHECKING:
    from dpserve.daemons.supervisor.core import Supervisor


def stop_relays(sup: Supervisor) -> None:
    """The node's relays (relays.py): after its ranks and API servers, never before."""
    for relay in (sup.load_relay, sup.table_relay):
        if relay is not None:
            relay.stop()
    sup.load_relay = sup.table_relay = None


async def shutdown(sup: Supervisor) -> None:
    sup.phase = "stopping"
    sup.notifier.stopping("stopping: draining API servers")
    for sock in sup.listen_socks:
        sock.close()
    pinger = asyncio.create_task(_keep_watchdog_fed(sup))
    sup.tasks.append(pinger)
    await _adopt_spawns_in_flight(sup)
    cfg = sup.cfg
    apis = [c for c in sup.children.values() if c.kind == "api" and _alive(c)]
    for child in apis:
        sup.terminate(child, kill_after=cfg.shutdown_timeout_s + cfg.kill_grace_s)
    await _wait_all(sup, apis, cfg.shutdown_timeout_s + cfg.kill_grace_s)
    if sup.launcher is not None:
        await sup.launcher.stop()
    sup.notifier.status("stopping: engines")
    rest = [c for c in sup.children.values() if _alive(c) and c.kind != "placement"]
    for child in rest:
        sup.terminate(child, kill_after=cfg.kill_grace_s)
    await _wait_all(sup, rest, cfg.kill_grace_s)
    # Ray backend: the placement group last (removing it kills the actors in it)
    holders = [c for c in sup.children.values() if _alive(c)]
    for child in holders:
        sup.terminate(child, kill_after=cfg.kill_grace_s)
    await _wait_all(sup, holders, cfg.kill_grace_s)
    for task in sup.tasks:
        task.cancel()
    await asyncio.gather(*sup.tasks, return_exceptions=True)
    await sup.health.stop()
    stop_relays(sup)
    sup.zctx.destroy(linger=0)
    if sup.own_run_dir:
        shutil.rmtree(sup.run_dir, ignore_errors=True)
    sup.log.info("stopped", exit_code=sup.exit_code)


def _alive(child: Child) -> bool:
    return child.proc is not None and child.proc.returncode is None


async def _adopt_spawns_in_flight(sup: Supervisor) -> None:
    """A process a spawn task is still starting must be stopped too: wait for the
    spawns (the launcher answers within its own timeout) and record their pids."""
    if sup.spawn_tasks:
        await asyncio.wait(list(sup.spawn_tasks), timeout=35)
    while not sup.events.empty():
        event = sup.events.get_nowait()
        if isinstance(event, Spawned):
            sup.apply(event)


async def _keep_watchdog_fed(sup: Supervisor) -> None:
    """systemd re-arms its watchdog on every ping, so one sent as the stop began
    would kill a drain longer than WatchdogSec."""
    while True:
        sup.feed_watchdog(time.monotonic())
        await asyncio.sleep(0.5)


async def _wait_all(sup: Supervisor, children: list[Child], timeout: float) -> None:
    """One deadline for the group; survivors get SIGKILL, then are reaped."""
    procs = [c.proc for c in children if c.proc is not None]
    if not procs:
        return
    _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout)
    if pending:
        for child in children:
            if _alive(child):
                sup.log.warning("killing child that did not stop", child=child.name, pid=child.pid)
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        await asyncio.wait(pending, timeout=5)
