"""The restart decision, as pure functions: no clock, no processes, no logging.

`decide` answers "this child's process ended; what now?" from the exit code
and the child's recent restarts; `node_exit_code` answers "can this node
still serve at all?". The loop applies the answers; tests call them directly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from dpserve.engine.common.procutil import EXIT_CONFIG, EXIT_NODE_UNHEALTHY, EXIT_NOTHING_SERVES, EXIT_STARTUP

# Why a child was given up on (Child.gave_up); the node's exit code depends on it.
CANNOT_BOOT = "cannot boot"
CRASH_LOOP = "crash loop"


class Action(enum.Enum):
    RESTART = "restart"  # start it again after `delay_s`
    STAY_DOWN = "stay down"  # the policy says so; not a failure of the node
    GIVE_UP = "give up"  # restarting cannot help or keeps failing


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    mode: str  # always | on-failure | never
    max_restarts: int
    window_s: float
    backoff_initial_s: float
    backoff_max_s: float

    @classmethod
    def from_config(cls, cfg) -> RestartPolicy:
        return cls(cfg.restart_policy, cfg.max_restarts, cfg.restart_window_s, cfg.restart_backoff_initial_s, cfg.restart_backoff_max_s)


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    delay_s: float = 0.0
    restart_times: tuple[float, ...] = ()  # the child's restart history to keep
    why: str = ""  # for GIVE_UP: CANNOT_BOOT or CRASH_LOOP


def decide(policy: RestartPolicy, returncode: int, *, planned: bool, failed: bool, restart_times: Iterable[float], now: float) -> Decision:
    """What to do about a child whose process ended with `returncode`.

    planned: the supervisor stopped it to restart it (SIGHUP); restart at once,
    and it does not count against the limit. failed: the supervisor stopped it
    for failing (probes, a late start), so even a clean exit is a failure.
    A restart within the window counts; past `max_restarts` the child is given
    up on; delays double from `backoff_initial_s` up to `backoff_max_s`.
    """
    recent = tuple(t for t in restart_times if now - t < policy.window_s)
    if planned:
        return Decision(Action.RESTART, 0.0, recent)
    if returncode in (EXIT_CONFIG, EXIT_STARTUP):
        return Decision(Action.GIVE_UP, restart_times=recent, why=CANNOT_BOOT)
    failed = failed or returncode != 0
    if policy.mode == "never" or (policy.mode == "on-failure" and not failed):
        return Decision(Action.STAY_DOWN, restart_times=recent)
    if len(recent) >= policy.max_restarts:
        return Decision(Action.GIVE_UP, restart_times=recent, why=CRASH_LOOP)
    delay = min(policy.backoff_initial_s * (2 ** len(recent)), policy.backoff_max_s)
    return Decision(Action.RESTART, delay, (*recent, now))


def node_exit_code(children: Iterable) -> tuple[int, str]:
    """(exit code, kind) once every child of some kind was given up on, else (0, "").

    4 when that kind kept crashing past the restart limit, 5 when it cannot
    boot any more: either way systemd's Restart= takes over from here.
    """
    groups: dict[str, list] = {}
    for child in children:
        groups.setdefault(child.kind, []).append(child)
    for kind in ("engine", "api", "coordinator", "placement"):
        group = groups.get(kind)
        if group and all(c.gave_up for c in group):
            code = EXIT_NODE_UNHEALTHY if any(c.gave_up == CRASH_LOOP for c in group) else EXIT_NOTHING_SERVES
            return code, kind
    return 0, ""
