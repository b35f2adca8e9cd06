"""Shares held by N API servers together (issue 28): each server's reservations count the
other servers' requests in flight, and its fair order the tokens they delivered, as the
coordinator forwards their reports (tenants/sync.py). Two servers on a virtual clock."""

from __future__ import annotations

import asyncio

import pytest
from dpserve.daemons.api.admission import Admission
from dpserve.daemons.api.reserve import ALONE, HOLD, NOW, Reservations
from dpserve.daemons.api.router import QueueFull
from dpserve.daemons.api.tenants import Tenant
from dpserve.daemons.api.tenants.limits import Limited, Limits
from dpserve.daemons.api.tenants.sync import TenantSync
from dpserve.daemons.coordinator.tenants import TenantAccounts
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import CoordinatorInput, TableChannel

QUIET, FLOOD, CAPPED = Tenant("quiet"), Tenant("flood"), Tenant("capped", max_concurrent=4)
PLACES = 16  # the cluster's batch places: every server reserves and caps by the cluster's counts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def servers(n: int, clock: Clock, forward: bool = True):
    """n API servers (limits, sync, admission) whose reports go through one coordinator."""
    wire_in, wire_out = Codec(CoordinatorInput), Codec(TableChannel)
    accounts = TenantAccounts()
    out = []

    def send(data: bytes) -> None:
        accounts.take(wire_in.decode(data), clock())
        for _, sync, _ in out:
            sync.apply(wire_out.decode(data))

    for i in range(n):
        limits = Limits({t.name: t for t in (QUIET, FLOOD, CAPPED)}, clock)
        sync = TenantSync(lambda limits=limits: limits, f"api-{i}", send if forward else lambda data: None)
        adm = Admission(1000, clock=clock, reserve=Reservations(5.0, lambda: PLACES, clock, headroom=1.0, min_headroom=1.0))
        sync.admission = adm
        out.append((limits, sync, adm))
    return out


def begin(server, tenant: Tenant, n: int) -> None:
    """n requests of `tenant` sent from this server (counted by its limits and its reservations)."""
    limits, _, adm = server
    for _ in range(n):
        limits.admit(tenant)
        adm.reserve.started(tenant.priority, tenant.name, tenant.weight)


def test_a_flood_at_one_server_is_capped_by_a_quiet_tenants_demand_at_another():
    for forward in (True, False):
        clock = Clock()
        a, b = servers(2, clock, forward)
        begin(a, QUIET, 3)  # the quiet tenant comes only to server a
        begin(b, FLOOD, 12)  # the flood only to server b
        a[1].flush()
        b[1].flush()
        go = b[2].reserve.check(FLOOD.priority, FLOOD.name, FLOOD.weight)
        if forward:  # b reserves the quiet tenant's peak 3 + 1 of the 16 places: the flood is at its cap
            assert go == HOLD
            assert a[2].reserve.check(QUIET.priority, QUIET.name, QUIET.weight) == NOW
        else:  # each server alone: b sees the flood alone, and lets it take every place
            assert go == ALONE


def test_tokens_delivered_at_one_server_count_in_another_servers_fair_order():
    async def main():
        clock = Clock()
        a, b = servers(2, clock)
        sent = []

        def send_of(name: str):
            def send() -> int:
                if len(sent) >= 1:
                    raise QueueFull(1)
                sent.append(name)
                return 0
            return send

        adm = b[2]
        adm.reserve = None  # (the fair order alone)
        adm.enqueue(FLOOD, 0, 100, send_of("flood"))  # held first: the tie would be the flood's
        adm.enqueue(QUIET, 0, 100, send_of("quiet"))
        limits = a[0]
        st = limits.admit(FLOOD)  # meanwhile server a delivered 5,000 of the flood's tokens
        limits.done(st, 0, 1000, 4000)
        a[1].flush()
        adm.release()
        assert sent == ["quiet"]
    asyncio.run(main())


def test_requests_held_at_one_server_are_not_counted_in_flight_at_the_others():
    async def main():
        clock = Clock()
        a, b = servers(2, clock)
        begin(b, FLOOD, 12)
        limits, sync, adm = b
        for _ in range(30):  # 30 more through b's gate, held at its frontend: they take no place
            limits.admit(FLOOD)
            adm.enqueue(FLOOD, FLOOD.priority, 20, lambda: 0)
        sync.flush()
        assert a[2].reserve.accounts[(FLOOD.priority, FLOOD.name)].num_remote == 12
    asyncio.run(main())


def test_until_the_peers_report_each_is_taken_to_have_sent_as_many_as_this_server():
    clock = Clock()
    res = Reservations(5.0, lambda: PLACES, clock, headroom=1.0, min_headroom=1.0)
    res.num_peers = 1  # one other API server
    for _ in range(2):
        res.started(0, "quiet", 1)  # reserves 2 + 1: a flood may hold 13 of the cluster's 16
    for _ in range(7):
        res.started(0, "flood", 1)
    assert res.check(0, "flood", 1) == HOLD  # 7 here + the peer's likely 7 since its last report
    res.remote("api-1", 0, "flood", 1, 4)  # its report: it sent 4 (made during its burst: it may have sent more since)
    assert res.check(0, "flood", 1) == HOLD  # 7 + 4 + the 3 more likely
    res.remote("api-1", 0, "flood", 1, 4)  # its next: still 4 (it stopped)
    assert res.check(0, "flood", 1) != HOLD  # 7 + 4 < 13
    res.started(0, "flood", 1)
    assert res.check(0, "flood", 1) == HOLD  # 8 + 4 + 1 unreported
    clock.now += 0.5  # a report interval later the peer's sends would be in its report
    assert res.check(0, "flood", 1) != HOLD


def test_a_quiet_tenant_idle_at_one_server_keeps_its_reservation_at_another():
    """Its request started and ended at server a within one report (b hears of 0 in flight);
    a flood then comes to b alone: b still reserves a place of headroom for the quiet tenant."""
    clock = Clock()
    a, b = servers(2, clock)
    st = a[0].admit(QUIET)
    a[2].reserve.started(QUIET.priority, QUIET.name, QUIET.weight)
    clock.now += 0.1
    a[0].done(st, 0, 8, 12)
    a[2].reserve.ended(QUIET.priority, QUIET.name)
    a[1].flush()
    res = b[2].reserve
    assert res.check(FLOOD.priority, FLOOD.name, FLOOD.weight) != ALONE
    n = 0
    while n < PLACES and res.check(FLOOD.priority, FLOOD.name, FLOOD.weight) != HOLD:
        res.started(FLOOD.priority, FLOOD.name, FLOOD.weight)
        n += 1
        clock.now += 0.31  # (past REPORT_S: no unreported sends of a's assumed; within the 5 s window)
    assert n == PLACES - 1  # its 1 place of headroom stays free


def test_peers_heard_from_count_as_senders_beyond_the_configured_number():
    """A server configured alone on its node (num_peers 0) that hears from another node's
    API server assumes its unreported sends too."""
    clock = Clock()
    res = Reservations(5.0, lambda: PLACES, clock, headroom=1.0, min_headroom=1.0)
    res.started(0, "quiet", 1)  # reserves 1 + 1: a flood may hold 14
    res.remote("node1-api-0", 0, "flood", 1, 0)  # heard from (nothing of the flood in flight there yet)
    for _ in range(7):
        res.started(0, "flood", 1)
    assert res.check(0, "flood", 1) == HOLD  # 7 here + the peer's likely 7
    clock.now += 0.5
    assert res.check(0, "flood", 1) != HOLD


def test_max_concurrent_counts_requests_held_at_another_servers_frontend():
    """Held requests take no place (the shares leave them out) but are the tenant's
    concurrent requests all the same; a release is reported though nothing else changed."""
    async def main():
        clock = Clock()
        a, b = servers(2, clock)
        limits, sync, adm = b
        for _ in range(3):  # through b's gate, then held at its frontend (every rank full)
            limits.admit(CAPPED)
            adm.enqueue(CAPPED, CAPPED.priority, 20, lambda: 0)
        sync.flush()
        a[0].admit(CAPPED)  # the 4th of max_concurrent 4
        with pytest.raises(Limited) as refused:
            a[0].admit(CAPPED)
        assert refused.value.limit == "max_concurrent"
        account = a[2].reserve.accounts[(CAPPED.priority, CAPPED.name)]
        assert account.num_remote == 0  # (held at b: no place taken)
        assert adm.release() == 3  # b's ranks have room again
        sync.flush()
        assert account.num_remote == 3
    asyncio.run(main())
