"""Places reserved by recent demand (daemons/api/reserve.py), on a virtual clock: how long
an idle account keeps its reservation, and (cluster-wide) whose requests count."""

from __future__ import annotations

from dpserve.daemons.api.reserve import ALONE, HOLD, LINGER_WINDOWS, NOW, TURN, Reservations


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


def test_quiet_accounts_of_a_class_lend_each_other_their_free_reserved_places():
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
    assert res.check(0, "c", 1) == NOW  # the class's quiet use 1 + 9 < its reservation min(2 x 16 / 3, 4 + 16 / 3 + 2)
    res.started(0, "c", 1)  # 10: the pool is used up
    assert res.check(0, "c", 1) == TURN
