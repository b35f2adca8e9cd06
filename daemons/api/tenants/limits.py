"""Each tenant's limits held by one API server, counting what the others use too.

Owns the token buckets (requests per second, tokens per minute), the count of
requests in flight, and the per-tenant figures /metrics shows. A bucket is
charged at once for what this API server admits and, through the coordinator
(sync.py), for what every other API server of the cluster admitted, so N API
servers hold one tenant to its limit together, not N times over. Must never
block, sleep or do I/O: it runs inside the auth middleware of every request.

Tokens are reserved when a request's prompt and max_tokens are known (prompt +
max_tokens) and settled when it ends (the reservation swapped for the tokens it
really used), so a burst of admissions cannot run far past the limit.
"""

from __future__ import annotations

import math
import time

from dpserve.daemons.api.tenants import Tenant

TOKEN_BURST_S = 10.0  # a tokens_per_min bucket holds this many seconds of its rate
REQUEST_BURST_S = 1.0  # a requests_per_s bucket holds this (at least one request)
REMOTE_IN_FLIGHT_TTL_S = 3.0  # another API server's in-flight count, unheard this long, is dropped


class TokenBucket:
    """`rate` units a second up to `capacity`; the level may go below zero (debt)."""

    __slots__ = ("rate", "capacity", "level", "t")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity, self.level, self.t = rate, capacity, capacity, now

    def refill(self, now: float) -> float:
        if now > self.t:
            self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
            self.t = now
        return self.level

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until the level reaches `need` (0 when it has)."""
        level = self.refill(now)
        return 0.0 if level >= need else (need - level) / self.rate

    def charge(self, n: float) -> None:
        self.level -= n


class Limited(Exception):
    """A tenant over one of its limits: which, and when to come back."""

    def __init__(self, tenant: Tenant, limit: str, value, retry_after_s: float) -> None:
        super().__init__(limit)
        self.tenant, self.limit, self.value = tenant, limit, value
        self.retry_after = max(1, math.ceil(retry_after_s))  # Retry-After: whole seconds


class TenantState:
    """One tenant on this API server: its buckets, its requests in flight, its figures."""

    __slots__ = ("tenant", "requests", "tokens", "in_flight", "remote_in_flight", "num_requests", "num_limited",
                 "num_prompt_tokens", "num_completion_tokens",
                 "out_requests", "out_charged", "out_delivered", "dirty")

    def __init__(self, tenant: Tenant, now: float) -> None:
        self.tenant = tenant
        self.requests = TokenBucket(tenant.requests_per_s, max(1.0, tenant.requests_per_s * REQUEST_BURST_S), now) if tenant.requests_per_s else None
        rate = tenant.tokens_per_min / 60.0 if tenant.tokens_per_min else 0.0
        self.tokens = TokenBucket(rate, rate * TOKEN_BURST_S, now) if rate else None
        self.in_flight = 0
        self.remote_in_flight: dict[str, tuple[int, float]] = {}  # origin -> (count, when heard); held at its frontend included
        # figures for /metrics (counters since this process started)
        self.num_requests = 0
        self.num_limited: dict[str, int] = {}  # limit -> 429s
        self.num_prompt_tokens = 0
        self.num_completion_tokens = 0
        # not yet reported to the other API servers (sync.py takes these)
        self.out_requests = 0
        self.out_charged = 0
        self.out_delivered = 0
        self.dirty = False

    def adopt(self, old: TenantState) -> None:
        """A reload kept this tenant: keep what it used (levels, in flight, figures)."""
        for mine, theirs in ((self.requests, old.requests), (self.tokens, old.tokens)):
            if mine is not None and theirs is not None:
                mine.level, mine.t = min(mine.capacity, theirs.level), theirs.t
        for name in ("in_flight", "remote_in_flight", "num_requests", "num_limited", "num_prompt_tokens", "num_completion_tokens",
                     "out_requests", "out_charged", "out_delivered", "dirty"):
            setattr(self, name, getattr(old, name))

    def cluster_in_flight(self, now: float) -> int:
        n = self.in_flight
        for origin, (count, heard) in list(self.remote_in_flight.items()):
            if now - heard > REMOTE_IN_FLIGHT_TTL_S:
                del self.remote_in_flight[origin]
            else:
                n += count
        return n

    def limited(self, limit: str, value, retry_after_s: float) -> Limited:
        self.num_limited[limit] = self.num_limited.get(limit, 0) + 1
        return Limited(self.tenant, limit, value, retry_after_s)


class Limits:
    """Every tenant's TenantState on this API server, by name."""

    def __init__(self, tenants: dict[str, Tenant], clock=time.monotonic) -> None:
        self.clock = clock
        now = clock()
        self.states = {name: TenantState(t, now) for name, t in tenants.items()}

    def reload(self, tenants: dict[str, Tenant]) -> None:
        now = self.clock()
        states = {}
        for name, tenant in tenants.items():
            states[name] = TenantState(tenant, now)
            if name in self.states:
                states[name].adopt(self.states[name])
        self.states = states

    def admit(self, tenant: Tenant) -> TenantState:
        """Count a request in, or raise Limited (nothing counted). Call done() when it ends."""
        st = self.states.get(tenant.name)
        if st is None:  # the tenant left in a reload while its request was on the way
            st = self.states[tenant.name] = TenantState(tenant, self.clock())
        t = st.tenant
        now = self.clock()
        if t.max_concurrent is not None and st.cluster_in_flight(now) >= t.max_concurrent:
            raise st.limited("max_concurrent", t.max_concurrent, 1.0)
        if st.requests is not None and (wait := st.requests.wait_s(1.0, now)) > 0:
            raise st.limited("requests_per_s", t.requests_per_s, wait)
        if st.tokens is not None and (wait := st.tokens.wait_s(1.0, now)) > 0:
            raise st.limited("tokens_per_min", t.tokens_per_min, wait)
        if st.requests is not None:
            st.requests.charge(1.0)
        st.in_flight += 1
        st.num_requests += 1
        st.out_requests += 1
        st.dirty = True
        return st

    def reserve(self, st: TenantState, num_prompt: int, max_tokens: int) -> int:
        """Reserve a generation's most tokens; the tokens_per_min bucket must not be in debt."""
        if st.tokens is None:
            return 0
        if (wait := st.tokens.wait_s(1.0, self.clock())) > 0:
            raise st.limited("tokens_per_min", st.tenant.tokens_per_min, wait)
        n = num_prompt + max_tokens
        st.tokens.charge(n)
        st.out_charged += n
        st.dirty = True
        return n

    @staticmethod
    def done(st: TenantState, reserved: int, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended: swap its reservation for what it used, and count it out."""
        used = prompt_tokens + completion_tokens
        if st.tokens is not None:
            st.tokens.charge(used - reserved)
            st.out_charged += used - reserved
        st.in_flight -= 1
        st.num_prompt_tokens += prompt_tokens
        st.num_completion_tokens += completion_tokens
        st.out_delivered += used
        st.dirty = True

    def remote(self, origin: str, name: str, requests: int, charged: int, in_flight: int) -> None:
        """Another API server's news of a tenant: charge it here too."""
        st = self.states.get(name)
        if st is None:
            return  # not a tenant of this reading of the file (a reload not yet everywhere)
        now = self.clock()
        if st.requests is not None and requests:
            st.requests.refill(now)
            st.requests.charge(requests)
        if st.tokens is not None and charged:
            st.tokens.refill(now)
            st.tokens.charge(charged)
        st.remote_in_flight[origin] = (in_flight, now)
