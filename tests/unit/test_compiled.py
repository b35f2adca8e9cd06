"""The compiled decode (torch.compile, inductor on CPU) against the eager engine and generate(), on the tiny demo model.

fp32, greedy: every answer of an engine whose decode steps run compiled must be
token-for-token the eager engine's, and generate()'s alone, through continuous
batching, chunked prefill beside decodes, preemption and prefix-cache hits.
One compile serves the whole module (the rank compiles once at start too): every
engine here has the default block size, which the compiled code is specialized on.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from dpserve.engine import compiled as compiled_mod
from dpserve.engine import compiled_artifact, model_runner
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.core import EngineCore

from tests.unit import test_engine
from tests.unit.test_engine import Collector, add, engine_shape, random_prompt, request

reference = test_engine.reference  # generate() alone, the fixture test_engine.py's equality tests use

pytestmark = pytest.mark.timeout(600)


def make(loaded, enforce_eager: bool, **overrides) -> EngineCore:
    config = EngineConfig(model=loaded.model_dir, device="cpu", dtype="float32", enforce_eager=enforce_eager, **overrides)
    return EngineCore.from_loaded(config, loaded)


@pytest.fixture(scope="module")
def compiled_engine_factory(loaded_demo_model, tmp_path_factory):
    """Engines on one loaded model with the compiled decode on (the compile happens once)."""
    from tests.unit.test_paged_attention_kernel import switched_on

    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    with switched_on():  # the C++ attention kernel (opt-in in production): answers equal through it too
        yield lambda **overrides: make(loaded_demo_model, False, **overrides)
    mp.undo()


def run_both(loaded, compiled_factory, reqs, **overrides) -> tuple[Collector, Collector, EngineCore]:
    got = []
    engine = None
    for eager in (True, False):
        engine = make(loaded, True, **overrides) if eager else compiled_factory(**overrides)
        assert (engine.runner.compiled is None) == eager
        add(engine, *reqs)
        got.append(Collector().run(engine))
    return got[0], got[1], engine


def test_compiled_decode_equals_eager_and_generate(loaded_demo_model, compiled_engine_factory, reference):
    lengths, budgets = [1, 5, 23, 12, 40, 7, 3, 18], [6, 20, 9, 16, 10, 24, 13, 7]
    reqs = [request(f"r{i}", random_prompt(i, n), max_tokens=m) for i, (n, m) in enumerate(zip(lengths, budgets))]
    eager, comp, engine = run_both(loaded_demo_model, compiled_engine_factory, reqs)
    assert comp.tokens == eager.tokens and comp.finish == eager.finish
    for r in reqs:
        assert comp.tokens[r.request_id] == reference(r.prompt_token_ids, r.params.max_tokens), r.request_id
    assert engine.describe()["compiled_decode_s"] is not None
    # attention through the C++ kernel (paged_attention_kernel.py) wherever it can be built (a compiler is
    # here, or the decode would not compile; cpp_extension also wants ninja)
    assert engine.runner.compiled.attention_kernel == (shutil.which("ninja") is not None)


def test_compiled_decode_took_the_compiled_path(loaded_demo_model, compiled_engine_factory, monkeypatch):
    """Steps with decodes go through CompiledDecode, a small prefill chunk beside them as rows of its own, and
    so does a short prompt alone; a prompt whose rows would attend over too many cells stays eager."""
    engine = compiled_engine_factory()
    calls = []
    real = compiled_mod.CompiledDecode.__call__
    monkeypatch.setattr(compiled_mod.CompiledDecode, "__call__", lambda self, ids, pos, step, keep=None, on_block=None:
                        calls.append((ids.shape[1], None if keep is None else keep.tolist()))
                        or real(self, ids, pos, step, keep, on_block))
    add(engine, request("a", random_prompt(1, 9), max_tokens=5, ignore_eos=True))
    out = Collector()
    out.feed(engine.step())  # the prompt alone, its 9 tokens as rows (the last one's logits kept)
    out.feed(engine.step())
    add(engine, request("b", random_prompt(2, 7), max_tokens=2, ignore_eos=True))
    out.run(engine)
    # a batch of one padded to two rows (the padding's logits skipped); a's decode beside b's 7 prompt tokens
    # (only the last one's logits kept); then both decode, then a alone
    assert calls == [(9, [8]), (2, [0]), (8, [0, 7]), (2, None), (2, [0])]
    alone = request("b", random_prompt(2, 7), max_tokens=2, ignore_eos=True)
    assert out.tokens["b"] == Collector().run(_alone(engine, alone)).tokens["b"]
    # 181 rows from position 0 attend over 16,471 cells, past COMPILED_MAX_PREFILL_CELLS: eager, the decode compiled
    assert 181 * 182 // 2 > model_runner.COMPILED_MAX_PREFILL_CELLS >= 180 * 181 // 2
    calls.clear()
    got = Collector().run(_alone(engine, request("c", random_prompt(3, 181), max_tokens=2, ignore_eos=True)))
    assert calls == [(2, [0])]  # the prompt eager, then its one decode step
    eager = make(loaded_demo_model, True)
    assert got.tokens["c"] == Collector().run(_alone(eager, request("c", random_prompt(3, 181), max_tokens=2, ignore_eos=True))).tokens["c"]


def _alone(engine, req):
    add(engine, req)
    return engine


def test_a_restart_loads_the_saved_block(compiled_engine_factory, monkeypatch):
    """The first engine compiled the block ahead of time and saved it; a later one (a restarted rank)
    loads it without tracing, and one traced from other source is rebuilt, not served."""
    first = compiled_engine_factory().runner.compiled
    assert first.source in ("compiled and saved", "loaded") and os.path.exists(first.path)
    assert compiled_engine_factory().runner.compiled.source == "loaded"
    monkeypatch.setattr(compiled_artifact, "stale_sources", lambda fn: {"dpserve.engine.attention"})
    rebuilt = compiled_engine_factory().runner.compiled
    assert rebuilt.source == "compiled and saved"


def test_torch_compile_path_without_the_saved_block(compiled_engine_factory, monkeypatch, reference):
    """DPSERVE_COMPILE_AOT=0 (and any failure of the ahead-of-time path) compiles through torch.compile:
    same answers."""
    monkeypatch.setenv(compiled_mod.AOT_SWITCH, "0")
    engine = compiled_engine_factory()
    assert engine.runner.compiled.source == "torch.compile"
    req = request("t", random_prompt(7, 11), max_tokens=9)
    add(engine, req)
    assert Collector().run(engine).tokens["t"] == reference(req.prompt_token_ids, 9)


def test_chunked_prefill_beside_compiled_decodes(loaded_demo_model, compiled_engine_factory, reference):
    overrides = dict(max_num_batched_tokens=64, long_prefill_token_threshold=24)
    reqs = [request(f"s{i}", random_prompt(100 + i, n), max_tokens=30) for i, n in enumerate([12, 9, 20])]
    reqs.append(request("long", random_prompt(200, 150), max_tokens=20))
    eager, comp, _ = run_both(loaded_demo_model, compiled_engine_factory, reqs, **overrides)
    assert comp.tokens == eager.tokens
    for r in reqs:
        assert comp.tokens[r.request_id] == reference(r.prompt_token_ids, r.params.max_tokens), r.request_id


def test_preempted_requests_through_the_compiled_decode(loaded_demo_model, compiled_engine_factory, reference):
    budget = 192 * engine_shape(loaded_demo_model).bytes_per_token  # 12 blocks of 16
    reqs = [request(f"p{i}", random_prompt(300 + i, 20 + 3 * i), max_tokens=40, ignore_eos=True) for i in range(5)]
    eager, comp, engine = run_both(loaded_demo_model, compiled_engine_factory, reqs, kv_cache_memory_bytes=budget)
    assert engine.num_preemptions > 0
    assert comp.tokens == eager.tokens
    for r in reqs:
        assert comp.tokens[r.request_id] == reference(r.prompt_token_ids, 40), r.request_id


def test_prefix_cache_hits_through_the_compiled_decode(loaded_demo_model, compiled_engine_factory, reference):
    shared = random_prompt(400, 48)  # three full blocks
    first = [request("a", shared + random_prompt(401, 5), max_tokens=12)]
    second = [request(f"b{i}", shared + random_prompt(402 + i, 3 + i), max_tokens=12) for i in range(3)]
    results = []
    for eager in (True, False):
        engine = make(loaded_demo_model, True) if eager else compiled_engine_factory()
        got = Collector()
        add(engine, *first)
        got.run(engine)
        add(engine, *second)
        got.run(engine)
        assert engine.num_prefix_hits > 0
        results.append(got.tokens)
    assert results[1] == results[0]
    for r in first + second:
        assert results[1][r.request_id] == reference(r.prompt_token_ids, 12), r.request_id


def test_a_compiled_step_gives_way_after_a_block(loaded_demo_model, compiled_engine_factory, reference):
    """The priority policy's yield check runs after every compiled block too: a dropped compiled step
    leaves the answers generate()'s alone (test_step_yield.py has the eager path and the rank's peek)."""
    engine = compiled_engine_factory(scheduling_policy="priority")
    # No grace (the rule before it): the steps dropped here last microseconds, so with one a fast CPU
    # would drop a thousand before the bulk were owed time (the grace: test_step_yield.py).
    engine.giving_way.grace_s = engine.giving_way.owed = 0.0
    reqs = [request(f"y{i}", random_prompt(500 + i, 6 + 5 * i), max_tokens=12, priority=2) for i in range(3)]
    add(engine, *reqs)
    out = Collector()
    out.feed(engine.step())  # the prompts (eager)
    bars = []
    engine.yield_check = lambda bar: bars.append(bar) or True
    assert engine.step() == [] and bars == [2] and engine.giving_way.num_yielded == 1  # a compiled decode step
    urgent = request("urgent", random_prompt(550, 5), max_tokens=4, priority=0)
    add(engine, urgent)
    out.run(engine)
    assert engine.giving_way.num_yielded > 1  # every plain step after the one run whole gave way again
    for r in [*reqs, urgent]:
        assert out.tokens[r.request_id] == reference(r.prompt_token_ids, r.params.max_tokens), r.request_id


def test_the_default_rule(loaded_demo_model, monkeypatch):
    """Unset: only models of COMPILE_MIN_PARAMS or more compile on a CPU; the flag wins either way;
    hosts without a C++ compiler stay eager (CUDA replays graphs instead: test_cuda_graphs.py)."""
    assert not compiled_mod.use_compiled_decode(None, loaded_demo_model)  # the tiny model: ~1 M parameters
    assert not compiled_mod.use_compiled_decode(True, loaded_demo_model)
    assert compiled_mod.use_compiled_decode(False, loaded_demo_model)
    monkeypatch.setattr(compiled_mod, "COMPILE_MIN_PARAMS", 1000)
    assert compiled_mod.use_compiled_decode(None, loaded_demo_model)
    monkeypatch.setattr(compiled_mod.shutil, "which", lambda name: None)
    assert not compiled_mod.use_compiled_decode(False, loaded_demo_model)
    assert not compiled_mod._can_compile(torch.device("meta"))


def test_compile_cache_dir_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiled_mod.compile_cache_dir() == str(tmp_path / "dpserve" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere")
    assert compiled_mod.compile_cache_dir() == "/somewhere"


def test_the_saved_block_is_per_thread_count_and_dtype(loaded_demo_model, tmp_path):
    """The guards check the intra-op thread count (global state): ranks with another share of the
    cores, or another dtype, keep artifacts of their own instead of refusing and replacing each other's."""
    model = loaded_demo_model.model
    block = compiled_mod.hf_compat.decoder_layers(model)[0]
    before = torch.get_num_threads()
    paths = set()
    try:
        for threads, dtype in ((1, torch.float32), (2, torch.float32), (1, torch.bfloat16)):
            torch.set_num_threads(threads)
            paths.add(compiled_artifact.artifact_path(str(tmp_path), model, block, dtype, 16, False, "recorded"))
    finally:
        torch.set_num_threads(before)
    assert len(paths) == 3
