"""EngineCore against transformers' own generate() on the tiny demo model (CPU, float32)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import threading
from functools import cache

import pytest
import torch
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.common.protocol import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AddRequest,
    SamplingParams,
)
from dpserve.engine.core import EngineCore
from dpserve.engine.loader import (
    load_model,
    read_eos_token_ids,
    resolve_device,
    resolve_dtype,
)
from dpserve.engine.testing import demo_model

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- helpers


def make_engine(loaded, **overrides) -> EngineCore:
    config = EngineConfig(model=loaded.model_dir, device="cpu", dtype="float32", **overrides)
    return EngineCore.from_loaded(config, loaded)


def request(rid: str, prompt: list[int], **params) -> AddRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 16)
    return AddRequest(rid, list(prompt), SamplingParams(**params), arrival_time=0.0)


def add(engine: EngineCore, *reqs: AddRequest) -> None:
    for r in reqs:
        assert engine.add_request(r) is None, r.request_id


def assert_all_blocks_free(engine: EngineCore) -> None:
    """No sequence holds a block; free and evictable cached blocks together are all of them."""
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert sorted(engine.blocks.free + list(engine.blocks.cached)) == list(range(engine.blocks.num_blocks))
    assert not any(engine.blocks.ref_count)


def engine_shape(loaded):
    from dpserve.engine.loader import kv_shape

    return kv_shape(loaded)


def bytes_per_token(shape) -> int:
    return shape.bytes_per_token


class Collector:
    """Accumulates step() outputs per request and checks the output contract."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[str, int | None]] = {}

    def feed(self, outputs) -> None:
        seen = set()
        for out in outputs:
            assert out.request_id not in self.finish, f"output after finish for {out.request_id}"
            assert out.request_id not in seen, "two outputs for one request in one step"
            assert len(out.new_token_ids) == 1
            seen.add(out.request_id)
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish[out.request_id] = (out.finish_reason, out.stop_token_id)

    def run(self, engine: EngineCore, max_steps: int = 500) -> Collector:
        for _ in range(max_steps):
            if not engine.has_unfinished():
                return self
            self.feed(engine.step())
        raise AssertionError("engine did not finish")


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(demo_model.SPECIAL_TOKENS), demo_model.VOCAB_SIZE) for _ in range(length)]


@pytest.fixture(scope="module")
def reference(loaded_demo_model):
    """Greedy generate() on one prompt alone: the tokens after the prompt (EOS included)."""
    model = loaded_demo_model.model
    eos = sorted(loaded_demo_model.eos_token_ids)

    @cache
    def generate(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        return out[0, len(prompt):].tolist()

    return lambda prompt, max_tokens: generate(tuple(prompt), max_tokens)


@pytest.fixture(scope="module")
def text_prompt(demo_model_dir) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(demo_model_dir, "tokenizer.json")).encode(
        "The engine answers every question with a stream of tokens.").ids


# ---------------------------------------------------------------- greedy == generate


def test_continuous_batching_matches_generate_token_for_token(loaded_demo_model, reference, text_prompt):
    engine = make_engine(loaded_demo_model)
    lengths, budgets = [1, 5, 23, 12, 40, 7, 3, 18], [6, 20, 9, 16, 10, 24, 13, 7]
    prompts = [random_prompt(i, n) for i, n in enumerate(lengths)] + [text_prompt]
    reqs = [request(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(zip(prompts, budgets + [11]))]
    got = Collector()
    running_counts = []

    def step():
        got.feed(engine.step())
        running_counts.append(engine.num_running)

    add(engine, *reqs[:3])  # three start together
    for _ in range(3):
        step()
    assert engine.num_running == 3 and all(len(got.tokens[r.request_id]) == 3 for r in reqs[:3])
    add(engine, *reqs[3:7])  # four join a running batch
    while engine.num_running == 7:
        step()
    add(engine, *reqs[7:])  # two join after some left (and the batch was compacted)
    while engine.has_unfinished():
        step()

    # Requests left at different steps, each as soon as it was done.
    assert len(set(running_counts)) > 4 and running_counts[-1] == 0
    for r in reqs:
        expected = reference(r.prompt_token_ids, r.params.max_tokens)
        assert got.tokens[r.request_id] == expected, r.request_id
        ended_by_eos = expected[-1] in engine.eos_token_ids
        assert got.finish[r.request_id][0] == (FINISH_STOP if ended_by_eos else FINISH_LENGTH)
    assert_all_blocks_free(engine)


def test_long_prompt_prefills_in_chunks_while_others_decode_and_still_matches_generate(loaded_demo_model, reference):
    """A 300-token prompt arriving beside decoding streams is prefilled in chunks of at
    most long_prefill_token_threshold tokens; the streams get a token every step meanwhile,
    and every answer (the chunked one too) equals generate() alone."""
    engine = make_engine(loaded_demo_model, max_num_batched_tokens=64, long_prefill_token_threshold=24, block_size=8)
    short = [request(f"s{i}", random_prompt(100 + i, n), max_tokens=40) for i, n in enumerate([12, 9, 20])]
    long = request("long", random_prompt(200, 300), max_tokens=30)
    add(engine, *short)
    got = Collector()
    got.feed(engine.step())
    add(engine, long)
    chunks = []
    real_schedule = engine.scheduler.schedule

    def spy():
        scheduled = real_schedule()
        assert sum(n for _, n in scheduled) <= 64
        chunks.append({s.request_id: n for s, n in scheduled})
        return scheduled

    engine.scheduler.schedule = spy
    got.run(engine)
    long_chunks = [c["long"] for c in chunks if c.get("long", 1) > 1]
    assert sum(long_chunks) == 300 and max(long_chunks) <= 24 and len(long_chunks) >= 13, long_chunks
    # while it prefilled, every unfinished stream decoded in every step
    for c in chunks:
        if c.get("long", 1) > 1:
            assert all(c.get(r.request_id) == 1 for r in short if r.request_id not in got.finish or c is chunks[0]), c
    for r in short + [long]:
        assert got.tokens[r.request_id] == reference(r.prompt_token_ids, r.params.max_tokens), r.request_id
    assert_all_blocks_free(engine)


def test_a_prompt_alone_takes_the_whole_budget(loaded_demo_model, reference):
    engine = make_engine(loaded_demo_model, max_num_batched_tokens=100, long_prefill_token_threshold=10)
    prompt = random_prompt(7, 250)
    add(engine, request("p", prompt, max_tokens=5))
    steps = 0
    got = Collector()
    while "p" not in got.tokens:
        got.feed(engine.step())
        steps += 1
    assert steps == 3  # 100 + 100 + 50: the threshold applies only beside decodes
    got.run(engine)
    assert got.tokens["p"] == reference(prompt, 5)


def test_preempted_requests_recompute_and_finish_with_the_same_answer(loaded_demo_model, reference):
    """A KV cache too small for everyone at once: the newest running requests are
    preempted (blocks freed, recomputed later from prompt + outputs) and every
    answer still equals generate() alone; usage never exceeds the cache."""
    block = 8
    engine = make_engine(loaded_demo_model, block_size=block, kv_cache_memory_bytes=24 * block * bytes_per_token(engine_shape(loaded_demo_model)))
    assert engine.blocks.num_blocks == 24
    reqs = [request(f"p{i}", random_prompt(300 + i, 20 + 3 * i), max_tokens=40, ignore_eos=True) for i in range(5)]
    add(engine, *reqs)
    got = Collector()
    peak = 0.0
    while engine.has_unfinished():
        got.feed(engine.step())
        peak = max(peak, engine.kv_usage)
    assert engine.num_preemptions > 0
    assert peak <= 1.0
    for r in reqs:
        assert got.tokens[r.request_id] == reference(r.prompt_token_ids, 40), r.request_id
    assert_all_blocks_free(engine)


def test_a_request_that_can_never_fit_the_kv_cache_fails_alone(loaded_demo_model):
    engine = make_engine(loaded_demo_model, block_size=8, kv_cache_memory_bytes=10 * 8 * bytes_per_token(engine_shape(loaded_demo_model)))
    out = engine.add_request(request("big", random_prompt(1, 70), max_tokens=20))
    assert out is not None and out.finish_reason == FINISH_ERROR and "KV cache of 80 tokens" in out.error
    add(engine, request("ok", random_prompt(2, 30), max_tokens=20))
    got = Collector().run(engine)
    assert len(got.tokens["ok"]) == 20 or got.finish["ok"][0] == FINISH_STOP


def test_first_token_comes_with_the_prefill_step(loaded_demo_model, reference):
    engine = make_engine(loaded_demo_model)
    prompt = random_prompt(100, 9)
    add(engine, request("a", prompt, max_tokens=4))
    outputs = engine.step()
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", reference(prompt, 4)[:1])]
    assert engine.last_step_ms > 0


@pytest.mark.parametrize("arch", ["gpt2", "mistral-sliding-window"])
def test_other_architectures_match_generate(arch, tmp_path, monkeypatch):
    """Not just Llama: learned absolute positions (GPT-2) and a sliding window
    shorter than the prompt (Mistral) both survive left padding and compaction."""
    import transformers as tf

    if arch == "gpt2":
        config = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128, eos_token_id=1)
        cls = tf.GPT2LMHeadModel
    else:
        config = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
                                  sliding_window=8, eos_token_id=1)
        cls = tf.MistralForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as for the demo model (see conftest)
    loaded = load_model(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    prompts = [[t % 512 for t in random_prompt(i, n)] for i, n in enumerate((3, 20, 11))]
    engine = make_engine(loaded)
    add(engine, *(request(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts[:2])))
    got = Collector()
    got.feed(engine.step())
    add(engine, request("2", prompts[2], max_tokens=12, ignore_eos=True))
    got.run(engine)
    loaded.model.generation_config.eos_token_id = None  # generate()'s ignore_eos
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                    do_sample=False, pad_token_id=0)
        assert got.tokens[str(i)] == ref[0, len(p):].tolist(), i


# ---------------------------------------------------------------- stopping


def first_new_token(tokens: list[int], start: int) -> int:
    """The first index >= start whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_ignore_eos_gives_exact_lengths(loaded_demo_model):
    prompt = random_prompt(7, 10)
    greedy = Collector().run(_with(make_engine(loaded_demo_model), "g", prompt, max_tokens=12)).tokens["g"]
    # Make a greedy token an EOS id: without ignore_eos the request must stop there.
    cut = first_new_token(greedy, 2)
    forced = make_engine(dataclasses.replace(loaded_demo_model, eos_token_ids=frozenset({greedy[cut]})))
    for n in (1, 3, 5, 12):
        add(forced, request(f"ign{n}", prompt, max_tokens=n, ignore_eos=True))
    add(forced, request("eos", prompt, max_tokens=12))
    got = Collector().run(forced)
    for n in (1, 3, 5, 12):
        assert got.tokens[f"ign{n}"] == greedy[:n]
        assert got.finish[f"ign{n}"] == (FINISH_LENGTH, None)
    assert got.tokens["eos"] == greedy[: cut + 1] and got.finish["eos"] == (FINISH_STOP, None)


def test_min_tokens_holds_back_eos_and_stop_tokens(loaded_demo_model):
    prompt = random_prompt(7, 10)
    greedy = Collector().run(_with(make_engine(loaded_demo_model), "g", prompt, max_tokens=12)).tokens["g"]
    eos_at = first_new_token(greedy, 1)
    stop_at = first_new_token(greedy, eos_at + 1)
    eos_token, stop_token = greedy[eos_at], greedy[stop_at]
    forced = make_engine(dataclasses.replace(loaded_demo_model, eos_token_ids=frozenset({eos_token})))
    add(forced, request("m", prompt, max_tokens=12, min_tokens=5, stop_token_ids=(stop_token,)))
    got = Collector().run(forced).tokens["m"]
    assert eos_token not in got[:5] and stop_token not in got[:5]
    assert got[:eos_at] == greedy[:eos_at]  # the other tokens are not touched
    assert len(got) > 5


def _with(engine: EngineCore, rid: str, prompt: list[int], **params) -> EngineCore:
    add(engine, request(rid, prompt, **params))
    return engine


def test_stop_token_ids_finish_with_the_stop_token_included(loaded_demo_model, reference):
    prompt = random_prompt(21, 14)
    expected = reference(prompt, 16)
    stop = expected[5]
    cut = expected.index(stop)
    engine = _with(make_engine(loaded_demo_model), "s", prompt, max_tokens=16, stop_token_ids=(stop, 999999))
    got = Collector().run(engine)
    assert got.tokens["s"] == expected[: cut + 1]
    assert got.finish["s"] == (FINISH_STOP, stop)


# ---------------------------------------------------------------- slots, abort, counters


def test_max_num_seqs_caps_running_and_counters_follow(loaded_demo_model):
    engine = make_engine(loaded_demo_model, max_num_seqs=2)
    lengths = [4, 6, 8, 10, 12]
    add(engine, *(request(f"q{i}", random_prompt(i, n), max_tokens=5, ignore_eos=True)
                  for i, n in enumerate(lengths)))
    assert (engine.num_running, engine.num_waiting, engine.num_waiting_prefill_tokens) == (0, 5, 40)
    got = Collector()
    got.feed(engine.step())
    assert (engine.num_running, engine.num_waiting, engine.num_waiting_prefill_tokens) == (2, 3, 30)
    assert engine.num_remaining_decode_tokens == 2 * 4 and engine.slot_usage == 1.0
    while engine.has_unfinished():
        got.feed(engine.step())
        assert engine.num_running <= 2
    assert all(len(got.tokens[f"q{i}"]) == 5 for i in range(5))
    assert (engine.num_waiting_prefill_tokens, engine.num_remaining_decode_tokens, engine.slot_usage) == (0, 0, 0.0)


def test_without_chunked_prefill_whole_prompts_are_admitted_in_order_and_oversized_ones_go_alone(loaded_demo_model):
    engine = make_engine(loaded_demo_model, max_num_batched_tokens=20, enable_chunked_prefill=False)
    add(engine, *(request(f"b{i}", random_prompt(i, n), max_tokens=10, ignore_eos=True)
                  for i, n in enumerate([8, 8, 8, 30, 4])))
    running = []
    for _ in range(4):
        engine.step()
        running.append(engine.num_running)
    # 2 x 8 fits in 20 (with the decodes of the running ones counted); 30 exceeds the budget but runs alone.
    assert running == [2, 3, 4, 5]


def test_chunked_prefill_fills_the_budget_in_arrival_order(loaded_demo_model):
    engine = make_engine(loaded_demo_model, max_num_batched_tokens=20, long_prefill_token_threshold=20)
    add(engine, *(request(f"b{i}", random_prompt(i, n), max_tokens=10, ignore_eos=True)
                  for i, n in enumerate([8, 8, 8, 30, 4])))
    plans = []
    real_schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(real_schedule()) or plans[-1]
    for _ in range(4):
        engine.step()
    as_ids = [[(s.request_id, n) for s, n in plan] for plan in plans]
    assert as_ids[0] == [("b0", 8), ("b1", 8), ("b2", 4)]
    assert as_ids[1] == [("b0", 1), ("b1", 1), ("b2", 4), ("b3", 14)]
    assert as_ids[2] == [("b0", 1), ("b1", 1), ("b2", 1), ("b3", 16), ("b4", 1)]


def test_abort_frees_the_slot_at_once(loaded_demo_model):
    engine = make_engine(loaded_demo_model, max_num_seqs=2)
    add(engine, *(request(rid, random_prompt(i, 6 + i), max_tokens=30, ignore_eos=True)
                  for i, rid in enumerate("abcd")))
    got = Collector()
    got.feed(engine.step())
    assert (engine.num_running, engine.num_waiting) == (2, 2)

    engine.abort_requests(["a", "no-such-id"])
    assert engine.num_running == 1 and engine.blocks.num_free_blocks == engine.blocks.num_blocks - 1
    engine.abort_requests(["d"])  # still waiting
    assert engine.num_waiting == 1 and engine.num_waiting_prefill_tokens == 8
    for _ in range(3):
        got.feed(engine.step())
    assert (engine.num_running, engine.num_waiting) == (2, 0)
    engine.abort_requests(["b", "c"])
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)
    assert engine.step() == []
    assert set(got.tokens) == {"a", "b", "c"} and len(got.tokens["a"]) == 1 and not got.finish


def test_aborted_neighbours_do_not_change_greedy_output(loaded_demo_model, reference):
    engine = make_engine(loaded_demo_model)
    keep = random_prompt(50, 5)
    add(engine, request("long-neighbour", random_prompt(51, 35), max_tokens=30), request("keep", keep, max_tokens=20))
    got = Collector()
    for _ in range(4):
        got.feed(engine.step())
    engine.abort_requests(["long-neighbour"])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks - 1  # its blocks came back at once
    got.run(engine)
    assert got.tokens["keep"] == reference(keep, 20)


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible_and_seeds_differ(loaded_demo_model):
    prompt = random_prompt(3, 8)
    sampled = dict(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True)
    alone = Collector().run(_with(make_engine(loaded_demo_model), "s", prompt, seed=7, **sampled)).tokens["s"]

    crowded = make_engine(loaded_demo_model, seed=99)
    add(crowded, *(request(f"n{i}", random_prompt(60 + i, 3 + 5 * i), **sampled) for i in range(3)))
    got = Collector()
    got.feed(crowded.step())
    add(crowded, request("s", prompt, seed=7, **sampled), request("t", prompt, seed=8, **sampled))
    got.run(crowded)
    assert got.tokens["s"] == alone
    assert got.tokens["t"] != alone
    assert len({tuple(got.tokens[f"n{i}"]) for i in range(3)}) == 3


def test_top_k_one_and_tiny_top_p_equal_greedy(loaded_demo_model, reference):
    prompt = random_prompt(11, 12)
    engine = make_engine(loaded_demo_model)
    add(engine, request("k", prompt, temperature=1.7, top_k=1, max_tokens=15),
        request("p", prompt, temperature=0.9, top_p=1e-6, seed=5, max_tokens=15))
    got = Collector().run(engine)
    assert got.tokens["k"] == got.tokens["p"] == reference(prompt, 15)


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize(("prompt", "params", "needle"), [
    ([], {}, "empty"),
    ([5] * 2040, {"max_tokens": 16}, "maximum context length"),
    ([5, 2048], {}, "out of range"),
    ([5, -1], {}, "out of range"),
    ([5], {"max_tokens": 0}, "max_tokens"),
    ([5], {"top_p": 0.0}, "top_p"),
    ([5], {"temperature": -0.5}, "temperature"),
    ([5], {"top_k": -3}, "top_k"),
    ([5], {"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
])
def test_invalid_requests_fail_alone(loaded_demo_model, prompt, params, needle):
    engine = make_engine(loaded_demo_model)
    out = engine.add_request(request("bad", prompt, **params))
    assert out is not None and out.request_id == "bad" and out.finish_reason == FINISH_ERROR
    assert needle in out.error and not engine.has_unfinished()


def test_duplicate_id_is_refused_and_the_original_runs_on(loaded_demo_model):
    engine = _with(make_engine(loaded_demo_model), "x", [5, 6, 7], max_tokens=4, ignore_eos=True)
    out = engine.add_request(request("x", [8, 9], max_tokens=4))
    assert out.finish_reason == FINISH_ERROR and "duplicate" in out.error
    assert len(Collector().run(engine).tokens["x"]) == 4
    assert engine.add_request(request("x", [8, 9], max_tokens=2)) is None  # finished ids may be reused


def test_malformed_request_fails_alone_and_any_int_seed_is_accepted(loaded_demo_model):
    engine = make_engine(loaded_demo_model)
    out = engine.add_request(AddRequest("m", [5, "x"], SamplingParams(max_tokens=2), 0.0))
    assert out.finish_reason == FINISH_ERROR and out.error
    for rid, seed in (("neg", -1), ("huge", 2**70)):
        add(engine, request(rid, [5, 6], temperature=1.0, seed=seed, max_tokens=2))
    assert set(Collector().run(engine).finish) == {"neg", "huge"}


def test_top_k_beyond_int64_fails_alone_and_the_engine_serves_on(loaded_demo_model, reference):
    """The request that once crashed a rank: top_k = 2^64 - 1 reaching the sampler."""
    engine = make_engine(loaded_demo_model)
    out = engine.add_request(request("bad", [5, 6], temperature=1.0, top_k=2**64 - 1, max_tokens=2))
    assert out is not None and out.finish_reason == FINISH_ERROR and "top_k" in out.error
    prompt = random_prompt(9, 7)
    add(engine, request("good", prompt, max_tokens=6))
    assert Collector().run(engine).tokens["good"] == reference(prompt, 6)


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(loaded_demo_model, reference, monkeypatch):
    engine = make_engine(loaded_demo_model)
    add(engine, request("a", random_prompt(1, 5), max_tokens=4), request("b", random_prompt(2, 6), max_tokens=4))
    real_execute = engine.runner.execute

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finish_reason == FINISH_ERROR and "simulated kernel failure" in o.error for o in outs)
    assert not engine.has_unfinished() and engine.num_step_errors == 1
    assert_all_blocks_free(engine)
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    prompt = random_prompt(3, 5)
    add(engine, request("c", prompt, max_tokens=4))
    assert Collector().run(engine).tokens["c"] == reference(prompt, 4)


def test_sampling_that_raises_for_one_row_fails_only_that_request(loaded_demo_model, reference, monkeypatch):
    engine = make_engine(loaded_demo_model)
    prompts = {rid: random_prompt(i, 6) for i, rid in enumerate("xyz")}
    add(engine, *(request(rid, p, max_tokens=5) for rid, p in prompts.items()))
    real_sampler = engine.sampler

    def picky(logits, seqs):
        if any(s.request_id == "y" for s in seqs):
            raise ValueError("cannot sample y")
        return real_sampler(logits, seqs)

    monkeypatch.setattr(engine, "sampler", picky)
    got = Collector()
    errors = {}
    while engine.has_unfinished():
        outs = engine.step()
        errors.update({o.request_id: o.error for o in outs if o.finish_reason == FINISH_ERROR})
        got.feed([o for o in outs if o.finish_reason != FINISH_ERROR])
    assert set(errors) == {"y"} and "cannot sample y" in errors["y"]
    for rid in "xz":
        assert got.tokens[rid] == reference(prompts[rid], 5)
    assert_all_blocks_free(engine)


# ---------------------------------------------------------------- demo model and loader


def _hashes(path: str) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


def test_demo_model_is_deterministic_atomic_and_idempotent(demo_model_dir, tmp_path):
    target = str(tmp_path / "raced")
    results: list[str] = []
    racers = [threading.Thread(target=lambda: results.append(demo_model.create_demo_model(target)))
              for _ in range(2)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert results == [target, target]
    assert os.listdir(tmp_path) == ["raced"]  # no temp dir left behind
    assert _hashes(target) == _hashes(demo_model_dir)
    before = os.stat(os.path.join(target, "model.safetensors")).st_mtime_ns
    assert demo_model.create_demo_model(target) == target
    assert os.stat(os.path.join(target, "model.safetensors")).st_mtime_ns == before


def test_demo_model_loads_with_transformers_and_tokenizers(demo_model_dir):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(demo_model_dir, output_loading_info=True)
    assert not any(info.values()) and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 2_000_000

    tok = Tokenizer.from_file(os.path.join(demo_model_dir, "tokenizer.json"))
    bos, eos, im_end = (tok.token_to_id(t) for t in (demo_model.BOS, demo_model.EOS, demo_model.IM_END))
    assert tok.get_vocab_size() == model.config.vocab_size == 2048
    text = "Hello world, the model answers 42 questions."
    ids = tok.encode(text).ids
    assert ids[0] == bos and ids.count(bos) == 1 and len(ids) < len(text) // 2
    assert tok.decode(ids) == text
    with open(os.path.join(demo_model_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [eos, im_end]
    with open(os.path.join(demo_model_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    assert tok_cfg["add_bos_token"] is True and tok_cfg["eos_token"] == demo_model.EOS
    assert read_eos_token_ids(demo_model_dir) == {eos, im_end}


def test_demo_model_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DPSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert demo_model.default_demo_model_dir() == str(tmp_path / "c" / "demo-model-v1")
    monkeypatch.delenv("DPSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert demo_model.default_demo_model_dir() == str(tmp_path / "x" / "dpserve" / "demo-model-v1")


@pytest.mark.parametrize(
    "device, fast, stored, expected",
    [
        ("cpu", False, "float32", torch.float32),  # emulated bf16 is slower than fp32 on such CPUs
        ("cpu", True, "float32", torch.bfloat16),  # AVX512-BF16 / AMX: vLLM's downcast
        ("cpu", False, "bfloat16", torch.float32),
        ("cuda", True, "float32", torch.bfloat16),
        ("cuda", False, "float32", torch.float16),
        ("cuda", True, "float16", torch.float16),  # a 16-bit checkpoint keeps its dtype
        ("cuda", False, "bfloat16", torch.float16),
    ],
)
def test_auto_dtype_follows_vllm(tmp_path, monkeypatch, device, fast, stored, expected):
    from dpserve.engine import loader

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": stored}))
    monkeypatch.setattr(loader, "fast_bf16", lambda _device: fast)
    assert resolve_dtype("auto", torch.device(device), str(tmp_path)) == expected
    assert resolve_dtype("float16", torch.device(device), str(tmp_path)) == torch.float16


def test_bf16_kernels_that_cannot_be_built_mean_float32_or_a_clear_refusal(tmp_path, monkeypatch, caplog):
    """Under a W^X rule (systemd's MemoryDenyWriteExecute=yes) oneDNN cannot generate its
    bf16 kernels and every matmul raises; torch's own error is what the probe must catch."""
    from dpserve.engine import loader

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    monkeypatch.setattr(loader, "fast_bf16", lambda _device: True)
    assert loader.cpu_half_kernels_problem(torch.bfloat16) == "", "this process can build them"
    real_linear = torch.nn.functional.linear

    def linear(x, w, b=None):
        if x.dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive")
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    with caplog.at_level("WARNING"):
        assert resolve_dtype("auto", torch.device("cpu"), str(tmp_path)) == torch.float32
    assert "could not create a primitive" in caplog.text and "MemoryDenyWriteExecute" in caplog.text
    with pytest.raises(ValueError, match=r"--dtype bfloat16: .*could not create a primitive.*--dtype float32"):
        resolve_dtype("bfloat16", torch.device("cpu"), str(tmp_path))
    assert resolve_dtype("float32", torch.device("cpu"), str(tmp_path)) == torch.float32


def test_loader_resolution_and_eos_fallback(tmp_path):
    assert resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert read_eos_token_ids(str(tmp_path)) == {7}
