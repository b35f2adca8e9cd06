"""What admission (admission.py) keeps of each held request, tenant account and priority class,
and the refusal of a hold beyond a tenant's bound."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from dpserve.daemons.api.reserve import TURN
from dpserve.daemons.api.tenants import Tenant

HELD_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class HoldRefused(Exception):
    """The tenant already has `limit` requests held here: 429 with `retry_after_s`."""

    def __init__(self, tenant: str, limit: int, retry_after_s: int) -> None:
        self.tenant, self.limit, self.retry_after_s = tenant, limit, retry_after_s
        super().__init__(f"tenant {tenant!r} has {limit} requests held")


class Held:
    """One held request: what it costs, whose it is, and the send that releases it.
    `future` gets the rank it went to, or the RoutingError its send raised; `go` is how the
    release sends it (TURN: a free place, over its share; NOW: where it starts soonest, under it;
    BURST: there too, as a burst of a tenant below its share on average)."""

    __slots__ = ("tenant", "priority", "cost", "seq", "send", "future", "t_held", "go")

    def __init__(self, tenant: Tenant, priority: int, cost: int, seq: int, send: Callable[[], int], t_held: float) -> None:
        self.tenant, self.priority, self.cost, self.seq, self.send = tenant, priority, cost, seq, send
        self.future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.t_held = t_held
        self.go = TURN

    @property
    def sent(self) -> bool:
        """Released: its send went to a rank (the future holds that rank)."""
        return self.future.done() and not self.future.cancelled() and self.future.exception() is None


class Account:
    """One tenant's place in one class: its virtual finish tag, its held requests (in
    arrival order) and its released ones not yet finished (the account lives while
    either is nonzero)."""

    __slots__ = ("finish", "queue", "num_released")

    def __init__(self, finish: float) -> None:
        self.finish = finish
        self.queue: deque[Held] = deque()
        self.num_released = 0


class PriorityClass:
    """One priority class: its virtual time and its tenants' accounts."""

    __slots__ = ("vtime", "accounts", "backlogged")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.accounts: dict[str, Account] = {}
        self.backlogged: set[str] = set()  # accounts with a held request


class TenantStats:
    """What /metrics shows of one tenant's holds (admission's own figures)."""

    __slots__ = ("num_held", "num_held_total", "num_refused", "num_abandoned", "buckets", "held_seconds")

    def __init__(self) -> None:
        self.num_held = 0
        self.num_held_total = 0
        self.num_refused = 0
        self.num_abandoned = 0
        self.buckets = [0] * (len(HELD_SECONDS_BUCKETS) + 1)
        self.held_seconds = 0.0
