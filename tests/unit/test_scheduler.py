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


# ---------------------------------------------------------------- one prompt computation


def cached_scheduler(budget: int = 1000, num_blocks: int = 256) -> Scheduler:
    return Scheduler(32, budget, BlockManager(num_blocks, 4, enable_caching=True), long_prefill_token_threshold=budget)


def step_and_cache(sched: Scheduler) -> list[tuple[str, int]]:
    """A step as EngineCore runs it: advance, register full blocks, sample the caught-up, finish."""
    plan = sched.schedule()
    for s, n in plan:
        s.num_computed_tokens += n
    sched.cache_computed_blocks(plan)
    done = []
    for s, _ in plan:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(9)
            if s.num_output_tokens >= s.params.max_tokens:
                done.append(s)
    sched.finish(done)
    return [(s.request_id, n) for s, n in plan]


def prompt_tokens_computed(plan: list[tuple[str, int]], before: dict[str, int], seqs: dict[str, Sequence]) -> int:
    return sum(min(n, max(0, seqs[r].num_prompt_tokens - before[r])) for r, n in plan)


def check_shared(sched: Scheduler) -> None:
    """With shared blocks: every reference count equals the tables holding the block."""
    bm = sched.blocks
    holders = [0] * bm.num_blocks
    for s in sched.running:
        for b in s.block_table:
            holders[b] += 1
    assert holders == bm.ref_count
    assert all(not s.block_table and s.num_computed_tokens == 0 for s in sched.waiting)


def run_counting(sched: Scheduler, seqs: dict[str, Sequence], limit: int = 500) -> int:
    computed = 0
    for _ in range(limit):
        if not sched.has_unfinished:
            return computed
        before = {r: s.num_computed_tokens for r, s in seqs.items()}
        computed += prompt_tokens_computed(step_and_cache(sched), before, seqs)
        check_shared(sched)
    raise AssertionError("the scheduler did not finish")


def test_n_copies_of_a_prompt_compute_it_once_in_chunks():
    sched = cached_scheduler(budget=64)
    prompt = list(range(100, 301))  # 201 tokens: 50 full blocks and one token
    seqs = {f"c{j}": Sequence(f"c{j}", prompt, SamplingParams(max_tokens=3), 0.0, "cpu") for j in range(8)}
    for s in seqs.values():
        sched.add(s)
    assert step_and_cache(sched) == [("c0", 64)]  # the copies wait for the blocks c0 is computing
    computed = 64 + run_counting(sched, seqs)
    # c0 computes the prompt; each copy only its last (partial) block: one token
    assert computed == 201 + 7 * 1
    assert all(s.status is SequenceStatus.FINISHED for s in seqs.values())


def test_a_held_sequence_lets_others_pass_then_attaches_what_its_holder_computed():
    sched = cached_scheduler(budget=32)
    shared = list(range(500, 540))  # 10 full blocks
    for rid, tail in (("a", [1]), ("b", [2])):
        sched.add(Sequence(rid, shared + tail, SamplingParams(max_tokens=2), 0.0, "cpu"))
    sched.add(Sequence("other", [3] * 5, SamplingParams(max_tokens=2), 0.0, "cpu"))
    assert step_and_cache(sched) == [("a", 32)]
    assert step_and_cache(sched) == [("a", 9), ("other", 5)]  # b is held in place; other passes it
    assert step_and_cache(sched)[-1] == ("b", 1)  # b attaches the 10 blocks a cached
    check_shared(sched)


def test_a_held_sequence_is_released_when_its_holder_is_aborted():
    sched = cached_scheduler(budget=16)
    shared = list(range(500, 540))
    for rid, tail in (("a", [1]), ("b", [2])):
        sched.add(Sequence(rid, shared + tail, SamplingParams(max_tokens=2), 0.0, "cpu"))
    assert step_and_cache(sched) == [("a", 16)]
    assert step_and_cache(sched) == [("a", 16)]
    sched.remove({"a"})
    assert step_and_cache(sched) == [("b", 9)]  # the 8 blocks a cached, then the rest itself
    assert sched.running[0].num_cached_tokens == 32
    check_shared(sched)


def test_without_caching_or_with_prompt_logprobs_nothing_is_held():
    sched = Scheduler(32, 1000, BlockManager(256, 4))
    for j in range(3):
        sched.add(seq(f"p{j}", 40))
    assert [r for r, _ in step_and_cache(sched)] == ["p0", "p1", "p2"]
    sched = cached_scheduler()
    sched.add(Sequence("x", list(range(40)), SamplingParams(max_tokens=2), 0.0, "cpu"))
    sched.add(Sequence("y", list(range(40)), SamplingParams(max_tokens=2, prompt_logprobs=1), 0.0, "cpu"))
    assert [r for r, _ in step_and_cache(sched)] == ["x", "y"]  # y needs every position's logits anyway


@pytest.mark.timeout(300)
def test_engine_n16_of_a_1000_token_prompt_prefills_it_once_with_greedy_answers_unchanged(loaded_demo_model):
    """Sixteen copies of one prompt on the demo model cost at most 1.3x the prefill of
    one, and each still answers what transformers' generate() does (float32, greedy)."""
    import random

    import torch
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.common.protocol import AddRequest
    from dpserve.engine.core import EngineCore
    from dpserve.engine.testing import demo_model

    rng = random.Random(24)
    prompt = [rng.randrange(len(demo_model.SPECIAL_TOKENS), demo_model.VOCAB_SIZE) for _ in range(1000)]

    def prefill_tokens(n: int) -> tuple[int, dict[str, list[int]]]:
        config = EngineConfig(model=loaded_demo_model.model_dir, device="cpu", dtype="float32")
        engine = EngineCore.from_loaded(config, loaded_demo_model)
        plan_of = engine.scheduler.schedule
        computed = 0

        def counting_schedule():
            nonlocal computed
            plan = plan_of()
            computed += sum(min(k, max(0, s.num_prompt_tokens - s.num_computed_tokens)) for s, k in plan)
            return plan

        engine.scheduler.schedule = counting_schedule
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for j in range(n):
            assert engine.add_request(AddRequest(f"c{j}", list(prompt), params, arrival_time=0.0)) is None
        tokens: dict[str, list[int]] = {}
        for _ in range(2000):
            if not engine.has_unfinished():
                return computed, tokens
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        raise AssertionError("the engine did not finish")

    one, _ = prefill_tokens(1)
    many, answers = prefill_tokens(16)
    assert one == 1000
    print("prefill tokens: n=1", one, "n=16", many)
    assert many <= 1.3 * one, f"16 copies computed {many} prompt tokens, one computed {one}"
    ids = torch.tensor([prompt])
    model = loaded_demo_model.model
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                              min_new_tokens=3, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(answers) == 16 and all(got == expected for got in answers.values()), (expected, answers)
