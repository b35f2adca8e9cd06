"""One API server's half of the cluster's tenant accounting.

Owns the report of what this API server's tenants used (a TenantUsage to the
coordinator at most every FLUSH_S while they use anything, and every
KEEPALIVE_S while they have requests in flight; in flight: not counting those
held at this frontend, which take no place in the shares, and which are reported apart,
for max_concurrent), and applying the others' reports, which the coordinator forwards,
to this server's buckets and admission. No request
ever waits on it: admission reads local state only, which these reports keep
within one flush interval of the cluster's.
"""

from __future__ import annotations

import asyncio

import zmq
from dpserve.daemons.api.tenants.limits import Limits
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import TenantTotals, TenantUsage

FLUSH_S = 0.25  # each API server reports at most this often: the coordinator's cost is per report
KEEPALIVE_S = 1.0  # below limits.REMOTE_IN_FLIGHT_TTL_S: a live server's in-flight counts never expire


class TenantSync:
    def __init__(self, limits_of, origin: str, send) -> None:
        self.limits_of = limits_of  # () -> Limits: the gate's current one (a reload replaces it)
        self.origin = origin
        self.send = send  # bytes -> None; raises zmq.ZMQError when the coordinator is away
        self.codec = Codec(TenantUsage)
        self.cluster: dict[str, tuple[float, float, int]] = {}  # tenant -> (tokens/s, requests/s, in flight), from the coordinator
        self.num_reports = 0
        self.admission = None  # this server's Admission (admission.py): its held requests, its cluster-wide shares
        self.reported: dict[str, tuple[int, int]] = {}  # tenant -> (placed, held) as last reported, while either is nonzero

    def cluster_usage(self, tenant: str) -> float:
        """Recent delivered tokens/s of `tenant` across the cluster (refreshed every second)."""
        got = self.cluster.get(tenant)
        return got[0] if got is not None else 0.0

    def take_report(self, keepalive: bool = False) -> TenantUsage | None:
        """What changed since the last report (a release from the held queue included: it
        moves a request from held to placed), and, on a keepalive, every tenant in flight."""
        usage, held_now = [], []
        stats = self.admission.stats if self.admission is not None else {}
        reported = self.reported
        for name, st in self.limits_of().states.items():
            held = stats.get(name)
            num_held = held.num_held if held is not None else 0
            counts = (st.in_flight - num_held, num_held)  # (held here take no place: the others' shares count places)
            if st.dirty or (keepalive and st.in_flight) or reported.get(name, (0, 0)) != counts:
                usage.append((name, st.out_requests, st.out_charged, st.out_delivered, counts[0]))
                if num_held:
                    held_now.append((name, num_held))
                if counts == (0, 0):
                    reported.pop(name, None)
                else:
                    reported[name] = counts
                st.out_requests = st.out_charged = st.out_delivered = 0
                st.dirty = False
        return TenantUsage(self.origin, usage, held_now) if usage else None

    def flush(self, keepalive: bool = False) -> None:
        report = self.take_report(keepalive)
        if report is None:
            return
        try:
            self.send(self.codec.encode(report))
            self.num_reports += 1
        except zmq.ZMQError:
            pass  # the coordinator is away: the others miss this much; the limits hold locally

    def apply(self, msg: TenantUsage | TenantTotals) -> None:
        """A message of the table channel for tenants."""
        if type(msg) is TenantTotals:
            self.cluster = {name: (tps, rps, n) for name, tps, rps, n in msg.totals}
            return
        if msg.origin == self.origin:
            return
        limits: Limits = self.limits_of()
        held = dict(msg.held) if msg.held else {}
        for name, requests, charged, delivered, in_flight in msg.usage:
            limits.remote(msg.origin, name, requests, charged, in_flight + held.get(name, 0))  # (max_concurrent counts held ones)
            st = limits.states.get(name) if self.admission is not None else None
            if st is not None:
                self.admission.remote(msg.origin, st.tenant, in_flight, delivered)

    async def run(self) -> None:
        ticks_per_keepalive = round(KEEPALIVE_S / FLUSH_S)
        tick = 0
        while True:
            await asyncio.sleep(FLUSH_S)
            tick += 1
            self.flush(keepalive=tick % ticks_per_keepalive == 0)
