"""Prefix caching in the block manager and the scheduler (pure bookkeeping: no model, no tensors).

The engine-level proof that cached blocks give the same answers is in
tests/integration/test_prefix_cache.py; here: which blocks are shared,
when, and that the reference counts and the evictable pool stay exact.
"""

from __future__ import annotations

from collections import Counter

from dpserve.engine.common.protocol import SamplingParams
from dpserve.engine.kv_cache import BlockManager
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.sequence import Sequence, SequenceStatus

BS = 4


def seq(rid: str, tokens: list[int], max_tokens: int = 2, **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params), 0.0, "cpu")


def scheduler(num_blocks: int, budget: int = 1000, **kw) -> Scheduler:
    return Scheduler(8, budget, BlockManager(num_blocks, BS, enable_caching=True), long_prefill_token_threshold=budget, **kw)


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """What EngineCore.step does around a forward: advance, register full blocks, sample, finish."""
    plan = sched.schedule()
    for s, n in plan:
        s.num_computed_tokens += n
    sched.cache_computed_blocks(plan)
    done = []
    for s, _ in plan:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(1000 + s.num_output_tokens)
            if s.num_output_tokens >= s.params.max_tokens:
                done.append(s)
    sched.finish(done)
    check(sched)
    return [(s.request_id, n) for s, n in plan]


def run_all(sched: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not sched.has_unfinished:
            return
        run_step(sched)
    raise AssertionError("the scheduler did not finish")


def check(sched: Scheduler) -> None:
    """The BlockManager invariants, against the running sequences' tables."""
    bm = sched.blocks
    holders = Counter(b for s in sched.running for b in s.block_table)
    for s in sched.running:
        assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
    assert not set(bm.free) & set(bm.cached), "a block both free and cached"
    assert len(bm.free) + len(bm.cached) + len(holders) == bm.num_blocks
    for b in range(bm.num_blocks):
        assert bm.ref_count[b] == holders[b], f"block {b}: ref count {bm.ref_count[b]}, held by {holders[b]}"
        assert (bm.ref_count[b] == 0) == (b in bm.free or b in bm.cached)
        assert (b in bm.cached) <= (bm.block_hash[b] is not None), "an evictable block without a key"
        assert (b in bm.free) <= (bm.block_hash[b] is None), "a free block with a key"
    assert {bm.block_hash[b]: b for b in bm.hash_to_block.values()} == bm.hash_to_block
    for s in sched.running:
        # every registered block of a table holds exactly those tokens
        for i in range(s.num_registered_blocks):
            b = s.block_table[i]
            if bm.block_hash[b] is not None:
                assert bm.block_tokens[b] == tuple(s.token_ids[i * BS : (i + 1) * BS])
    assert all(not s.block_table and s.num_computed_tokens == 0 for s in sched.waiting)


def test_a_repeated_prompt_attaches_its_cached_blocks_and_computes_only_the_last():
    sched = scheduler(64)
    prompt = list(range(40))  # 10 full blocks
    a = seq("a", prompt)
    sched.add(a)
    assert run_step(sched) == [("a", 40)]
    a_blocks = list(a.block_table)
    run_all(sched)
    b = seq("b", prompt)
    sched.add(b)
    # the block of the last prompt token runs again (it must give logits): 9 blocks attached
    assert run_step(sched) == [("b", 4)]
    assert b.block_table[:9] == a_blocks[:9] and b.block_table[9] != a_blocks[9]
    assert b.num_cached_tokens == 36
    assert (sched.num_prefix_queries, sched.num_prefix_hits) == (80, 36)
    run_all(sched)


def test_partial_blocks_are_never_shared():
    sched = scheduler(64)
    a = seq("a", list(range(10)), max_tokens=4)  # blocks 0, 1 full; 8, 9 in a partial third
    sched.add(a)
    run_step(sched)
    assert a.num_registered_blocks == 2
    shared = list(a.block_table)
    b = seq("b", list(range(10)) + [77, 78, 79, 80, 81])
    sched.add(b)
    assert run_step(sched) == [("a", 1), ("b", 7)]  # a decodes into its partial block meanwhile
    assert b.block_table[:2] == shared[:2] and shared[2] not in b.block_table
    assert [sched.blocks.ref_count[x] for x in shared] == [2, 2, 1]


def test_prompts_that_differ_in_one_token_share_nothing_from_that_block_on():
    sched = scheduler(64)
    prompt = list(range(100, 132))  # 8 full blocks
    other = list(prompt)
    other[13] = 7  # block 3
    a, b = seq("a", prompt, max_tokens=1), seq("b", other, max_tokens=1)
    sched.add(a)
    run_step(sched)
    assert not sched.running  # a finished; its blocks are evictable, with their keys
    sched.add(b)
    assert run_step(sched) == [("b", 32 - 12)]  # blocks 0-2 reused, the rest computed
    sched.add(seq("a2", prompt + [5], max_tokens=4))
    plan = run_step(sched)
    assert plan == [("a2", 1)]  # a's 8 blocks survived: b's blocks 3.. are separate ones
    a2 = sched.running[0]
    b_blocks = set()
    for b_key, blk in sched.blocks.hash_to_block.items():
        if b_key in b.block_hashes[3:]:
            b_blocks.add(blk)
    assert len(b_blocks) == 5, "b's own blocks 3..7 are registered under their own keys"
    assert not b_blocks & set(a2.block_table), "a block after the differing token was shared"
    assert b.block_hashes[:3] == a2.block_hashes[:3] and not set(b.block_hashes[3:]) & set(a2.block_hashes)


def test_shared_blocks_are_reference_counted():
    sched = scheduler(64)
    prefix = list(range(16))
    sched.add(seq("a", prefix + [1], max_tokens=1))
    run_step(sched)
    b, c = seq("b", prefix + [2, 3], max_tokens=8), seq("c", prefix + [4, 5], max_tokens=8)
    sched.add(b)
    sched.add(c)
    assert run_step(sched) == [("b", 2), ("c", 2)]
    shared = b.block_table[:4]
    assert c.block_table[:4] == shared and all(sched.blocks.ref_count[x] == 2 for x in shared)
    assert sched.kv_usage == 6 / 64  # 4 shared + one own block each; the evictable ones are not "in use"
    sched.remove({"b"})
    assert all(sched.blocks.ref_count[x] == 1 for x in shared) and not set(shared) & set(sched.blocks.cached)
    check(sched)
    sched.remove({"c"})
    assert set(shared) <= set(sched.blocks.cached)
    assert sched.kv_usage == 0.0 and sched.blocks.num_free_blocks == 64


def test_eviction_takes_free_blocks_first_then_the_least_recently_used():
    sched = scheduler(12)
    old, new = list(range(200, 216)), list(range(300, 316))  # 4 blocks each (16 tokens)
    for rid, prompt in (("old", old), ("new", new)):
        sched.add(seq(rid, prompt + [1], max_tokens=1))
        run_all(sched)
    bm = sched.blocks
    assert bm.num_cached_blocks == 8 and len(bm.free) == 4
    # 6 blocks: the 4 free ones, then the two least recently used (old's tail first)
    sched.add(seq("big", list(range(500, 523)), max_tokens=1))
    run_all(sched)
    assert bm.num_evictions == 2
    sched.add(seq("new-again", new + [2], max_tokens=1))
    assert run_step(sched) == [("new-again", 1)]  # all of new's blocks survived
    sched.add(seq("old-again", old + [2], max_tokens=1))
    assert run_step(sched) == [("old-again", 9)]  # old lost its blocks 2 and 3


def test_admission_counts_evictable_blocks_as_available():
    sched = scheduler(8)
    sched.add(seq("a", list(range(24)) + [1], max_tokens=1))  # 6 full blocks + 1
    run_all(sched)
    assert sched.blocks.num_cached_blocks == 6 and len(sched.blocks.free) == 2
    sched.add(seq("b", list(range(900, 928)), max_tokens=1))  # 7 blocks, none cached
    assert run_step(sched) == [("b", 28)]


def test_attaching_evictable_blocks_is_counted_against_the_free_ones():
    sched = scheduler(6)
    prefix = list(range(16))
    sched.add(seq("a", prefix + [1], max_tokens=1))
    run_all(sched)  # 4 cached blocks, 2 free
    # b attaches the 4 (no longer evictable) and needs 3 more: only 2 are left
    b = seq("b", prefix + list(range(50, 62)), max_tokens=1)
    sched.add(b)
    assert run_step(sched) == []
    assert b.num_computed_tokens == 0 and not b.block_table and sched.num_waiting == 1


def test_preemption_with_shared_blocks_keeps_counts_exact_and_finishes():
    sched = scheduler(14, budget=64)
    prefix = list(range(16))
    sched.add(seq("warm", prefix + [0], max_tokens=1))
    run_all(sched)
    seqs = [seq(f"s{i}", prefix + [i, i, i], max_tokens=12) for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(100):
        if not sched.has_unfinished:
            break
        run_step(sched)
    assert sched.num_preemptions >= 1, "the test needs memory pressure"
    assert not sched.has_unfinished and all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == 12 for s in seqs)
    assert not any(sched.blocks.ref_count) and sched.blocks.num_free_blocks == 14
    # the first admission's hits are what gets reported, whatever a re-admission found
    assert all(s.num_cached_tokens == 16 for s in seqs)


def test_prompt_logprobs_requests_compute_everything_but_register_their_blocks():
    sched = scheduler(64)
    prompt = list(range(20))
    sched.add(seq("a", prompt))
    run_all(sched)
    p = seq("p", prompt, prompt_logprobs=1)
    sched.add(p)
    assert run_step(sched) == [("p", 20)] and p.num_cached_tokens == 0
    sched.remove({"p"})
    sched.add(seq("x", list(range(500, 520)), prompt_logprobs=0, max_tokens=1))
    run_all(sched)
    sched.add(seq("y", list(range(500, 520)) + [3]))
    assert run_step(sched) == [("y", 1)]  # x's blocks were registered


def test_caching_off_shares_nothing():
    sched = Scheduler(8, 1000, BlockManager(64, BS))
    prompt = list(range(40))
    for rid in ("a", "b"):
        s = seq(rid, prompt)
        sched.add(s)
        assert run_step(sched) == [(rid, 40)]
        run_all(sched)
        assert s.num_cached_tokens == 0
    assert sched.blocks.num_cached_blocks == 0 and not sched.blocks.cached
    assert (sched.num_prefix_queries, sched.num_prefix_hits) == (0, 0)
