"""Admission held at the frontend (daemons/api/admission.py): the fair order by tokens,
weights, priority classes, bounds and abandonment, against a fake cluster whose room
the test sets and a virtual clock (no sockets, no sleeping)."""

from __future__ import annotations

import asyncio

import pytest
from dpserve.daemons.api.admission import Admission, HoldRefused
from dpserve.daemons.api.router import NoRankAvailable, QueueFull
from dpserve.daemons.api.tenants import Tenant
from dpserve.daemons.api.tenants.metrics import AdmissionCollector

A, B, C = Tenant("a"), Tenant("b"), Tenant("c")


class Cluster:
    """Ranks with `room` free places; a send takes one or raises QueueFull (the router's way)."""

    def __init__(self) -> None:
        self.room = 0
        self.sent: list[tuple[str, int]] = []  # (tenant, its n-th request)

    def send_of(self, tenant: Tenant, n: int):
        def send() -> int:
            if self.room <= 0:
                raise QueueFull(4)
            self.room -= 1
            self.sent.append((tenant.name, n))
            return 0
        return send


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def hold(adm: Admission, cluster: Cluster, tenant: Tenant, n: int, cost: int = 100, priority: int = 0):
    return [adm.enqueue(tenant, priority, cost, cluster.send_of(tenant, i)) for i in range(n)]


def released(adm: Admission, cluster: Cluster, n: int) -> list[str]:
    cluster.room = n
    start = len(cluster.sent)
    adm.release()
    return [name for name, _ in cluster.sent[start:]]


def test_equal_tenants_alternate_and_a_late_one_is_not_behind_the_backlog():
    async def main():
        adm, cluster = Admission(100), Cluster()
        hold(adm, cluster, A, 20)
        assert released(adm, cluster, 4) == ["a"] * 4  # alone: it takes all the room
        hold(adm, cluster, B, 3)
        # b arrives behind 16 of a's: it goes next, and they alternate while both wait
        assert released(adm, cluster, 6) == ["b", "a", "b", "a", "b", "a"]
        assert adm.num_held == 16 - 3
    run(main())


def test_weights_share_the_releases_in_proportion():
    async def main():
        adm, cluster = Admission(1000), Cluster()
        heavy = Tenant("heavy", weight=3.0)
        hold(adm, cluster, heavy, 200)
        hold(adm, cluster, B, 200)
        order = released(adm, cluster, 100)
        assert order.count("heavy") == 75 and order.count("b") == 25
    run(main())


def test_order_is_by_tokens_not_requests():
    async def main():
        adm, cluster = Admission(1000), Cluster()
        hold(adm, cluster, A, 50, cost=1000)  # long requests
        hold(adm, cluster, B, 500, cost=100)  # short ones
        order = released(adm, cluster, 110)
        tokens_a, tokens_b = 1000 * order.count("a"), 100 * order.count("b")
        assert abs(tokens_a - tokens_b) <= 1000  # equal tokens, within one request
        assert order.count("b") >= 9 * order.count("a")
    run(main())


def test_unused_tokens_are_credited_back_when_a_request_finishes():
    async def main():
        adm, cluster = Admission(1000), Cluster()
        first_a = hold(adm, cluster, A, 1, cost=1000)
        hold(adm, cluster, A, 100, cost=1000)
        hold(adm, cluster, B, 100, cost=1000)
        assert released(adm, cluster, 2) == ["a", "b"]
        before = released(adm, cluster, 10)
        assert before.count("a") == before.count("b") == 5
        adm.finished(first_a[0], used=100)  # it asked for 1,000 tokens, used 100: 900 come back
        # a is now 900 tokens behind b: it gets the next release (and one more turn in all)
        after = released(adm, cluster, 3)
        assert after == ["a", "b", "a"]
    run(main())


def test_a_lower_priority_class_goes_first_whatever_the_shares():
    async def main():
        adm, cluster = Admission(1000), Cluster()
        hold(adm, cluster, A, 5, priority=10)  # bulk
        hold(adm, cluster, B, 3, priority=0)  # interactive, later, of a tenant with the same share
        hold(adm, cluster, C, 2, priority=-5)  # more urgent still
        assert released(adm, cluster, 10) == ["c", "c", "b", "b", "b", "a", "a", "a", "a", "a"]
    run(main())


def test_an_idle_tenant_banks_no_credit():
    async def main():
        adm, cluster = Admission(1000), Cluster()
        hold(adm, cluster, A, 50)
        released(adm, cluster, 50)  # a ran alone for a while; b was idle
        hold(adm, cluster, A, 10)
        hold(adm, cluster, B, 10)
        # b's idleness does not entitle it to 50 releases in a row: they alternate
        assert released(adm, cluster, 6) == ["b", "a", "b", "a", "b", "a"]
    run(main())


def test_a_request_released_as_its_client_leaves_is_not_counted():
    async def main():
        adm, cluster = Admission(100), Cluster()
        (held,) = hold(adm, cluster, A, 1)
        waiter = asyncio.create_task(adm.wait(held))
        await asyncio.sleep(0)
        cluster.room = 1
        adm.release()  # sent, and its future has the rank...
        waiter.cancel()  # ... but its handler is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert held.sent and cluster.sent == [("a", 0)]  # (serving.py aborts it at the engine)
        assert adm.num_accounts == 0 and adm.num_held == 0  # its account is not kept for it
    run(main())


def test_a_full_held_queue_refuses_with_a_retry_after():
    async def main():
        clock = Clock()
        adm, cluster = Admission(3, clock=clock), Cluster()
        hold(adm, cluster, A, 3)
        with pytest.raises(HoldRefused) as info:
            hold(adm, cluster, A, 1)
        assert info.value.limit == 3 and info.value.tenant == "a" and 1 <= info.value.retry_after_s <= 60
        hold(adm, cluster, B, 3)  # the bound is per tenant
        assert adm.stats["a"].num_refused == 1 and adm.num_held == 6
        assert info.value.retry_after_s == 60  # nothing released yet: no rate to go by
        # the retry estimate follows the release rate: 10 a second, 3 ahead: 1 s
        alone = Admission(3, clock=clock)
        for _ in range(300):
            clock.now += 0.1
            hold(alone, cluster, C, 1)
            released(alone, cluster, 1)
        assert alone.retry_after_s(3) == 1
        assert alone.retry_after_s(100) in (10, 11)
    run(main())


def test_an_abandoned_held_request_leaves_at_once_and_is_never_sent():
    async def main():
        adm, cluster = Admission(100), Cluster()
        held = hold(adm, cluster, A, 2)
        waiter = asyncio.create_task(adm.wait(held[0]))
        other = asyncio.create_task(adm.wait(held[1]))
        await asyncio.sleep(0)
        waiter.cancel()  # aiohttp cancels the handler of a client that went away
        await asyncio.sleep(0)
        assert waiter.cancelled() and adm.num_held == 1 and adm.stats["a"].num_abandoned == 1
        cluster.room = 5
        adm.on_room()
        assert await asyncio.wait_for(other, 1) == 0
        assert cluster.sent == [("a", 1)] and adm.num_held == 0
    run(main())


def test_a_request_cancelled_just_before_a_release_is_not_sent():
    async def main():
        adm, cluster = Admission(100), Cluster()
        held = hold(adm, cluster, A, 2)
        held[0].future.cancel()  # cancelled; its handler has not run yet
        assert released(adm, cluster, 5) == ["a"] and cluster.sent == [("a", 1)]
        assert adm.num_held == 0 and adm.stats["a"].num_abandoned == 1
    run(main())


def test_a_routing_error_answers_the_held_request_and_the_rest_go_on():
    async def main():
        adm, cluster = Admission(100), Cluster()
        (bad,) = [adm.enqueue(A, 0, 100, lambda: (_ for _ in ()).throw(NoRankAvailable()))]
        hold(adm, cluster, B, 1)
        cluster.room = 1
        adm.release()
        assert isinstance(bad.future.exception(), NoRankAvailable)
        assert cluster.sent == [("b", 0)] and adm.num_held == 0
    run(main())


def test_room_reports_coalesce_into_one_release_on_the_loop():
    async def main():
        adm, cluster = Admission(100), Cluster()
        tasks = [asyncio.create_task(adm.wait(h)) for h in hold(adm, cluster, A, 3)]
        await asyncio.sleep(0)
        cluster.room = 3
        for _ in range(5):
            adm.on_room()  # e.g. every rank of one table
        assert cluster.sent == []  # never inside the router's update: on the loop, once
        assert await asyncio.gather(*tasks) == [0, 0, 0]
        assert len(cluster.sent) == 3
    run(main())


def test_accounts_and_classes_do_not_outlive_their_requests():
    async def main():
        adm, cluster = Admission(100), Cluster()
        helds = [adm.enqueue(A, p, 100, cluster.send_of(A, p)) for p in range(50)]  # 50 distinct priorities
        released(adm, cluster, 50)
        assert adm.num_accounts == 50  # running: kept for the correction
        for h in helds:
            adm.finished(h, used=10)
        assert adm.num_accounts == 0 and adm.num_held == 0
    run(main())


def test_metrics_show_each_tenants_depth_and_wait():
    async def main():
        clock = Clock()
        adm, cluster = Admission(100, clock=clock), Cluster()
        hold(adm, cluster, A, 3)
        clock.now += 0.2
        released(adm, cluster, 1)
        families = {f.name: f for f in AdmissionCollector(adm, 0).collect()}
        depth = families["dpserve_api_admission_held_requests"].samples[0]
        assert depth.labels == {"api_server": "0", "tenant": "a"} and depth.value == 2
        waits = {s.name + s.labels.get("le", ""): s.value for s in families["dpserve_api_admission_held_seconds"].samples}
        assert waits["dpserve_api_admission_held_seconds_bucket0.1"] == 0
        assert waits["dpserve_api_admission_held_seconds_bucket0.25"] == 1
        assert waits["dpserve_api_admission_held_seconds_sum"] == pytest.approx(0.2)
    run(main())


def test_the_router_counts_a_full_batch_and_reports_room_when_a_place_frees():
    from dpserve.daemons.api.router import Router
    from dpserve.engine.common.protocol import LoadTable, RankLoad

    router = Router(2, "tokens", max_waiting_per_rank=8 + 1)  # 8 places + 1 waiting (serving.py sets it so)
    router.count_running = True
    rooms = []
    router.on_room = lambda: rooms.append(1)
    router.update_table(LoadTable(1, 2, [RankLoad(0, "a", True, 8, 1), RankLoad(1, "b", True, 7, 1)]))
    for rank, incarnation in ((0, "a"), (1, "b")):
        router.engine_hello(rank, incarnation)
    assert router.pick() == 1 and rooms == [1]  # rank 1 has a free place; rank 0 is full
    router.on_send(1, 10)
    with pytest.raises(QueueFull):
        router.pick()  # both full now: held at the frontend
    router.update_table(LoadTable(2, 2, [RankLoad(0, "a", True, 7, 1)]))  # a sequence of rank 0 finished
    assert rooms == [1, 1] and router.pick() == 0


def test_a_table_older_than_the_sends_does_not_make_room_that_the_rank_has_not():
    from dpserve.daemons.api.router import Router
    from dpserve.engine.common.protocol import LoadTable, RankLoad

    router = Router(1, "tokens", max_waiting_per_rank=8 + 1)
    router.count_running = True
    rooms = []
    router.on_room = lambda: rooms.append(1)
    router.update_table(LoadTable(1, 1, [RankLoad(0, "a", True, 0, 0)]))
    router.engine_hello(0, "a")
    for _ in range(9):
        router.on_send(router.pick(), 10)  # a flood's onset: nine sends within a millisecond
    with pytest.raises(QueueFull):
        router.pick()
    # the rank's report from before it saw them comes in: it clears the sends counted since the last
    # one, but the nine are still ours in flight there, so the rank is still full
    router.update_table(LoadTable(2, 1, [RankLoad(0, "a", True, 0, 0)]))
    with pytest.raises(QueueFull):
        router.pick()
    assert rooms == [1]  # (the first table's)
    router.on_finish(0, 10)  # one of them ends: a place is free, said at once
    assert rooms == [1, 1] and router.pick() == 0


def test_the_least_urgent_held_class_and_the_rank_where_a_preempting_request_starts_soonest():
    import math

    from dpserve.daemons.api.admission import soonest_rank
    from dpserve.daemons.api.router import Router
    from dpserve.engine.common.protocol import LoadTable, RankLoad

    async def main():
        adm, cluster = Admission(100), Cluster()
        assert adm.least_urgent_held() == -math.inf  # nothing held: nothing to pass
        hold(adm, cluster, A, 2, priority=1)
        hold(adm, cluster, B, 1, priority=0)
        assert adm.least_urgent_held() == 1  # a priority-0 request may pass the held bulk (serving.py)
        released(adm, cluster, 2)  # b's, then one of a's
        assert adm.least_urgent_held() == 1
        released(adm, cluster, 1)
        assert adm.least_urgent_held() == -math.inf
    run(main())

    router = Router(3, "tokens", max_waiting_per_rank=9)
    router.count_running = True
    router.update_table(LoadTable(1, 3, [RankLoad(0, "a", True, 8, 3), RankLoad(1, "b", True, 8, 1), RankLoad(2, "c", False)]))
    for rank, incarnation in ((0, "a"), (1, "b"), (2, "c")):
        router.engine_hello(rank, incarnation)
    with pytest.raises(QueueFull):
        router.pick()  # every routable rank is full
    assert soonest_rank(router) == 1  # full, but the shortest queue; rank 2 is down
    router.on_send(1, 10)
    router.on_send(1, 10)
    router.on_send(1, 10)
    assert soonest_rank(router) == 0  # (ties to the first)
    router.update_table(LoadTable(2, 3, [RankLoad(0, "a", True, 2, 0), RankLoad(1, "b", True, 0, 0), RankLoad(2, "c", False)]))
    assert soonest_rank(router) == 0  # a table older than our 3 sends to rank 1: never below our own in flight
    router.update_table(LoadTable(3, 3, [RankLoad(0, "a", False), RankLoad(1, "b", False)]))
    with pytest.raises(NoRankAvailable):
        soonest_rank(router)


def test_under_the_priority_policy_less_urgent_work_in_flight_lets_a_more_urgent_request_pass():
    import math

    from dpserve.daemons.api.request_state import RequestState

    assert Admission(10).least_urgent() == -math.inf  # fcfs: every request waits its turn

    async def main():
        adm, cluster = Admission(10, by_class=True), Cluster()
        bulk = [RequestState(f"b{i}", 8, 12) for i in range(2)]
        for state in bulk:
            assert adm.started(state, 1, 0) == 0  # sent at once (nothing held)
        assert adm.least_urgent() == 1  # the ranks run priority-1 work: a priority-0 request passes
        (held,) = hold(adm, cluster, A, 1, priority=3)
        assert adm.least_urgent() == 3
        released(adm, cluster, 1)
        state = RequestState("h", 8, 100)
        state.held = held
        adm.started(state, 3, 0)
        state.num_output_tokens = 10
        adm.ended(state)  # its class count drops, and its unused tokens go back
        assert state.held is None and state.urgency is None and adm.num_accounts == 0
        for state in bulk:
            adm.ended(state)
        assert adm.least_urgent() == -math.inf and adm.in_flight == {}
    run(main())


# ---------------------------------------------------------------- reservations (reserve.py)

def reserved(places: float = 16, window_s: float = 5.0):
    """Admission with reservations over `places` places (headroom 1), on a virtual clock."""
    from dpserve.daemons.api.reserve import Reservations

    clock = Clock()
    return Admission(1000, clock=clock, reserve=Reservations(window_s, lambda: places, clock, headroom=1.0, min_headroom=1.0)), clock


def start(adm: Admission, tenant: Tenant, n: int, priority: int = 0) -> list:
    from dpserve.daemons.api.request_state import RequestState

    states = []
    for i in range(n):
        state = RequestState(f"{tenant.name}{i}", 8, 12)
        state.tenant = tenant
        adm.started(state, priority, 0)
        states.append(state)
    return states


def test_a_quiet_tenant_reserves_its_recent_peak_and_the_flood_is_capped_below_the_rest():
    from dpserve.daemons.api.reserve import ALONE, HOLD, NOW, TURN

    async def main():
        adm, clock = reserved(places=16)
        res = adm.reserve
        assert res.check(0, "a", 1) == ALONE  # alone: no cap at all
        start(adm, A, 3)  # a quiet tenant: 3 in flight, reserving 3 + 1 = 4
        assert res.check(0, "b", 1) == NOW  # a newcomer is under its own reservation
        start(adm, B, 12)
        assert res.check(0, "b", 1) == HOLD  # 16 - 4 (a's): at its cap with room left
        assert res.check(0, "a", 1) == NOW  # a's next request goes at once
        start(adm, C, 1)  # a third (peak 1) lowers b's cap to 16 - (3 + 1 + 2): 1 headroom an account, pooled
        assert res.check(0, "b", 1) == HOLD
        # between its reservation and its cap, a tenant takes a free place in fair order
        adm2, _ = reserved(places=16)
        start(adm2, A, 3)
        start(adm2, B, 11)  # past its share (8) and the class's pooled reservation (3 + 8 + 2)
        assert adm2.reserve.check(0, "b", 1) == TURN and adm2.may_pass(B, 0) == TURN
        hold(adm2, Cluster(), C, 1)
        assert adm2.may_pass(B, 0) == HOLD and adm2.may_pass(A, 0) == NOW  # others held: only the reserved pass
    run(main())


def test_a_capped_tenant_is_held_with_room_free_and_released_as_its_own_requests_end():
    async def main():
        adm, clock = reserved(places=8)
        cluster = Cluster()
        cluster.room = 8
        start(adm, A, 1)  # quiet: reserves 1 + 1 = 2, so b may hold 6
        running = start(adm, B, 6)
        assert not adm.may_pass(B, 0)
        (held,) = hold(adm, cluster, B, 1)
        adm.release()
        assert cluster.sent == [] and not held.future.done()  # room, but b is at its cap
        assert adm.may_pass(A, 0)  # the quiet tenant's place is there
        adm.ended(running[0])  # one of b's ends: the release runs on the loop
        await asyncio.sleep(0)
        assert cluster.sent == [("b", 0)] and held.future.done()
    run(main())


def test_work_conserving_once_the_others_are_idle_past_the_window_and_peaks_decay():
    async def main():
        adm, clock = reserved(places=16, window_s=5.0)
        res = adm.reserve
        quiet = start(adm, A, 6)  # peak 6: reserves min(8, 6) + 1 = 7
        start(adm, B, 9)
        assert not adm.may_pass(B, 0)
        for state in quiet[:4]:
            adm.ended(state)
        clock.now += 2.0  # a's peak holds for the window
        assert not adm.may_pass(B, 0)
        clock.now += 5.0  # then decays: 6 e^-0.4 = 4.0, + 1: b may hold 16 - 5.0
        start(adm, B, 1)
        assert adm.may_pass(B, 0)
        start(adm, B, 1)
        assert not adm.may_pass(B, 0)
        for state in quiet[4:]:
            adm.ended(state)
        assert res.next_expiry() == 112.0  # a's last end + the window
        clock.now += 5.0  # a idle past the window: its reservation is gone
        assert adm.may_pass(B, 0) and list(res._active(clock.now)) == [(0, "b")]
    run(main())


def test_more_urgent_classes_reservations_come_first():
    from dpserve.daemons.api.reserve import HOLD, NOW

    async def main():
        adm, clock = reserved(places=16)
        res = adm.reserve
        start(adm, A, 2, priority=0)  # interactive: reserves 2 + 1
        start(adm, B, 13, priority=1)  # bulk: at 16 - 3
        assert res.check(1, "b", 1) == HOLD
        # the interactive class does not leave room for bulk's reservation (8): it may take up to 16
        start(adm, A, 8, priority=0)
        assert res.check(0, "a", 1) != HOLD
        # with room for two, the less urgent class at its cap stays held: the room is the other's
        adm2, _ = reserved(places=8)
        cluster = Cluster()
        start(adm2, A, 6, priority=0)  # reserves min(8 / 2, 6) + 1 = 5
        start(adm2, B, 4, priority=1)  # past its cap, 8 - 5
        hold(adm2, cluster, B, 1, priority=1)
        hold(adm2, cluster, A, 1, priority=0)  # its cap: 8, nothing more urgent
        assert released(adm2, cluster, 2) == ["a"] and adm2.num_held == 1
        assert res.check(0, "c", 1) == NOW
    run(main())


def test_one_release_burst_stops_at_the_cap_and_a_lapsed_reservation_wakes_the_held():
    async def main():
        adm, clock = reserved(places=8, window_s=0.05)
        cluster = Cluster()
        (quiet,) = start(adm, A, 1)  # reserves 1 + 1: b may hold 6
        hold(adm, cluster, B, 8)
        assert released(adm, cluster, 8) == ["b"] * 6  # each release counts before the next pick
        adm.ended(quiet)  # a goes idle; its reservation lapses 0.05 s later (the clock is virtual)
        await asyncio.sleep(0)
        assert len(cluster.sent) == 6
        clock.now += 0.06
        await asyncio.sleep(0.1)  # the wake-up at the lapse (work conservation): nothing else would come
        assert len(cluster.sent) == 8 and adm.num_held == 0
    run(main())


def test_backlogged_tenants_reserve_nothing_the_fair_order_by_tokens_shares_between_them():
    from dpserve.daemons.api.reserve import HOLD, NOW

    async def main():
        adm, clock = reserved(places=8)
        cluster = Cluster()
        start(adm, A, 4)
        start(adm, B, 3)
        assert adm.reserve.check(0, "b", 1) == NOW and adm.reserve.check(0, "a", 1) == HOLD  # a: 8 - (min(4, 3) + 1)
        hold(adm, cluster, A, 2, cost=10)
        hold(adm, cluster, B, 2, cost=40)  # both backlogged: neither reserves; tokens decide
        assert released(adm, cluster, 1) == ["a"]  # (a's tag is lowest: it asked for fewer tokens)
        assert adm.reserve.check(0, "b", 1) != HOLD and adm.may_pass(B, 0) == HOLD  # behind its own held ones
    run(main())
