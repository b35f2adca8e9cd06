"""A step in progress gives way to a more urgent request (priority policy, issue 28).

The native engine calls `yield_check` after every layer with the step's least urgent
priority; the rank's check peeks at its API servers' sockets and says True when a
newly arrived request is more urgent than some of the step. The step is then dropped
whole: no token counted, no block cached, the keys and values it wrote written again
when it is redone. fp32, greedy: the answers of a run with a step given way equal
generate()'s alone. Real sockets for the rank's peek.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import zmq
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.common.logs import setup_logging
from dpserve.engine.common.protocol import AbortRequests, AddRequest, EngineInput, SamplingParams
from dpserve.engine.core import EngineCore
from dpserve.engine.rank.io import RankIO
from dpserve.engine.rank.process import EngineProcess
from dpserve.engine.step_yield import GivingWay, StepYielded

from tests.unit import test_engine
from tests.unit.test_engine import Collector, add, assert_all_blocks_free, random_prompt, request

reference = test_engine.reference  # generate() alone (a fixture)


def make(loaded, policy: str = "priority", **overrides) -> EngineCore:
    config = EngineConfig(model=loaded.model_dir, device="cpu", dtype="float32", enforce_eager=True,
                          scheduling_policy=policy, **overrides)
    return EngineCore.from_loaded(config, loaded)


class Check:
    """A yield_check that says True while `arrived` holds a request more urgent than the step."""

    def __init__(self) -> None:
        self.bars: list[int] = []  # the least urgent priority of each step that looked
        self.arrived: list[int] = []  # priorities of requests that came in during the step

    def __call__(self, bar: int) -> bool:
        self.bars.append(bar)
        return any(p < bar for p in self.arrived)


def finish_as_alone(engine: EngineCore, check: Check, out: Collector, reqs: list[AddRequest], reference) -> None:
    """Nothing more arrives: run to the end; every answer is generate()'s alone, every block free."""
    check.arrived.clear()
    out.run(engine)
    for r in reqs:
        assert out.tokens[r.request_id] == reference(r.prompt_token_ids, r.params.max_tokens), r.request_id
    assert_all_blocks_free(engine)


def bulk(n: int) -> list[AddRequest]:
    return [request(f"bulk{i}", random_prompt(600 + i, 9 + 4 * i), max_tokens=14, priority=3) for i in range(n)]


@pytest.mark.parametrize("grace_s", [0.0, 60.0])
def test_a_step_gives_way_to_a_more_urgent_request_and_leaves_no_trace(loaded_demo_model, reference, grace_s):
    """With no grace, the plain step after the urgent one runs whole whatever arrives; while the bulk is
    owed nothing (a grace far over this test's steps), it gives way again."""
    engine = make(loaded_demo_model)
    engine.giving_way = GivingWay(engine.kv.shape.num_layers, grace_s=grace_s)
    check = Check()
    engine.yield_check = check
    reqs = bulk(3)
    add(engine, *reqs)
    out = Collector()
    for _ in range(3):  # prompts, then decodes: nothing more urgent came, nothing gives way
        out.feed(engine.step())
    assert engine.giving_way.num_yielded == 0 and set(check.bars) == {3}
    before = {r.request_id: len(out.tokens.get(r.request_id, [])) for r in reqs}
    computed = {s.request_id: s.num_computed_tokens for s in engine.scheduler.running}

    check.arrived.append(0)  # an urgent request reaches the rank while the next step runs
    calls = len(check.bars)
    assert engine.step() == []  # it gave way after its first layer
    assert engine.giving_way.num_yielded == 1 and len(check.bars) == calls + 1
    assert {s.request_id: s.num_computed_tokens for s in engine.scheduler.running} == computed
    urgent = request("urgent", random_prompt(700, 11), max_tokens=6, priority=0)
    add(engine, urgent)

    calls = len(check.bars)
    got = engine.step()  # the urgent step: the urgent request alone, never given way
    assert [o.request_id for o in got] == ["urgent"] and len(check.bars) == calls
    out.feed(got)
    if grace_s:
        assert engine.step() == [] and engine.giving_way.num_yielded == 2  # gave way again
        check.arrived.clear()
    got = engine.step()  # the plain step after it runs whole (no grace: whatever arrives)
    assert {o.request_id for o in got} == {"urgent", *before} and engine.giving_way.num_yielded == 1 + (grace_s > 0)
    out.feed(got)
    finish_as_alone(engine, check, out, [*reqs, urgent], reference)


class Step:
    """A stand-in for the scheduler's view that GivingWay reads, and one (sequence, tokens) pair of priority 3."""

    was_isolated = False
    isolate_urgent = True
    scheduled = [(SimpleNamespace(params=SimpleNamespace(priority=3)), 1)]


def looks(way: GivingWay, layers: int = 1) -> bool:
    """Whether a plain step, with a more urgent request come, gives way within its first `layers`."""
    on_layer = way.hook(Step.scheduled, None, lambda bar: bar == 3, Step)
    if on_layer is None:
        return False
    try:
        for _ in range(layers):
            on_layer()
    except StepYielded:
        return True
    return False


def test_the_bulk_s_time_decides_whether_the_step_after_one_that_gave_way_gives_way_too():
    """Seconds as a virtual clock: urgent work (urgent steps, dropped part-steps) may run grace_s ahead
    of the whole plain steps; past that, each step that gave way is followed by a whole plain one."""
    way = GivingWay(num_layers=4, grace_s=0.5)
    assert looks(way)
    way.gave_way(0.1)
    way.ran(True, 0.2)  # the urgent step: 0.3 s of urgent work, 0.2 s of grace left
    assert looks(way)
    way.gave_way(0.1)
    way.ran(True, 0.2)  # 0.6 s: over the grace
    assert not looks(way)
    way.ran(False, 0.25)  # the whole plain step pays back 0.25: 0.15 s ahead again
    assert looks(way) and way.owed == pytest.approx(-0.15)
    way.gave_way(0.05)
    way.ran(True, 0.05)
    assert looks(way)
    for _ in range(20):
        way.ran(True, 0.2)  # a long urgent run is remembered up to the grace, not more
    way.gave_way(0.01)
    assert not looks(way)
    way.ran(False, 0.6)  # 0.5 owed at most: one plain step of 0.6 s pays it back
    way.gave_way(0.05)
    assert looks(way) and way.owed == pytest.approx(-0.05)
    assert way.num_yielded == 5


def test_no_grace_is_the_rule_before_and_a_step_past_its_checked_layers_runs_to_its_end():
    old = GivingWay(num_layers=4, grace_s=0.0)
    assert looks(old)
    old.gave_way(0.01)
    old.ran(True, 0.01)
    assert not looks(old)  # after a step that gave way, a whole plain one
    old.ran(False, 10.0)
    assert looks(old)
    for came_after, gives_way in [(5, True), (6, False)]:  # it looks after its first 6 layers of 8 only
        late = GivingWay(num_layers=8, until=0.75)
        came: list[int] = []
        on_layer = late.hook(Step.scheduled, None, lambda bar, came=came: bool(came), Step)
        try:
            for layer in range(1, 9):
                on_layer()
                if layer == came_after:
                    came.append(0)
        except StepYielded:
            assert gives_way and layer == 6
        else:
            assert not gives_way


def test_only_the_priority_policy_s_plain_steps_look(loaded_demo_model):
    """fcfs never looks; under priority, a step with no work less urgent than the newcomer is not dropped for it."""
    fcfs = make(loaded_demo_model, "fcfs")
    check = Check()
    check.arrived.append(-5)
    fcfs.yield_check = check
    add(fcfs, *bulk(2))
    Collector().run(fcfs)
    assert check.bars == [] and fcfs.giving_way.num_yielded == 0

    engine = make(loaded_demo_model)
    check = Check()
    check.arrived.append(1)
    engine.yield_check = check
    add(engine, request("first", random_prompt(800, 7), max_tokens=20, priority=1, ignore_eos=True),
        request("more", random_prompt(801, 9), max_tokens=6, priority=0))  # none of the step less urgent than it
    Collector().run(engine)
    assert engine.giving_way.num_yielded == 0 and set(check.bars) == {1}


def test_a_step_gives_way_when_it_holds_less_urgent_work_beside_work_as_urgent(loaded_demo_model, reference):
    """A quiet request decoding beside a flood's does not shield the flood's step from a second
    quiet request: the step gives way, and the urgent step after runs both quiet ones, not the flood."""
    engine = make(loaded_demo_model)
    check = Check()
    engine.yield_check = check
    quiet = request("quiet", random_prompt(900, 8), max_tokens=12, priority=0, ignore_eos=True)
    reqs = [*bulk(2), quiet]
    add(engine, *reqs)
    out = Collector()
    for _ in range(3):
        out.feed(engine.step())
    assert engine.giving_way.num_yielded == 0 and set(check.bars) == {3}  # the flood's bulk at 3, quiet at 0
    check.arrived.append(0)
    assert engine.step() == [] and engine.giving_way.num_yielded == 1
    second = request("second", random_prompt(901, 10), max_tokens=5, priority=0)
    add(engine, second)
    got = engine.step()  # the urgent step: the two quiet requests, the flood left out
    assert {o.request_id for o in got} == {"quiet", "second"}
    out.feed(got)
    finish_as_alone(engine, check, out, [*reqs, second], reference)


def test_the_rank_reads_on_inside_a_step_and_finds_the_more_urgent_request(tmp_path):
    """The rank's check (EngineProcess._more_urgent_arrived) on real sockets: it reads every waiting
    message into `_early`, in order, for the loop to deliver after the step, says True only for a new
    request more urgent than the bar it is given (the step's least urgent priority; not for a guided
    one, whose grammar compiles first), and looks at most every PEEK_EVERY_S."""
    ctx = zmq.Context()
    api_address = f"ipc://{tmp_path}/api-engines"
    api = ctx.socket(zmq.ROUTER)
    api.setsockopt(zmq.LINGER, 0)
    api.bind(api_address)
    proc = EngineProcess.__new__(EngineProcess)
    proc.poller = zmq.Poller()
    proc.io = RankIO(ctx, None, rank=0, incarnation="inc0", fingerprint="fp", node_rank=0,
                     coordinator_address=f"ipc://{tmp_path}/coord", log=setup_logging("test-yield"),
                     watch=lambda sock: proc.poller.register(sock, zmq.POLLIN), watch_monitors=False, monitors=False)
    proc._early, proc._last_peek, proc._said_yield, proc.log = [], 0.0, False, setup_logging("test-yield")
    into = Codec(EngineInput)
    try:
        proc.io.connect_api_servers([api_address])
        assert api.poll(5000)
        rank_id = api.recv_multipart()[0]  # the rank's hello

        def send(*msgs) -> None:
            for msg in msgs:
                api.send_multipart([rank_id, into.encode(msg)])
            deadline = time.monotonic() + 5
            while not proc.io.api[0].poll(0) and time.monotonic() < deadline:
                time.sleep(0.005)
            proc._last_peek = 0.0

        def add_request(rid: str, priority: int, **params) -> AddRequest:
            return AddRequest(rid, [1, 2], SamplingParams(max_tokens=4, priority=priority, **params), 0.0)

        assert proc._more_urgent_arrived(3) is False  # nothing came
        send(add_request("same", 3), AbortRequests(["x"]), add_request("guided", 0, guided_grammar='{"x": 1}'))
        assert proc._more_urgent_arrived(3) is False
        assert [msg for _, msg in proc._early] == [add_request("same", 3), AbortRequests(["x"]),
                                                   add_request("guided", 0, guided_grammar='{"x": 1}')]
        send(add_request("urgent", 0))
        assert proc._more_urgent_arrived(3) is True and proc._early[-1] == (0, add_request("urgent", 0))
        send(add_request("later", 0))
        proc._last_peek = time.monotonic()  # looked just now: not again for PEEK_EVERY_S
        assert proc._more_urgent_arrived(3) is False and len(proc._early) == 4
    finally:
        ctx.destroy(linger=0)
