"""What the supervisor's loop is told: one small record per thing that happened.

Producers (signal handlers, exit watchers, the control socket, the prober,
spawn tasks, the coordinator-link monitor) only build one of these and put it
on the loop's queue; they never touch a child record. Children are named, not
referenced, and every event about a process carries its pid, so a late event
about a previous incarnation is recognised and dropped by the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SignalReceived:
    signum: int


@dataclass(frozen=True, slots=True)
class Spawned:
    """A spawn task has a process for `name` (requested_at: when the start was asked for)."""

    name: str
    proc: Any  # asyncio.subprocess.Process or launcher.AdoptedProcess
    requested_at: float


@dataclass(frozen=True, slots=True)
class SpawnFailed:
    name: str
    error: str


@dataclass(frozen=True, slots=True)
class Exited:
    name: str
    pid: int
    returncode: int


@dataclass(frozen=True, slots=True)
class Ready:
    name: str
    pid: int
    detail: str = ""  # what the child said of itself (a Ray rank: its node and actor)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    name: str
    pid: int
    num_running: int
    num_waiting: int
    kv_usage: float
    at: float


@dataclass(frozen=True, slots=True)
class ProbeResult:
    name: str
    pid: int
    ok: bool
    ready: bool
    detail: str
    latency_ms: float
    at: float  # wall clock, for /status
    unroutable_ranks: tuple[int, ...] = ()  # API servers: ranks alive in the table it cannot route to (its /readyz)


@dataclass(frozen=True, slots=True)
class ClusterSeen:
    """What the API servers' /readyz answers say about the whole cluster."""

    all_ranks_routable: bool
    num_alive_ranks: int


@dataclass(frozen=True, slots=True)
class TableSeen:
    """Entries of the coordinator's load table (cluster.py applies them)."""

    entries: list
    at: float  # monotonic
    wall: float


@dataclass(frozen=True, slots=True)
class LauncherRestarted:
    pass


@dataclass(frozen=True, slots=True)
class DrainRequested:
    """`dpserve drain`, `undrain` or `retire` (the verb) for a local rank (None: every
    local rank, retire only), from the health port; the loop answers through `reply`
    (a future: (HTTP status, body))."""

    verb: str
    rank: int | None
    reply: Any


@dataclass(frozen=True, slots=True)
class Fatal:
    """Stop the node with this exit code (a worker whose key the head refuses)."""

    code: int
    reason: str


Event = (
    SignalReceived | Spawned | SpawnFailed | Exited | Ready | Heartbeat | ProbeResult | ClusterSeen | TableSeen | LauncherRestarted
    | DrainRequested | Fatal
)
