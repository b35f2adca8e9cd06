"""The priority scheduling policy (vLLM's --scheduling-policy priority): waiting order,
preemption of lower priorities for a higher one, and fcfs left as it was (no model, no tensors)."""

from __future__ import annotations

import pytest
from dpserve.engine import scheduler
from dpserve.engine.common.protocol import SamplingParams
from dpserve.engine.kv_cache import BlockManager
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.sequence import Sequence, SequenceStatus


def seq(rid: str, n: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, [7] * n, SamplingParams(max_tokens=max_tokens, priority=priority), arrival, "cpu")


def run_step(sched: Scheduler) -> dict[str, int]:
    """schedule(), then what the engine does after a forward: advance, and sample a token for the caught-up."""
    plan = sched.schedule()
    for s, n in plan:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(9)
    check_blocks(sched)
    return {s.request_id: n for s, n in plan}


def finish_done(sched: Scheduler) -> list[str]:
    done = [s for s in sched.running if s.num_output_tokens >= s.params.max_tokens]
    sched.finish(done)
    return [s.request_id for s in done]


def check_blocks(sched: Scheduler) -> None:
    owned = [b for s in sched.running for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block owned twice"
    assert len(owned) + sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert all(not s.block_table and s.num_computed_tokens == 0 for s in sched.waiting)
    assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)
    assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
    assert sched.num_waiting_prefill_tokens == sum(s.num_tokens for s in sched.waiting) + sum(
        s.num_uncomputed_tokens for s in sched.running if s.is_prefilling)
    if sched.is_priority:
        keys = [(s.params.priority, s.arrival_time) for s in sched.waiting]
        assert keys == sorted(keys), "the waiting queue lost its (priority, arrival) order"


def admission_order(policy: str) -> list[str]:
    """One slot; every request queued before the first step; the order they run in."""
    sched = Scheduler(1, 100, BlockManager(64, 4), policy=policy)
    for rid, prio, t in [("a", 1, 0.0), ("b", 0, 1.0), ("c", 0, 2.0), ("d", -1, 3.0), ("e", 1, 4.0)]:
        sched.add(seq(rid, 8, prio, t, max_tokens=2))
    order = []
    while sched.has_unfinished:
        plan = run_step(sched)
        order += [rid for rid in plan if rid not in order]
        finish_done(sched)
    return order


def test_waiting_requests_run_by_priority_then_arrival():
    assert admission_order("priority") == ["d", "b", "c", "a", "e"]
    assert admission_order("fcfs") == ["a", "b", "c", "d", "e"]  # priority ignored: arrival order


def test_equal_keys_keep_the_order_they_were_added():
    sched = Scheduler(1, 100, BlockManager(64, 4), policy="priority")
    for rid in "xyz":
        sched.add(seq(rid, 4, 0, 5.0))
    assert [s.request_id for s in sched.waiting] == ["x", "y", "z"]


def test_a_higher_priority_takes_the_slot_of_the_latest_lowest_one():
    sched = Scheduler(2, 100, BlockManager(64, 4), policy="priority", isolate_urgent=False)  # (mixed steps)
    sched.add(seq("low-old", 8, 5, 0.0, max_tokens=50))
    sched.add(seq("low-new", 8, 5, 1.0, max_tokens=50))
    run_step(sched)
    run_step(sched)
    sched.add(seq("same", 8, 5, 2.0))  # its own priority: waits, preempts nobody
    assert "same" not in run_step(sched) and sched.num_preemptions == 0
    sched.add(seq("high", 8, 0, 3.0))
    plan = run_step(sched)
    assert plan["high"] == 8 and "low-new" not in plan and plan["low-old"] == 1
    assert sched.num_preemptions == 1
    # the victim waits ahead of the later arrival of its own priority, and keeps its outputs
    assert [s.request_id for s in sched.waiting] == ["low-new", "same"]
    assert sched.waiting[0].num_output_tokens == 3 and sched.waiting[0].num_preemptions == 1
    # and the high one is never displaced by the low ones it displaced
    for _ in range(3):
        assert "high" in run_step(sched)
    assert sched.num_preemptions == 1


def test_a_higher_priority_preempts_for_kv_blocks():
    sched = Scheduler(8, 100, BlockManager(12, 4), policy="priority", isolate_urgent=False)  # 48 tokens of KV; mixed steps
    sched.add(seq("low-a", 20, 1, 0.0, max_tokens=30))
    sched.add(seq("low-b", 20, 1, 1.0, max_tokens=30))
    run_step(sched)
    assert sched.blocks.num_free_blocks <= 2
    sched.add(seq("high", 16, 0, 2.0))
    plan = run_step(sched)
    assert plan.get("high") == 16, plan
    assert [s.request_id for s in sched.waiting] == ["low-b"]  # the later of the two lows
    assert "low-a" in plan


def test_no_preemption_when_all_lower_ones_together_cannot_make_room():
    sched = Scheduler(8, 100, BlockManager(12, 4), policy="priority")
    sched.add(seq("high-running", 28, 0, 0.0, max_tokens=10))
    sched.add(seq("low", 8, 3, 1.0, max_tokens=10))
    run_step(sched)
    run_step(sched)  # (the first was an urgent step: "low" starts in the second)
    sched.add(seq("mid", 24, 1, 2.0))  # needs 6 blocks; "low" holds 2-3, "high-running" is not lower
    plan = run_step(sched)
    assert "mid" not in plan and sched.num_preemptions == 0
    assert {s.request_id for s in sched.running} == {"high-running", "low"}


def test_kv_pressure_of_running_ones_preempts_the_lowest_priority_not_the_newest():
    def victim(policy: str) -> str:
        sched = Scheduler(8, 100, BlockManager(6, 4), policy=policy)  # 24 tokens
        sched.add(seq("low", 7, 1, 0.0, max_tokens=20))
        run_step(sched)
        sched.add(seq("high", 7, 0, 1.0, max_tokens=20))
        run_step(sched)  # both fit: 2 blocks each
        while not sched.num_preemptions:
            run_step(sched)
        return sched.waiting[0].request_id

    assert victim("priority") == "low"
    assert victim("fcfs") == "high"  # the most recently admitted, as before


def test_prefill_chunks_go_in_priority_order():
    def chunks(policy: str) -> dict[str, int]:
        sched = Scheduler(8, 12, BlockManager(64, 4), long_prefill_token_threshold=10, policy=policy, isolate_urgent=False)
        sched.add(seq("d", 2, 0, 0.0, max_tokens=50))
        run_step(sched)  # d decodes from now on, so prefill chunks are at most 10
        sched.add(seq("low", 100, 1, 1.0))
        assert run_step(sched) == {"d": 1, "low": 10}
        sched.add(seq("high", 100, 0, 2.0))
        assert run_step(sched) == {"d": 1, "low": 10, "high": 1}  # what the budget left
        return run_step(sched)

    assert chunks("priority") == {"d": 1, "high": 10, "low": 1}
    assert chunks("fcfs") == {"d": 1, "low": 10, "high": 1}


def test_a_paused_running_one_is_preempted_for_a_higher_one_and_waits():
    sched = Scheduler(1, 100, BlockManager(64, 4), policy="priority")
    sched.add(seq("low", 8, 1, 0.0, max_tokens=20))
    run_step(sched)
    sched.paused.add("low")
    sched.add(seq("high", 8, 0, 1.0))
    assert run_step(sched) == {"high": 8}
    assert [s.request_id for s in sched.waiting] == ["low"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority"):
        Scheduler(1, 10, BlockManager(4, 4), policy="lifo")


@pytest.mark.parametrize("in_a_row", [1, 2])
def test_urgent_steps_leave_the_less_urgent_out_at_most_n_in_a_row(in_a_row: int):
    """A waiting request more urgent than running ones gets a step without them (its prefill
    neither shares a step with bulk decodes nor waits behind them); another that came during
    that step gets the next one so too (with in_a_row 2), and the bulk then gets a step back
    even if a third arrives: it runs at least every (in_a_row + 1)th step."""
    sched = Scheduler(8, 100, BlockManager(64, 4), policy="priority", urgent_in_a_row=in_a_row)
    for i in range(3):
        sched.add(seq(f"bulk{i}", 8, 1, float(i), max_tokens=50))
    run_step(sched)
    bulk = {"bulk0": 1, "bulk1": 1, "bulk2": 1}
    sched.add(seq("quiet", 8, 0, 5.0, max_tokens=50))
    assert run_step(sched) == {"quiet": 8}
    sched.add(seq("quiet2", 8, 0, 6.0, max_tokens=50))
    if in_a_row == 2:
        assert run_step(sched) == {"quiet": 1, "quiet2": 8}  # equally urgent ones stay in
        sched.add(seq("quiet3", 8, 0, 7.0, max_tokens=50))
        assert run_step(sched) == {**bulk, "quiet": 1, "quiet2": 1, "quiet3": 8}
    else:
        assert run_step(sched) == {**bulk, "quiet": 1, "quiet2": 8}
        sched.add(seq("quiet3", 8, 0, 7.0, max_tokens=50))
        assert run_step(sched) == {"quiet": 1, "quiet2": 1, "quiet3": 8}  # equally urgent ones stay in
    assert sched.num_preemptions == 0 and len(sched.running) == 6
    sched.add(seq("same", 8, 1, 8.0, max_tokens=50))  # not more urgent than any running one: a plain step
    assert len(run_step(sched)) == 7
    plain = Scheduler(8, 100, BlockManager(64, 4), policy="priority", isolate_urgent=False)
    for s in (seq("bulk", 8, 1, 0.0, max_tokens=50), seq("quiet", 8, 0, 1.0, max_tokens=50)):
        plain.add(s)
        last = run_step(plain)
    assert last == {"bulk": 1, "quiet": 8}


def test_an_urgent_step_admits_no_less_urgent_waiting_one():
    """Places free: the urgent step still holds only the urgent prefill and work as urgent
    (a bulk prefill admitted beside it would make the step it waits for longer)."""
    sched = Scheduler(8, 100, BlockManager(64, 4), policy="priority")
    sched.add(seq("bulk0", 8, 1, 0.0, max_tokens=50))
    run_step(sched)
    sched.add(seq("bulk1", 8, 1, 1.0, max_tokens=50))
    sched.add(seq("quiet", 8, 0, 2.0, max_tokens=50))
    assert run_step(sched) == {"quiet": 8}
    assert run_step(sched) == {"bulk0": 1, "quiet": 1, "bulk1": 8}  # the plain step after admits it


@pytest.mark.parametrize("over_waiting", [True, False])
def test_a_flood_s_onset_into_free_places_does_not_share_the_urgent_prefill_s_step(over_waiting, monkeypatch):
    """Nothing less urgent running, places free, and a flood's requests waiting beside a quiet one:
    the quiet prefill's step admits none of them (a trace had 7 prefills in one step, 0.59 s, for a
    quiet request's first token); they start in the next. Before (DPSERVE_URGENT_OVER_WAITING=0) one step."""
    monkeypatch.setattr(scheduler, "URGENT_OVER_WAITING", over_waiting)
    for running in (True, False):
        sched = Scheduler(8, 100, BlockManager(64, 4), policy="priority")
        if running:
            sched.add(seq("quiet", 8, 0, 0.0, max_tokens=50))
            run_step(sched)
        for i in range(3):
            sched.add(seq(f"flood{i}", 8, 3, 1.0 + i, max_tokens=50))
        sched.add(seq("quiet2", 8, 0, 5.0, max_tokens=50))
        before = {"quiet": 1} if running else {}
        floods = {f"flood{i}": 8 for i in range(3)}
        if over_waiting:
            assert run_step(sched) == {**before, "quiet2": 8} and sched.was_isolated
            assert run_step(sched) == {**before, "quiet2": 1, **floods}
        else:
            assert run_step(sched) == {**before, "quiet2": 8, **floods}
    for places, urgent in ((2, False), (3, True)):  # a full batch admits no flood either way: a plain step
        full = Scheduler(places, 100, BlockManager(64, 4), policy="priority")
        full.add(seq("quiet", 8, 0, 0.0, max_tokens=50))
        run_step(full)
        full.add(seq("flood", 8, 3, 1.0, max_tokens=50))
        full.add(seq("quiet2", 8, 0, 2.0, max_tokens=50))
        flood = {} if places == 2 or over_waiting else {"flood": 8}
        assert run_step(full) == {"quiet": 1, "quiet2": 8, **flood}
        assert full.was_isolated is (urgent and bool(over_waiting))
    same = Scheduler(8, 100, BlockManager(64, 4), policy="priority")  # one level waiting: a plain step
    for i in range(3):
        same.add(seq(f"r{i}", 8, 1, float(i)))
    assert len(run_step(same)) == 3 and not same.was_isolated


def test_among_equal_priorities_a_started_one_is_preempted_before_one_in_its_prefill():
    """A preemption delays a started request's next tokens, but a not yet started one's first
    token: among the least urgent, the one past its first token goes (vLLM: the latest)."""
    def victim(policy: str) -> str:
        sched = Scheduler(2, 20, BlockManager(64, 4), long_prefill_token_threshold=10, policy=policy, isolate_urgent=False)
        sched.add(seq("started", 4, 1, 0.0, max_tokens=50))
        run_step(sched)
        sched.add(seq("prefilling", 60, 1, 1.0, max_tokens=50))  # 10-token chunks: no token for 6 steps
        run_step(sched)
        sched.add(seq("urgent", 4, 0, 2.0))
        plan = run_step(sched)
        assert plan.get("urgent") == 4 and sched.num_preemptions == 1
        return sched.waiting[0].request_id

    assert victim("priority") == "started"
    sched = Scheduler(2, 12, BlockManager(64, 4), policy="priority", isolate_urgent=False)
    for rid, prio, t in [("old", 1, 0.0), ("new", 1, 1.0)]:  # both started: the latest, as vLLM
        sched.add(seq(rid, 4, prio, t, max_tokens=50))
    run_step(sched)
    sched.add(seq("urgent", 4, 0, 2.0))
    run_step(sched)
    assert [s.request_id for s in sched.waiting] == ["new"]


@pytest.mark.parametrize("burst_priority", [1, 2])
def test_a_second_urgent_step_in_a_row_leaves_out_no_request_between_before_its_first_token(burst_priority: int):
    """A request of a priority between the urgent and the bulk (a quiet tenant's burst) still
    before its first token is left out of one urgent step, not two in a row: the step after is a
    plain one. One of the bulk's own priority is not protected so."""
    sched = Scheduler(8, 20, BlockManager(64, 4), long_prefill_token_threshold=10, policy="priority", urgent_in_a_row=2)
    sched.add(seq("bulk", 4, 2, 0.0, max_tokens=50))
    run_step(sched)
    sched.add(seq("burst", 40, burst_priority, 1.0, max_tokens=50))  # 10-token chunks beside a decode
    run_step(sched)  # (an urgent step of its own when it is more urgent than the bulk)
    if burst_priority == 1:
        assert run_step(sched) == {"bulk": 1, "burst": 10}
    assert sched.running[-1].is_prefilling
    sched.add(seq("quiet", 4, 0, 2.0, max_tokens=50))
    assert run_step(sched) == {"quiet": 4}
    sched.add(seq("quiet2", 4, 0, 3.0, max_tokens=50))
    if burst_priority == 1:
        assert run_step(sched) == {"bulk": 1, "burst": 10, "quiet": 1, "quiet2": 4}
    else:
        assert run_step(sched) == {"quiet": 1, "quiet2": 4}
