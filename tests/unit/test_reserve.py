"""Places reserved by recent demand (daemons/api/reserve.py), on a virtual clock: how long
an idle account keeps its reservation, and (cluster-wide) whose requests count."""

from __future__ import annotations

from dpserve.daemons.api.reserve import ALONE, BURST, FRESH, HOLD, LINGER_WINDOWS, NOW, TURN, Reservations


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_more_urgent_class_keeps_its_reservation_while_a_less_urgent_one_floods():
    clock = Clock()
    res = Reservations(5.0, lambda: 16, clock, headroom=1.0, min_headroom=1.0)
    res.started(0, "interactive", 1)
    res.ended(0, "interactive")  # idle from t = 100
    for _ in range(15):
        res.started(1, "bulk", 1)
    assert res.check(1, "bulk", 1) == HOLD  # 16 - the interactive class's reservation (peak 1 + 1), then (its peak decayed) 1
    clock.now += 30.0  # idle 6 windows: a lone tenant's reservation would have lapsed after one
    assert res.check(1, "bulk", 1) == HOLD and res.check(0, "interactive", 1) == NOW
    assert res.next_expiry() == 100.0 + 5.0 * LINGER_WINDOWS  # the wake-up for held bulk requests
    clock.now = 100.0 + 5.0 * LINGER_WINDOWS
    assert res.check(1, "bulk", 1) == ALONE and list(res.accounts) == [(1, "bulk")]


def test_an_idle_account_of_the_same_or_a_less_urgent_class_lapses_after_one_window():
    clock = Clock()
    res = Reservations(5.0, lambda: 16, clock, headroom=1.0, min_headroom=1.0)
    res.started(1, "quiet", 1)
    res.ended(1, "quiet")
    res.started(1, "flood", 1)
    res.started(0, "urgent", 1)  # busy, more urgent than the idle one: no linger for "quiet"
    assert res.next_expiry() == 105.0
    clock.now = 105.0
    assert (1, "quiet") not in res._active(clock.now)
    res.ended(1, "flood")
    res.ended(0, "urgent")  # both idle: nothing less urgent is active, so neither lingers
    clock.now = 110.0
    assert list(res._active(clock.now)) == []
    # a less urgent class's first request finds the more urgent ones' reservations still there
    assert res.check(2, "x", 1) == NOW and set(res._active(clock.now, 2)) == {(1, "quiet"), (1, "flood"), (0, "urgent")}
    clock.now = 105.0 + 5.0 * LINGER_WINDOWS  # and gone once idle past the linger
    assert res.check(2, "x", 1) == ALONE and not res.accounts


def test_quiet_accounts_of_a_class_lend_each_other_their_free_reserved_places(monkeypatch):
    import dpserve.daemons.api.reserve as reserve

    clock = Clock()
    res = Reservations(5.0, lambda: 16, clock, headroom=1.0, min_headroom=1.0)  # 3 accounts: a share of 16 / 3 each
    for _ in range(4):
        res.started(0, "a", 1)
    for _ in range(3):
        res.ended(0, "a")  # a: peak 4, 1 in flight
    res.set_held(0, "flood", 1, True)  # backlogged: reserves nothing
    for _ in range(4):
        res.started(0, "c", 1)  # c: peak 4, 4 in flight
    for _ in range(7):
        res.started(0, "flood", 1)
    assert res.check(0, "flood", 1) == HOLD  # at 16 - (a's 4 + c's 4 + 2: 1 headroom an account, pooled)
    assert res.check(0, "c", 1) == NOW  # under its own min(16 / 3, 4) + 1
    for _ in range(5):
        res.started(0, "c", 1)  # 9: past its share (16 / 3), on a's 3 free reserved places
    assert res.check(0, "c", 1) == TURN  # but only once active for a window (a flood's onset is not lent them)
    monkeypatch.setattr(reserve, "LEND_HISTORY", False)
    assert res.check(0, "c", 1) == NOW  # (the switch: lent at once, as before)
    monkeypatch.setattr(reserve, "LEND_HISTORY", True)
    clock.now += 5.0
    assert res.check(0, "c", 1) == NOW  # the class's quiet use 1 + 9 < its reservation min(2 x 16 / 3, 4 + 16 / 3 + 2)
    res.started(0, "c", 1)  # 10: the pool is used up
    assert res.check(0, "c", 1) == TURN


def test_under_its_share_a_request_goes_to_the_engine_before_over_share_work_of_its_class():
    """Priority policy with reservations: engine priority 4 x class (+1 a burst below its share on
    average, +2 under its reservation without a window's history, +3 over its share), so a quiet
    tenant's request runs (and preempts) before a flood's of its class, a reserved one of a tenant
    with a record before a burst, a burst before a flood's onset, and classes keep their order."""
    import asyncio

    from dpserve.daemons.api.admission import Admission
    from dpserve.engine.common.protocol import AddRequest, SamplingParams

    def add(priority: int) -> AddRequest:
        return AddRequest("r", [1, 2], SamplingParams(max_tokens=4, priority=priority), 0.0)

    async def main():
        clock = Clock()
        adm = Admission(10, clock=clock, by_class=True, reserve=Reservations(5.0, lambda: 8, clock))
        seen = {(p, go): adm.urgency(add(p), go).params.priority for p in (-1, 0, 1) for go in (HOLD, TURN, NOW, ALONE, BURST, FRESH)}
        assert seen[(0, NOW)] == 0 and seen[(0, BURST)] == 1 and seen[(0, FRESH)] == 2 and seen[(0, TURN)] == seen[(0, HOLD)] == 3
        assert seen[(0, ALONE)] == 3  # a flood that was alone: a newcomer's request preempts it at a full rank
        assert seen[(-1, HOLD)] < seen[(0, NOW)] and seen[(0, HOLD)] < seen[(1, NOW)]  # classes first
        assert seen[(-1, BURST)] < seen[(0, NOW)] and seen[(1, BURST)] > seen[(0, HOLD)]
        assert seen[(-1, NOW)] < 0 and seen[(0, NOW)] >= 0  # (only negative ones are routed as urgent, as before)
        plain = add(0)
        assert Admission(10, clock=clock, reserve=Reservations(5.0, lambda: 8, clock)).urgency(plain, TURN) is plain  # fcfs
        assert Admission(10, clock=clock, by_class=True).urgency(plain, TURN) is plain  # no reservations
        assert plain.params.priority == 0  # never changed in place (a retried send starts from the class)
    asyncio.run(main())


def test_with_a_cap_at_its_share_a_flood_holds_no_more_than_its_share_while_others_are_active(monkeypatch):
    """DPSERVE_CAP_SHARE_X = x: an account's cap is at most x times its weighted share among the
    active accounts (shorter steps for the quiet ones), and none when it is alone."""
    import dpserve.daemons.api.reserve as reserve

    def flood_cap(x: float) -> int:
        monkeypatch.setattr(reserve, "CAP_SHARE_X", x)
        res = Reservations(5.0, lambda: 16, Clock(), headroom=1.0, min_headroom=1.0)
        assert res.check(0, "flood", 1) == ALONE
        res.started(0, "quiet", 1)  # 2 of 16 reserved for it: 1 + 1 headroom
        n = 0
        while res.check(0, "flood", 1) != HOLD:
            res.started(0, "flood", 1)
            n += 1
        return n

    assert flood_cap(0.0) == 14  # what the quiet one's reservation leaves
    assert flood_cap(1.0) == 8  # its share of 16 between two
    assert flood_cap(0.5) == 4


def test_with_nothing_held_an_account_at_its_cap_takes_a_free_place_where_the_engines_order_by_share(monkeypatch):
    """admission.may_pass: at its cap with no flood backlogged here, a request takes a free batch place
    as over-share work (TURN: engine priority + 1, the first to give its place) under the priority
    policy; held while anything is held, no place is free or a more urgent class is active (whose
    requests would have to preempt it), and always under fcfs (no preemption protects the reserved places)."""
    import asyncio

    import dpserve.daemons.api.admission as admission
    from dpserve.daemons.api.admission import Admission
    from dpserve.daemons.api.tenants import Tenant

    async def main():
        clock = Clock()
        t2 = Tenant("t2")
        for by_class in (True, False):
            res = Reservations(5.0, lambda: 8, clock)
            for name, n, ended in (("t1", 2, 1), ("t3", 3, 3), ("t2", 4, 0)):  # t1, t3 quiet now, their recent peaks 2 and 3
                for _ in range(n):
                    res.started(0, name, 1)
                for _ in range(ended):
                    res.ended(0, name)
            adm = Admission(10, clock=clock, by_class=by_class, reserve=res)
            # the others' reservations (their shares, 2 x 8 / 3) leave t2 8 - 16 / 3 places, with 3 free
            assert res.check(0, "t2", 1) == HOLD
            assert adm.may_pass(t2, 0) == (TURN if by_class else HOLD)
            if by_class:
                adm.free_place = lambda: False  # every rank's places taken (serving.py: has_place)
                assert adm.may_pass(t2, 0) == HOLD
                adm.free_place = lambda: True
                monkeypatch.setattr(admission, "FAIR_BURSTS", False)
                assert adm.may_pass(t2, 0) == HOLD
                monkeypatch.setattr(admission, "FAIR_BURSTS", True)
                res.started(-1, "interactive", 1)
                assert adm.may_pass(t2, 0) == HOLD  # a more urgent class is active: its reserved places stay free
                res.ended(-1, "interactive")
                held = adm.enqueue(Tenant("flood"), 0, 16, lambda: 0)
                assert adm.num_held == 1 and res.check(0, "t2", 1) == HOLD  # (at its cap of 8 - 2 x 2 among four)
                assert adm.may_pass(t2, 0) == HOLD  # a flood is backlogged: in fair order
                held.future.cancel()
    asyncio.run(main())


def test_a_held_burst_of_a_tenant_with_fewer_places_than_a_backlogged_flood_is_released_under_its_share(monkeypatch):
    """admission._under: the fair order's next held request goes as under its share (NOW: engine priority
    3 x class, to where it starts soonest, room or not) while its tenant, it counted, holds fewer places
    than a backlogged one; a tenant level with the largest waits for room as over-share work (TURN), so
    tenants within a place of each other do not preempt each other. The order stays the fair one: the
    flood's turn waits for room, and what is behind it too. Never under fcfs or with the switch off."""
    import asyncio

    import dpserve.daemons.api.admission as admission
    from dpserve.daemons.api.admission import Admission
    from dpserve.daemons.api.router import QueueFull
    from dpserve.daemons.api.tenants import Tenant

    flood, quiet = Tenant("flood"), Tenant("quiet")
    sent: list[tuple[str, int]] = []
    room = [0]

    def send_of(tenant: Tenant, box: list):
        def send() -> int:
            go = box[0].go
            if go != NOW:  # a request sent where it starts soonest (pinned) goes, full or not
                if room[0] <= 0:
                    raise QueueFull(1)
                room[0] -= 1
            sent.append((tenant.name, go))
            return 0
        return send

    def enqueue(adm: Admission, tenant: Tenant, cost: int) -> admission.Held:
        box: list = []
        box.append(adm.enqueue(tenant, 0, cost, send_of(tenant, box)))
        return box[0]

    async def main(by_class: bool, switch: bool, flood_cost: int) -> list[tuple[str, int]]:
        monkeypatch.setattr(admission, "RELEASE_UNDER", switch)
        sent.clear()
        clock = Clock()
        res = Reservations(5.0, lambda: 9, clock)  # (the quiet tenant's reservation, 2 + 2, leaves the flood 5)
        adm = Admission(10, clock=clock, by_class=by_class, reserve=res)
        for name, n in (("flood", 4), ("quiet", 2)):
            for _ in range(n):
                res.started(0, name, 1)
        helds = [enqueue(adm, flood, flood_cost) for _ in range(5)]
        room[0] = 2
        adm.release()
        assert sent == [("flood", TURN)]  # the flood alone held: room, over its share (now 5 places, its cap)
        sent.clear()
        room[0] = 0  # every rank full from here
        helds += [enqueue(adm, quiet, 16) for _ in range(4)]
        adm.release()  # the quiet tenant's tag is the lowest (backlogged at the class's virtual time)
        out = list(sent)
        room[0] = 1  # a flood's answer ended: its turn, then the quiet tenant's next again as under its share
        sent.clear()
        adm.release()
        for held in helds:
            held.future.cancel()
        return out + [("|", 0)] + sent

    q, f, bar = ("quiet", NOW), ("flood", TURN), ("|", 0)
    # a dear flood request moves its tag past four of the quiet tenant's: 2 -> 3 and 3 -> 4 places
    # against the flood's 5 go at once; the next would be level with it (5): it waits for room
    assert asyncio.run(main(True, True, 64)) == [q, q, bar, ("quiet", TURN)]
    # by tokens the two alternate: one, then the flood's turn, which waits for room; then both
    assert asyncio.run(main(True, True, 16)) == [q, bar, f, q]
    assert asyncio.run(main(True, False, 16)) == [bar, ("quiet", TURN)]
    assert asyncio.run(main(False, True, 16)) == [bar, ("quiet", TURN)]  # fcfs ranks: no preemption makes the place


def test_a_burst_of_a_tenant_below_its_share_on_average_goes_at_once_past_its_cap(monkeypatch):
    """admission._bursts: at its cap, a tenant that asked for fewer places than its share on average
    over the window (a quiet tenant mid-burst) goes at once as a burst (BURST: engine priority between
    under- and over-share work, to where it starts soonest); a flood over its share, a tenant active for
    less than a window (a flood's onset has no average yet), one a share past its cap, fcfs ranks and the
    switch off: held. A newcomer's reserved request goes as FRESH, after bursts. A held
    one of such a tenant is released as a burst in fair order, where an account at its cap is passed over."""
    import asyncio

    import dpserve.daemons.api.reserve as reserve
    from dpserve.daemons.api.admission import Admission
    from dpserve.daemons.api.router import QueueFull
    from dpserve.daemons.api.tenants import Tenant

    t2, flood, late = Tenant("t2"), Tenant("flood"), Tenant("late")
    sent: list[tuple[str, int]] = []

    def send_of(tenant: Tenant, box: list):
        def send() -> int:
            if box[0].go == TURN:
                raise QueueFull(1)  # every rank full: only a request sent where it starts soonest goes
            sent.append((tenant.name, box[0].go))
            return 0
        return send

    async def main(by_class: bool, switch: bool) -> tuple[int, int, int, list]:
        monkeypatch.setattr(reserve, "SHARE_BURSTS", switch)
        sent.clear()
        clock = Clock()
        res = Reservations(5.0, lambda: 8, clock)
        adm = Admission(10, clock=clock, by_class=by_class, reserve=res)
        for name, n in (("t1", 1), ("t3", 1), ("t2", 1), ("flood", 4)):
            for _ in range(n):
                res.started(0, name, 1)
        clock.now += 10.0  # two windows at these counts: t2 asked for 1 place on average, its share is 2
        for _ in range(3):
            res.started(0, "t2", 1)  # its burst: 4, at its cap (8 - the other quiet ones' 1 + 1 + 2 headroom)
        helds = []
        for _ in range(3):
            box: list = []
            box.append(adm.enqueue(flood, 0, 16, send_of(flood, box)))
            helds.append(box[0])
        res.started(0, "late", 1)
        for _ in range(3):
            res.started(0, "late", 1)  # a tenant active for less than a window, at its cap too
        assert res.check(0, "t2", 1, True) == (BURST if switch else HOLD) and res.check(0, "t2", 1) == HOLD
        assert res.check(0, "late", 1, True) == res.check(0, "flood", 1, True) == HOLD
        go = adm.may_pass(t2, 0), adm.may_pass(late, 0), adm.may_pass(flood, 0)
        # under its reservation: NOW with a window's history, FRESH (less urgent than a burst) without
        assert res.check(0, "t1", 1, True) == NOW and res.check(0, "new", 1, True) == NOW  # (its first: no flood)
        res.started(0, "t2", 1)
        res.started(0, "t2", 1)  # 6: one share (2) past its cap: a burst is bounded
        assert res.check(0, "t2", 1, True) == HOLD
        for _ in range(4):
            res.ended(0, "t2")  # 2: past its reservation (min(2, peak + 2) among 4), under its cap: TURN, or a burst
        assert res.check(0, "t2", 1) == TURN and res.check(0, "t2", 1, True) == (BURST if switch else TURN)
        for _ in range(2):
            res.started(0, "t2", 1)
        box = []
        box.append(adm.enqueue(t2, 0, 16, send_of(t2, box)))  # held (as by a send that failed): fair order
        helds.append(box[0])
        adm.release()  # the flood, at its cap, is passed over (reservations); t2 is not
        res.started(0, "new", 1)
        assert res.check(0, "new", 1, True) == FRESH and res.check(0, "new", 1) == NOW
        for held in helds:
            held.future.cancel()
        return (*go, list(sent))

    assert asyncio.run(main(True, True)) == (BURST, HOLD, HOLD, [("t2", BURST)])
    assert asyncio.run(main(True, False)) == (HOLD, HOLD, HOLD, [])
    assert asyncio.run(main(False, True)) == (HOLD, HOLD, HOLD, [])  # fcfs ranks: no preemption


def test_an_account_idle_for_two_windows_starts_afresh_and_is_trusted_after_one():
    """The history behind lending and bursts (reserve._has_history, Demand.mean_at): an account is
    trusted once active for a window; a gap shorter than two windows keeps its history (and counts
    as zero demand in its average); a longer one starts it afresh."""
    clock = Clock()
    res = Reservations(5.0, lambda: 8, clock)
    res.started(0, "a", 1)
    d = res.accounts[(0, "a")]
    assert not res._has_history(d, clock.now)
    clock.now += 5.0
    assert res._has_history(d, clock.now) and abs(d.mean_at(clock.now, 5.0) - (1 - 2.718281828 ** -1)) < 1e-6
    res.ended(0, "a")
    clock.now += 9.0  # idle under two windows
    res.started(0, "a", 1)
    assert res._has_history(d, clock.now) and d.mean_at(clock.now, 5.0) < 0.2
    res.ended(0, "a")
    clock.now += 10.0  # idle two windows
    res.started(0, "a", 1)
    assert not res._has_history(d, clock.now) and d.mean_at(clock.now, 5.0) == 0.0
