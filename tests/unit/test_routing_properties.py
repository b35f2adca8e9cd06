"""The indexed router against a reference exact scan (hypothesis).

The reference is the linear scan the router used before issue 19: from the
rotation point, skip unroutable ranks and ranks at their waiting-queue limit,
keep the first strictly lower score (round-robin: the first candidate). Any
sequence of tables (full or partial), hellos, deaths, sends, progress and
finishes must leave the index giving the same answer as that scan over the
same state: the same rank, or the same failure (429 when every routable rank
is full, 503 when none is routable), and the same answer to a pin.
"""

from __future__ import annotations

import pytest
from dpserve.daemons.api.router import NoRankAvailable, QueueFull, RankLost, Router
from dpserve.engine.common.protocol import LoadTable, RankLoad
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)


def reference_pick(router: Router, start: int) -> int | str:
    """The exact scan: a rank, or 'full' (429) or 'none' (503)."""
    eligible = router.eligible
    n = len(eligible)
    best, best_score, any_routable = -1, 0, False
    for i in range(n):
        rank = eligible[(start + i) % n]
        if not router.routable(rank):
            continue
        any_routable = True
        if router.loads[rank].num_waiting + router.sent[rank] >= router.max_waiting_per_rank:
            continue
        if router.policy == "round-robin":
            return rank
        s = router.score(rank)
        if best < 0 or s < best_score:
            best, best_score = rank, s
    if best >= 0:
        return best
    return "full" if any_routable else "none"


def actual_pick(router: Router, pinned: int | None = None) -> int | str:
    try:
        return router.pick(pinned)
    except QueueFull:
        return "full"
    except (NoRankAvailable, RankLost):  # a pin to a lost rank fails at once: no rank either way
        return "none"


def entries(draw, size: int, ranks: list[int]) -> list[RankLoad]:
    out = []
    for rank in ranks:
        waiting = draw(st.integers(0, 4))
        out.append(
            RankLoad(
                rank,
                draw(st.sampled_from(["a", "b"])),  # two incarnations: restarts happen
                draw(st.booleans() | st.just(True)),
                draw(st.integers(0, 6)),
                waiting,
                # few distinct values, so ties are common
                draw(st.sampled_from([0, 10, 20])) * waiting,
                draw(st.sampled_from([0, 8, 16])),
            )
        )
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_index_answers_like_the_exact_scan(data):
    draw = data.draw
    size = draw(st.integers(1, 9))
    eligible = draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size, unique=True).map(sorted))
    policy = draw(st.sampled_from(["tokens", "queue", "round-robin"]))
    router = Router(size, policy, max_waiting_per_rank=draw(st.integers(1, 4)), eligible=eligible)
    seq = 0
    inflight: list[list[int]] = []  # [rank, remaining tokens] of our requests
    for _ in range(draw(st.integers(1, 60))):
        op = draw(st.sampled_from(["table", "table", "hello", "dead", "pick", "pick", "pick", "pin", "progress", "finish"]))
        if op == "table":
            seq += 1
            ranks = draw(st.lists(st.integers(0, size - 1), unique=True, max_size=size))
            router.update_table(LoadTable(seq, size, entries(draw, size, ranks)))
        elif op == "hello":
            router.engine_hello(draw(st.integers(0, size - 1)), draw(st.sampled_from(["a", "b"])))
        elif op == "dead":
            rank = draw(st.integers(0, size - 1))
            router.engine_dead(rank, router.hello[rank])
        elif op == "pin":
            rank = draw(st.integers(0, size - 1))
            expected = rank if router.routable(rank) else "none"
            rotate = router._rotate
            assert actual_pick(router, rank) == expected
            assert router._rotate == rotate  # a pin does not move the rotation
        elif op == "pick":
            expected = reference_pick(router, router._rotate)
            got = actual_pick(router)
            assert got == expected, (policy, router.eligible)
            if isinstance(got, int):
                tokens = draw(st.sampled_from([5, 30, 200]))
                router.on_send(got, tokens)
                inflight.append([got, tokens])
        elif op == "progress" and inflight:
            req = inflight[draw(st.integers(0, len(inflight) - 1))]
            done = draw(st.integers(0, req[1]))
            req[1] -= done
            router.on_progress(req[0], done)
        elif op == "finish" and inflight:
            rank, remaining = inflight.pop(draw(st.integers(0, len(inflight) - 1)))
            router.on_finish(rank, remaining)
    # the bookkeeping the index keeps beside the scan agrees with a recount
    assert router.num_routable == sum(router.routable(r) for r in router.eligible)
    expected = reference_pick(router, router._rotate)
    assert actual_pick(router) == expected


def test_ties_rotate_through_every_candidate():
    router = Router(5, "queue")
    router.update_table(LoadTable(1, 5, [RankLoad(r, "a", True) for r in range(5)]))
    for r in (0, 1, 3, 4):  # rank 2 never says hello: skipped, never picked
        router.engine_hello(r, "a")
    assert [router.pick() for _ in range(5)] == [0, 1, 3, 3, 4]


def test_a_partial_table_keeps_the_other_ranks_unreported_sends():
    router = Router(2, "queue")
    router.update_table(LoadTable(1, 2, [RankLoad(0, "a", True), RankLoad(1, "a", True)]))
    router.engine_hello(0, "a")
    router.engine_hello(1, "a")
    router.on_send(0, 10)
    router.on_send(1, 10)
    router.update_table(LoadTable(2, 2, [RankLoad(0, "a", True, num_running=1)]))
    assert router.sent == [0, 1]  # rank 0 reported since; rank 1 did not
