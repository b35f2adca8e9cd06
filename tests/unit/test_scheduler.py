"""Chunked prefill, KV admission and preemption (pure bookkeeping: no model, no tensors)."""

from __future__ import annotations

import pytest
from dpserve.engine.common.protocol import SamplingParams
from dpserve.engine.kv_cache import BlockManager
from dpserve.engine.model_runner import group_decodes
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.sequence import Sequence, SequenceStatus


def seq(rid: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, [7] * n, SamplingParams(max_tokens=max_tokens), 0.0, "cpu")


def run_step(sched: Scheduler, sample: bool = True) -> list[tuple[str, int]]:
    """schedule(), then what the engine does after a forward: advance, and sample a token for the caught-up."""
    plan = sched.schedule()
    for s, n in plan:
        s.num_computed_tokens += n
        if sample and s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(9)
    return [(s.request_id, n) for s, n in plan]


def check_blocks(sched: Scheduler) -> None:
    expected = sum(s.num_uncomputed_tokens for s in list(sched.waiting) + sched.running if s.is_prefilling or s in sched.waiting)
    assert sched.num_waiting_prefill_tokens == expected, "the waiting-token total drifted"
    owned = [b for s in sched.running for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block owned twice"
    assert not set(owned) & set(sched.blocks.free), "a block both owned and free"
    assert len(owned) + sched.blocks.num_free_blocks == sched.blocks.num_blocks
    for s in sched.running:
        assert len(s.block_table) * sched.blocks.block_size >= s.num_computed_tokens
    assert all(not s.block_table and s.num_computed_tokens == 0 for s in sched.waiting)


def test_budget_fifo_and_a_long_prompt_in_chunks():
    sched = Scheduler(8, 100, BlockManager(64, 16), long_prefill_token_threshold=30)
    for i, n in enumerate([40, 250, 10]):
        sched.add(seq(f"r{i}", n))
    assert run_step(sched) == [("r0", 40), ("r1", 60)]  # FIFO; the budget cuts r1's prompt
    # r0 decodes now, so r1's chunk is capped by the threshold; r2 fills the rest
    assert run_step(sched) == [("r0", 1), ("r1", 30), ("r2", 10)]
    assert run_step(sched) == [("r0", 1), ("r2", 1), ("r1", 30)]
    check_blocks(sched)
    assert sched.num_waiting_prefill_tokens == 250 - 120


def test_decodes_are_never_starved_by_prefill():
    sched = Scheduler(8, 16, BlockManager(64, 16), long_prefill_token_threshold=16)
    sched.add(seq("d", 3, max_tokens=50))
    run_step(sched)
    sched.add(seq("long", 500))
    for _ in range(10):
        plan = dict(run_step(sched))
        assert plan["d"] == 1 and plan["long"] == 15


def test_kv_admission_waits_for_blocks_and_respects_the_watermark():
    sched = Scheduler(8, 1000, BlockManager(10, 4))  # 40 tokens of KV
    sched.add(seq("a", 30))
    sched.add(seq("b", 12))
    assert run_step(sched) == [("a", 30)]  # b would need 3 more blocks; 2 are free
    assert sched.num_waiting == 1
    check_blocks(sched)


def test_preemption_frees_the_newest_and_requeues_it_first():
    sched = Scheduler(8, 1000, BlockManager(6, 4), long_prefill_token_threshold=1000)  # 24 tokens
    sched.add(seq("old", 8, max_tokens=20))
    sched.add(seq("new", 8, max_tokens=20))
    sched.add(seq("later", 2, max_tokens=20))
    run_step(sched)
    assert [s.request_id for s in sched.running] == ["old", "new", "later"]
    for _ in range(20):
        run_step(sched)
        check_blocks(sched)
        if sched.num_preemptions:
            break
    assert sched.num_preemptions >= 1
    preempted = sched.waiting[0]
    assert preempted.request_id in ("later", "new") and preempted.status is SequenceStatus.WAITING
    assert preempted.num_computed_tokens == 0 and not preempted.block_table
    assert preempted.num_output_tokens > 0  # outputs are kept and recomputed with the prompt
    assert sched.running[0].request_id == "old"


def test_remove_and_finish_return_blocks():
    sched = Scheduler(8, 1000, BlockManager(16, 4))
    a, b, c = seq("a", 10), seq("b", 5), seq("c", 7)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    sched.remove({"b", "nope"})
    sched.finish([a])
    check_blocks(sched)
    assert [s.request_id for s in sched.running] == ["c"]
    assert a.status is b.status is SequenceStatus.FINISHED
    sched.remove({"c"})
    assert sched.blocks.num_free_blocks == 16 and not sched.has_unfinished


@pytest.mark.parametrize(
    "lengths, groups",
    [
        ([5, 9, 30, 31], [(0, 4)]),  # short ones always share
        ([10, 12, 9000], [(0, 2), (2, 3)]),  # one long context does not pad the others to 9,000
        ([], []),
    ],
)
def test_decode_groups_bound_padding(lengths, groups):
    assert group_decodes(lengths) == groups
