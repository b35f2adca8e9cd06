"""Rank selection and the coordinator's rank table: pure state, no sockets."""

from __future__ import annotations

import pytest
from dpserve.daemons.coordinator import RankTable
from dpserve.daemons.openai_types import ApiError
from dpserve.daemons.router import Router, parse_rank_header
from dpserve.engine.protocol import (
    PROTOCOL_VERSION,
    EngineReady,
    EngineRegister,
    LoadReport,
    LoadTable,
    RankLoad,
)


def table(seq: int, *loads: RankLoad) -> LoadTable:
    return LoadTable(seq, 4, list(loads))


def live_router(n: int = 4, policy: str = "queue", **kw) -> Router:
    router = Router(n, policy, **kw)
    router.update_table(table(1, *(RankLoad(r, f"i{r}", True) for r in range(n))))
    for r in range(n):
        router.engine_hello(r, f"i{r}")
    return router


def test_queue_policy_picks_lowest_four_waiting_plus_running():
    router = live_router()
    router.update_table(table(2, RankLoad(0, "i0", True, 3, 0), RankLoad(1, "i1", True, 0, 1), RankLoad(2, "i2", True, 5, 0), RankLoad(3, "i3", True, 2, 1)))
    # scores: 3, 4, 5, 6
    assert router.pick() == 0


def test_own_unreported_sends_spread_a_burst():
    router = live_router()
    picks = []
    for _ in range(8):
        rank = router.pick()
        router.on_send(rank, 10)
        picks.append(rank)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_new_table_resets_unreported_counts_but_not_inflight():
    router = live_router(2)
    router.on_send(0, 5)
    router.update_table(table(2, RankLoad(0, "i0", True), RankLoad(1, "i1", True)))
    assert router.sent == [0, 0] and router.inflight == [1, 0]
    assert router.pick() == 1  # rank 0 still holds our in-flight request


def test_tokens_policy_sees_prompt_length_skew():
    router = live_router(2, "tokens")
    # rank 0: one 10,000-token prompt waiting; rank 1: two 1,000-token prompts waiting
    router.update_table(table(2, RankLoad(0, "i0", True, 0, 1, 10_000, 0), RankLoad(1, "i1", True, 0, 2, 2_000, 0)))
    assert router.pick() == 1
    queue = live_router(2, "queue")
    queue.update_table(table(2, RankLoad(0, "i0", True, 0, 1, 10_000, 0), RankLoad(1, "i1", True, 0, 2, 2_000, 0)))
    assert queue.pick() == 0  # queue counts requests, not work


def test_rank_is_routable_only_when_alive_and_greeted_by_same_incarnation():
    router = Router(2)
    router.update_table(table(1, RankLoad(0, "a", True), RankLoad(1, "b", True)))
    assert router.routable_ranks == []
    router.engine_hello(0, "a")
    router.engine_hello(1, "old")
    assert router.routable_ranks == [0]
    lost = router.update_table(table(2, RankLoad(0, "a", False, down_reason="gone"), RankLoad(1, "b", True)))
    assert lost == [(0, "gone")]
    with pytest.raises(ApiError) as err:
        router.pick()
    assert err.value.status == 503


def test_restarted_incarnation_fails_old_requests():
    router = live_router(2)
    lost = router.update_table(table(2, RankLoad(0, "new", True), RankLoad(1, "i1", True)))
    assert lost == [(0, "rank restarted")]


def test_admission_control_gives_429_when_every_rank_is_full():
    router = live_router(2, max_waiting_per_rank=2)
    router.update_table(table(2, RankLoad(0, "i0", True, 0, 2), RankLoad(1, "i1", True, 0, 5)))
    with pytest.raises(ApiError) as err:
        router.pick()
    assert err.value.status == 429 and err.value.headers["Retry-After"]


def test_eligible_ranks_and_pins():
    router = live_router(4, eligible=[2, 3])
    assert {router.pick() for _ in range(4)} <= {2, 3}
    with pytest.raises(ApiError) as err:
        router.check_pin(0)
    assert err.value.status == 400 and "2, 3" in err.value.message
    router.check_pin(3)


@pytest.mark.parametrize("value, expected", [(None, None), ("0", 0), ("3", 3), ("03", 3)])
def test_rank_header_valid(value, expected):
    assert parse_rank_header(value, 4) == expected


# ASCII digits only: int() alone would take the signs, spaces, underscores and
# non-ASCII digits here; a long run of digits must not reach int() either.
@pytest.mark.parametrize("value", ["x", "1.0", "", "4", "-1", "+1", " 1 ", "0_1", "\uff11", "\u0661", "1" * 5000])
def test_rank_header_invalid(value):
    with pytest.raises(ApiError) as err:
        parse_rank_header(value, 4)
    assert err.value.status == 400


def register(rank: int, inc: str, fp: str = "fp", version: int = PROTOCOL_VERSION) -> EngineRegister:
    return EngineRegister(rank, inc, fp, 1, "host", 0, version)


def test_rank_table_registration_rules():
    t = RankTable(2, "fp", stale_after_s=5)
    assert "fingerprint" in t.register(register(0, "a", fp="other"), 0)
    assert "protocol version" in t.register(register(0, "a", version=PROTOCOL_VERSION + 1), 0)
    assert "outside" in t.register(register(2, "a"), 0)
    assert t.register(register(0, "a"), 0) == ""
    assert t.ready(EngineReady(0, "a"), 0)
    # a second live engine claiming rank 0 is refused ...
    assert "already served" in t.register(register(0, "b"), 1)
    # ... unless the holder went quiet
    assert t.register(register(0, "b"), 10) == ""


def test_rank_table_expiry_and_reregistration():
    t = RankTable(1, "fp", stale_after_s=1)
    t.register(register(0, "a"), 0)
    t.ready(EngineReady(0, "a"), 0)
    assert t.expire(0.5) == []
    assert t.expire(2.0) == [0]
    snap = t.snapshot()
    assert snap.ranks[0].is_alive is False and "no load report" in snap.ranks[0].down_reason
    # a lost engine's reports are not taken back silently: it must register again
    assert not t.load(LoadReport(0, "a", 0, 0, 0, 0, 0.0, 0.0), 2.1)
    assert t.register(register(0, "a"), 2.2) == ""
    assert t.ready(EngineReady(0, "a"), 2.2)
    assert t.snapshot().ranks[0].is_alive


def test_tokens_policy_counts_own_inflight_work_the_table_has_not_seen():
    # a long prompt admitted at once never shows up as waiting; our in-flight count does
    router = live_router(2, "tokens")
    router.on_send(0, 1800)
    router.update_table(table(2, RankLoad(0, "i0", True, 1, 0, 0, 0), RankLoad(1, "i1", True, 1, 0, 0, 40)))
    assert router.pick() == 1


def test_tokens_policy_forgets_a_prefill_once_it_is_done():
    router = live_router(2, "tokens")
    router.on_send(0, 1800 + 16)  # a long prompt, 16 answer tokens allowed
    router.on_send(1, 20 + 16)
    router.on_send(1, 20 + 16)
    router.update_table(table(2, RankLoad(0, "i0", True, 1, 0, 0, 16), RankLoad(1, "i1", True, 2, 0, 0, 32)))
    assert router.pick() == 1  # rank 0 is still prefilling 1,800 tokens
    router.on_progress(0, 1800 + 1)  # its first token came back: only 15 answer tokens remain
    router.on_progress(1, 20 + 1)
    router.on_progress(1, 20 + 1)
    assert router.inflight_tokens == [15, 30]
    assert router.pick() == 0
    router.on_finish(0, 15)
    assert router.inflight_tokens[0] == 0 and router.inflight[0] == 0
