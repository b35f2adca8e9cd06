"""Places reserved by recent demand (daemons/api/reserve.py), on a virtual clock: how long
an idle account keeps its reservation, and (cluster-wide) whose requests count."""

from __future__ import annotations

from dpserve.daemons.api.reserve import ALONE, HOLD, LINGER_WINDOWS, NOW, Reservations


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_more_urgent_class_keeps_its_reservation_while_a_less_urgent_one_floods():
    clock = Clock()
    res = Reservations(5.0, lambda: 16, clock)
    res.started(0, "interactive", 1)
    res.ended(0, "interactive")  # idle from t = 100
    for _ in range(14):
        res.started(1, "bulk", 1)
    assert res.check(1, "bulk", 1) == HOLD  # 16 - the interactive class's reservation (peak 1 + 2), then (peak decayed) 2
    clock.now += 30.0  # idle 6 windows: a lone tenant's reservation would have lapsed after one
    assert res.check(1, "bulk", 1) == HOLD and res.check(0, "interactive", 1) == NOW
    assert res.next_expiry() == 100.0 + 5.0 * LINGER_WINDOWS  # the wake-up for held bulk requests
    clock.now = 100.0 + 5.0 * LINGER_WINDOWS
    assert res.check(1, "bulk", 1) == ALONE and list(res.accounts) == [(1, "bulk")]


def test_an_idle_account_of_the_same_or_a_less_urgent_class_lapses_after_one_window():
    clock = Clock()
    res = Reservations(5.0, lambda: 16, clock)
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
    assert res.check(2, "x", 1) == ALONE
