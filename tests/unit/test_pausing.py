"""Paused requests (a client that stopped reading): the native engine and the simulated
one step nothing for them, keep their place, and finish with the same answer once resumed."""

from __future__ import annotations

import pytest
from dpserve.engine.common.protocol import AddRequest, SamplingParams
from dpserve.engine.testing.sim import SimConfig, SimCore

from tests.unit.test_engine import (
    Collector,
    add,
    assert_all_blocks_free,
    bytes_per_token,
    engine_shape,
    make_engine,
    random_prompt,
    request,
)

pytestmark = pytest.mark.timeout(120)


def test_a_paused_request_gets_no_tokens_keeps_its_blocks_and_resumes_to_the_same_answer(loaded_demo_model):
    engine = make_engine(loaded_demo_model)
    prompts = {rid: random_prompt(40 + i, 9) for i, rid in enumerate("ab")}
    add(engine, *(request(rid, p, max_tokens=12, ignore_eos=True) for rid, p in prompts.items()))
    got = Collector()
    for _ in range(3):
        got.feed(engine.step())
    engine.pause_requests(["a", "unknown"])
    blocks_used = engine.blocks.num_blocks - engine.blocks.num_free_blocks
    before = len(got.tokens["a"])
    while engine.has_unfinished():  # only b is stepped; then nothing is left to do
        got.feed(engine.step())
    assert len(got.tokens["a"]) == before and "a" not in got.finish and got.finish["b"][0] == "length"
    assert engine.num_running == 1 and engine.blocks.num_blocks - engine.blocks.num_free_blocks <= blocks_used
    engine.resume_requests(["a"])
    while engine.has_unfinished():
        got.feed(engine.step())
    alone = make_engine(loaded_demo_model)
    add(alone, request("a", prompts["a"], max_tokens=12, ignore_eos=True))
    ref = Collector()
    while alone.has_unfinished():
        ref.feed(alone.step())
    assert got.tokens["a"] == ref.tokens["a"] and got.finish["a"][0] == "length"
    assert_all_blocks_free(engine)


def test_a_paused_request_preempted_for_blocks_is_parked_and_an_abort_frees_it(loaded_demo_model):
    block = 8
    engine = make_engine(loaded_demo_model, block_size=block,
                         kv_cache_memory_bytes=12 * block * bytes_per_token(engine_shape(loaded_demo_model)))
    add(engine, request("old", random_prompt(7, 20), max_tokens=60, ignore_eos=True))
    got = Collector()
    got.feed(engine.step())
    add(engine, request("new", random_prompt(8, 20), max_tokens=60, ignore_eos=True))
    got.feed(engine.step())
    engine.pause_requests(["new"])  # the newest: the one preemption takes first
    while engine.has_unfinished():
        got.feed(engine.step())
    assert got.finish["old"][0] == "length" and "new" not in got.finish
    assert engine.num_preemptions > 0 and "new" in engine.paused.parked and not engine.has_unfinished()
    engine.abort_requests(["new"])
    assert not engine.paused.parked and not engine.scheduler.paused
    assert_all_blocks_free(engine)


def test_the_simulated_engine_pauses_too():
    core = SimCore(SimConfig(ranks=[0], coordinator_address="", fingerprint="", prefill_tokens_per_s=1e9))
    for rid in "ab":
        core.add_request(AddRequest(rid, [5, 6], SamplingParams(max_tokens=5), 0.0))
    core.step()
    core.pause_requests(["a"])
    outs = [o.request_id for _ in range(10) if core.has_unfinished() for o in core.step()]
    assert set(outs) == {"b"} and not core.has_unfinished() and "a" in core.by_id
    core.resume_requests(["a"])
    outs = [o for _ in range(10) if core.has_unfinished() for o in core.step()]
    assert [o.request_id for o in outs] == ["a"] * 4 and outs[-1].finish_reason == "length"
