"""Tenant limits across API servers: four servers' buckets kept together through the
coordinator's forwarding (virtual clock), the coordinator's totals, and the
table channel's new messages."""

from __future__ import annotations

from dpserve.daemons.api.tenants import Tenant
from dpserve.daemons.api.tenants.limits import TOKEN_BURST_S, Limited, Limits
from dpserve.daemons.api.tenants.sync import FLUSH_S, TenantSync
from dpserve.daemons.coordinator.tenants import WINDOW_S, TenantAccounts
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import CoordinatorInput, TableChannel, TenantTotals, TenantUsage


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def cluster(n: int, tenant: Tenant, clock: Clock):
    """n API servers whose reports go through one coordinator's accounts and back."""
    wire_in, wire_out = Codec(CoordinatorInput), Codec(TableChannel)
    accounts = TenantAccounts()
    servers: list[TenantSync] = []

    def send(data: bytes) -> None:
        msg = wire_in.decode(data)
        accounts.take(msg, clock())
        for s in servers:  # the coordinator forwards it as it came
            s.apply(wire_out.decode(data))

    for i in range(n):
        limits = Limits({tenant.name: tenant}, clock)
        servers.append(TenantSync(lambda limits=limits: limits, f"api-{i}", send))
    return servers, accounts


def run(servers, tenant, clock, seconds: float, tokens_each: int = 20, per_tick: int = 3) -> int:
    """Every server offers `per_tick` requests each 10 ms; returns the tokens served."""
    served = 0
    ticks_per_flush = round(FLUSH_S / 0.01)
    for tick in range(int(seconds / 0.01)):
        clock.t += 0.01
        for s in servers:
            limits = s.limits_of()
            for _ in range(per_tick):
                try:
                    st = limits.admit(tenant)
                except Limited:
                    break
                try:
                    limits.reserve(st, tokens_each // 2, tokens_each // 2)
                    served += tokens_each
                    limits.done(st, tokens_each, tokens_each // 2, tokens_each // 2)
                except Limited:
                    limits.done(st, 0, 0, 0)
        if tick % ticks_per_flush == 0:
            for s in servers:
                s.flush()
    return served


def test_four_servers_hold_one_tokens_per_minute_limit_together():
    clock = Clock()
    tenant = Tenant("t", tokens_per_min=60_000)  # 1,000 tokens/s; each server alone could serve 6,000/s
    servers, _ = cluster(4, tenant, clock)
    burst = 1000 * TOKEN_BURST_S
    run(servers, tenant, clock, TOKEN_BURST_S)  # spend the starting burst
    served = run(servers, tenant, clock, 60.0)
    assert abs(served - 60_000) / 60_000 < 0.05, served
    alone, _ = cluster(4, tenant, Clock())
    for s in alone:
        s.send = lambda data: None  # no coordinator: each server holds the limit alone
    unheld = run(alone, tenant, alone[0].limits_of().clock, 60.0) - 4 * burst
    assert unheld > 3.5 * 60_000  # (what the forwarding prevents: four times the limit)


def test_coordinator_totals_and_cluster_usage():
    clock = Clock()
    tenant = Tenant("t")
    servers, accounts = cluster(2, tenant, clock)
    for _ in range(int(3 * WINDOW_S)):  # 2 servers x 100 requests/s x 10 tokens, published each second
        run(servers, tenant, clock, 1.0, tokens_each=10, per_tick=1)
        totals = accounts.publish(clock())
    (name, tokens_per_s, requests_per_s, in_flight), = totals.totals
    assert name == "t" and in_flight == 0
    assert abs(tokens_per_s - 2000) / 2000 < 0.1 and abs(requests_per_s - 200) / 200 < 0.1
    for s in servers:
        s.apply(Codec(TableChannel).decode(Codec(TenantTotals).encode(totals)))
    assert servers[0].cluster_usage("t") == tokens_per_s and servers[1].cluster_usage("nobody") == 0.0
    assert accounts.busiest(1)[0][0] == "t"


def test_reports_carry_in_flight_and_skip_idle_tenants():
    clock = Clock()
    tenant, idle = Tenant("t", max_concurrent=5), Tenant("idle")
    limits = Limits({"t": tenant, "idle": idle}, clock)
    sent: list[bytes] = []
    sync = TenantSync(lambda: limits, "me", sent.append)
    limits.admit(tenant)
    sync.flush()
    sync.flush()  # nothing changed: nothing sent
    sync.flush(keepalive=True)  # in flight: said again
    usage = [Codec(TenantUsage).decode(d).usage for d in sent]
    assert usage == [[("t", 1, 0, 0, 1)], [("t", 0, 0, 0, 1)]]
    sync.apply(TenantUsage("me", [("t", 5, 0, 0, 5)]))  # its own, forwarded back: skipped
    limits.admit(tenant)
