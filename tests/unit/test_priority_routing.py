"""Routing of a request more urgent than the default (priority < 0): the rank where it starts
soonest, its running batch, not its queue (pure state, no sockets)."""

from __future__ import annotations

import pytest
from dpserve.daemons.api.router import NoRankAvailable, QueueFull, Router
from dpserve.engine.common.protocol import LoadTable, RankLoad


def router_with(*loads: RankLoad, policy: str = "tokens", **kw) -> Router:
    router = Router(len(loads), policy, **kw)
    router.update_table(LoadTable(1, len(loads), list(loads)))
    for load in loads:
        router.engine_hello(load.rank, load.incarnation)
    return router


def test_an_urgent_request_goes_to_the_short_batch_behind_a_long_queue():
    # rank 0: 2 running, a flood of 6,000 prompt tokens waiting; rank 1: 12 running, no queue
    router = router_with(RankLoad(0, "a", True, 2, 40, 6000, 100), RankLoad(1, "b", True, 12, 0, 0, 800))
    assert router.pick() == 1  # the usual pick: the least outstanding work
    assert router.pick_urgent() == 0  # an urgent request passes rank 0's queue: its batch is shorter


@pytest.mark.parametrize("policy", ["tokens", "queue", "round-robin", "cache-aware"])
def test_a_burst_of_urgent_requests_spreads_and_ties_go_by_the_usual_score(policy):
    router = router_with(*(RankLoad(r, f"i{r}", True, 4, 0, 0, 100 * (r + 1)) for r in range(3)), policy=policy)
    picks = []
    for _ in range(6):
        rank = router.pick_urgent(None, [1, 2, 3])
        router.on_send(rank, 10)
        picks.append(rank)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    if policy in ("tokens", "cache-aware"):
        assert picks[0] == 0  # equal batches: the lighter rank first


def test_urgent_picks_skip_full_and_unroutable_ranks_and_raise_as_pick_does():
    router = router_with(RankLoad(0, "a", True, 0, 2), RankLoad(1, "b", True, 9, 0), max_waiting_per_rank=2)
    assert router.pick_urgent() == 1  # rank 0 is at its waiting limit
    router.update_table(LoadTable(2, 2, [RankLoad(1, "b", True, 9, 2)]))
    with pytest.raises(QueueFull):
        router.pick_urgent()
    router.update_table(LoadTable(3, 2, [RankLoad(0, "a", False), RankLoad(1, "b", False)]))
    with pytest.raises(NoRankAvailable):
        router.pick_urgent()


def test_a_pin_wins_over_the_urgent_pick():
    router = router_with(RankLoad(0, "a", True, 0), RankLoad(1, "b", True, 50))
    assert router.pick_urgent(1) == 1
