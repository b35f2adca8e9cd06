"""The supervisor's child records and how a child process is started and stopped.

A Child is a small slotted record; the supervisor keeps them in one table
keyed by a readable name (coordinator, engine-dp0, api-1). Spawning passes
the child's typed config in the environment, hands the shared listening
socket to API servers, and pumps the child's stdout/stderr into the
supervisor's own log with the child's name on every line.
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import sys

from dpserve.engine.common.procutil import CHILD_CONFIG_ENV

_PRIO_PREFIX = re.compile(rb"^<[0-7]>")


class ChildState(enum.Enum):
    NEW = "new"  # not started yet
    STARTING = "starting"  # process runs, not yet ready
    READY = "ready"  # serving
    STOPPING = "stopping"  # asked to stop (SIGTERM sent)
    BACKOFF = "backoff"  # exited; waiting to be restarted
    EXITED = "exited"  # exited and stays down (shutdown, policy, or gave up)
    DRAINED = "drained"  # stopped by `dpserve drain`; stays down until `dpserve undrain` or a restart of the node


class Child:
    __slots__ = (
        "name",
        "kind",
        "rank",
        "module",
        "config_json",
        "pass_fds",
        "port",
        "probe_path",
        "proc",
        "pid",
        "state",
        "started_at",
        "ready_at",
        "restarts",
        "restart_times",
        "consecutive_failures",
        "probe_failures_total",
        "last_probe",
        "last_heartbeat",
        "last_exit",
        "next_start_at",
        "deadline",
        "gave_up",
        "spawning",
        "early",
        "num_running",
        "num_waiting",
        "kv_usage",
        "kill_requested",
        "restart_requested",
        "failure",
        "extra_env",
        "detail",
        "drained",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        rank: int,
        module: str,
        config_json: bytes,
        *,
        pass_fds=(),
        port: int = 0,
        probe_path: str = "",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind  # "coordinator" | "engine" | "api" | "placement" (the Ray backend's placement group)
        self.rank = rank  # DP rank for engines, index for API servers, -1 otherwise
        self.module = module
        self.config_json = config_json
        self.pass_fds = tuple(pass_fds)
        self.port = port
        self.probe_path = probe_path
        self.proc = None  # asyncio.subprocess.Process, or launcher.AdoptedProcess
        self.pid = 0
        self.state = ChildState.NEW
        self.started_at = 0.0
        self.ready_at = 0.0
        self.restarts = 0
        self.restart_times: list[float] = []
        self.consecutive_failures = 0
        self.probe_failures_total = 0
        self.last_probe: dict = {}
        self.last_heartbeat = 0.0
        self.last_exit = ""
        self.next_start_at = 0.0
        self.deadline = 0.0  # startup deadline, or kill deadline while STOPPING
        self.gave_up = ""  # why the supervisor gave up on it (policy.CANNOT_BOOT, CRASH_LOOP), or ""
        self.spawning = False  # a spawn task for it is in flight
        self.early: list = []  # Ready/Heartbeat news that came before the spawn task's Spawned
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.kill_requested = False
        self.restart_requested = False  # a planned restart (SIGHUP), not a crash
        self.failure = ""  # why the supervisor stopped this process for failing (probes, late start)
        self.extra_env = extra_env or {}
        self.detail = ""  # what the process said of itself when ready (a Ray rank: node, actor)
        self.drained = ""  # why it stays stopped (draining.DRAINED_REASON or RETIRED_REASON) until undrain

    @property
    def is_running(self) -> bool:
        return self.state in (ChildState.STARTING, ChildState.READY, ChildState.STOPPING)

    def uptime(self, now: float) -> float:
        return now - self.started_at if self.is_running else 0.0

    def as_dict(self, now: float) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "rank": self.rank,
            "pid": self.pid if self.is_running else None,
            "port": self.port or None,
            "state": self.state.value,
            "restarts": self.restarts,
            "consecutive_failures": self.consecutive_failures,
            "probe_failures_total": self.probe_failures_total,
            "last_probe": self.last_probe or None,
            "last_exit": self.last_exit or None,
            "uptime_s": round(self.uptime(now), 3),
            "running": self.num_running,
            "waiting": self.num_waiting,
            "kv_cache_usage_perc": round(self.kv_usage, 4),
            "detail": (self.detail or None) if self.is_running else None,
            "drained": self.drained or None,  # why it stays stopped until undrain (drained or retired)
        }


async def launch(child: Child, log_stream, launcher=None):
    """Start the child's process and return it; its output is pumped into `log_stream`.

    API servers are forked from the prefork launcher when one is given and
    able; otherwise (and for every other kind) the process is exec'd. Runs as
    a task of its own (a launcher may take seconds to answer) and never writes
    the child record: the supervisor's loop does that when told the pid.
    """
    env = dict(os.environ)
    env[CHILD_CONFIG_ENV] = child.config_json.decode()
    env.setdefault("PYTHONUNBUFFERED", "1")
    for key, value in child.extra_env.items():
        env.setdefault(key, value)  # the operator's own setting wins
    proc = None
    if launcher is not None and child.kind == "api":
        proc = await launcher.launch(child.name, child.module, env, child.pass_fds)
    if proc is None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            child.module,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=child.pass_fds,
            close_fds=True,
        )
    asyncio.create_task(pump(proc.stdout, child.name, b"<6>", log_stream))
    asyncio.create_task(pump(proc.stderr, child.name, b"<4>", log_stream))
    return proc


def started(child: Child, proc, requested_at: float, now: float) -> None:
    """Record a new process of `child` (called by the supervisor's loop only)."""
    child.proc = proc
    child.pid = proc.pid
    child.state = ChildState.STARTING
    child.started_at = requested_at  # the start counts from the request, launcher wait included
    child.last_heartbeat = now
    child.consecutive_failures = 0
    child.kill_requested = False
    child.restart_requested = False
    child.failure = ""
    child.detail = ""


async def pump(stream: asyncio.StreamReader, name: str, default_prio: bytes, out) -> None:
    """Copy a child's lines; lines without our priority prefix get one and the child's name."""
    tag = f"{name}: ".encode()
    while True:
        try:
            line = await stream.readline()
        except (ValueError, asyncio.LimitOverrunError):
            continue  # an over-long line; skip rather than stall the child
        if not line:
            return
        if not _PRIO_PREFIX.match(line):
            line = default_prio + tag + line
        out.write(line if line.endswith(b"\n") else line + b"\n")
        out.flush()
