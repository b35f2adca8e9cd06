"""The sampler's logits processors against reference computations in torch,
and the engine's logprobs against the demo model's own logits."""

from __future__ import annotations

import math
import random

import pytest
import torch
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.common.protocol import FINISH_ERROR, AddRequest, SamplingParams, seed_for
from dpserve.engine.core import EngineCore
from dpserve.engine.logits_processors import LOGPROB_FLOOR, apply_bias_and_penalties, token_logprobs
from dpserve.engine.sampler import Sampler
from dpserve.engine.sequence import Sequence
from dpserve.engine.testing import demo_model

pytestmark = pytest.mark.timeout(120)

VOCAB = 50


def seq(prompt: list[int], output: list[int] = (), **params) -> Sequence:
    params.setdefault("max_tokens", 16)
    s = Sequence("r", prompt, SamplingParams(**params))
    s.token_ids.extend(output)
    return s


def reference_processed(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    """vLLM's bias and penalties written out token by token."""
    p = s.params
    out = logits.clone()
    for token, bias in p.logit_bias:
        out[token] += bias
    outputs = s.output_token_ids
    for token in range(out.shape[0]):
        if token in outputs or token in s.prompt_token_ids:
            value = out[token].item()
            out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = outputs.count(token)
        out[token] -= p.frequency_penalty * count
        if count:
            out[token] -= p.presence_penalty
    return out


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.7),
        dict(repetition_penalty=0.6),
        dict(frequency_penalty=0.9),
        dict(presence_penalty=-1.3),
        dict(logit_bias=((3, 5.0), (7, -100.0))),
        dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7, logit_bias=((1, 2.5),)),
    ],
)
def test_bias_and_penalties_match_the_reference(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    seqs = [seq([1, 2, 2, 9], [4, 4, 4, 11, 2], **params), seq([5], []), seq([8, 8], [8, 30, 30], **params)]
    got = logits.clone()
    apply_bias_and_penalties(got, seqs, [0, 2])
    torch.testing.assert_close(got[0], reference_processed(logits[0], seqs[0]))
    torch.testing.assert_close(got[1], logits[1])  # a row that was not named is untouched
    torch.testing.assert_close(got[2], reference_processed(logits[2], seqs[2]))


def test_greedy_rows_take_the_argmax_after_processors_and_plain_rows_are_unchanged():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    top = int(logits[0].argmax())
    seqs = [seq([top], [top], temperature=0.0, repetition_penalty=50.0, logit_bias=((0, 100.0),)),
            seq([top], [top], temperature=0.0)]
    tokens, logprobs = Sampler(frozenset(), torch.Generator())(logits, seqs)
    assert tokens == [0, int(logits[1].argmax())]
    assert logprobs is None  # nobody asked


def test_logprobs_are_log_softmax_of_processed_scaled_logits_with_rank_and_top():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=gen) * 2
    seqs = [
        seq([1], [], temperature=0.0, logprobs=5),
        seq([1], [3, 3], temperature=0.7, seed=5, logprobs=0, frequency_penalty=1.0),
        seq([1], [], temperature=1.0),
    ]
    tokens, logprobs = Sampler(frozenset(), torch.Generator().manual_seed(0))(logits, seqs)
    assert logprobs[2] is None
    ref0 = torch.log_softmax(logits[0], -1)
    ref1 = torch.log_softmax(reference_processed(logits[1], seqs[1]) / 0.7, -1)
    for lp, ref, token in ((logprobs[0], ref0, tokens[0]), (logprobs[1], ref1, tokens[1])):
        assert lp.token_id == token
        assert math.isclose(lp.logprob, ref[token].item(), abs_tol=1e-5)
        assert lp.rank == int((ref > ref[token]).sum()) + 1
    assert logprobs[0].rank == 1  # greedy took the most likely token
    assert logprobs[0].top_ids == ref0.topk(5).indices.tolist()
    torch.testing.assert_close(torch.tensor(logprobs[0].top_logprobs), ref0.topk(5).values)
    assert logprobs[1].top_ids == [] and logprobs[1].top_logprobs == []


def test_a_forbidden_token_reports_the_floor_not_minus_infinity():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = float("-inf")
    (lp,) = token_logprobs(logits, [4], [VOCAB])
    assert lp.logprob == LOGPROB_FLOOR and min(lp.top_logprobs) == LOGPROB_FLOOR


def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 7], logits[0, 8], logits[0, 9] = 5.0, 5.0 + math.log(0.5), 5.0 + math.log(0.05)
    sampler = Sampler(frozenset(), torch.Generator().manual_seed(0))
    seen = set()
    for seed in range(300):
        tokens, _ = sampler(logits, [seq([1], [], temperature=1.0, min_p=0.1, seed=seed)])
        seen.update(tokens)
    assert seen == {7, 8}  # 9 is at 0.05 of the top, below min_p; 8 at 0.5 stays
    tokens, _ = sampler(logits, [seq([1], [], temperature=1.0, min_p=1.0, seed=1)])
    assert tokens == [7]


def test_seeded_rows_with_processors_repeat_and_do_not_depend_on_the_batch():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = dict(temperature=1.0, seed=42, presence_penalty=0.5, min_p=0.05, logprobs=2)
    sampler = Sampler(frozenset(), torch.Generator().manual_seed(9))
    alone, lp_alone = sampler(logits[1:2], [seq([1], [2], **params)])
    batch, lp_batch = sampler(logits, [seq([1], [], temperature=1.0), seq([1], [2], **params), seq([3], [], temperature=0.5)])
    assert batch[1] == alone[0] and lp_batch[1] == lp_alone[0]


# ---------------------------------------------------------------- the engine on the demo model


def make_engine(loaded, **overrides) -> EngineCore:
    return EngineCore.from_loaded(EngineConfig(model=loaded.model_dir, device="cpu", dtype="float32", **overrides), loaded)


def run(engine: EngineCore, *reqs: AddRequest) -> dict[str, list]:
    for r in reqs:
        assert engine.add_request(r) is None
    outs: dict[str, list] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            assert out.finish_reason != FINISH_ERROR, out.error
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(demo_model.SPECIAL_TOKENS), demo_model.VOCAB_SIZE) for _ in range(length)]


@pytest.mark.parametrize("budget", [0, 8])  # 8: the prompt prefills in several chunks
def test_engine_logprobs_match_the_models_own_logits(loaded_demo_model, budget):
    overrides = dict(max_num_batched_tokens=budget, long_prefill_token_threshold=budget) if budget else {}
    engine = make_engine(loaded_demo_model, **overrides)
    ids = prompt(7, 21)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = run(engine, AddRequest("a", ids, params, 0.0), AddRequest("b", prompt(8, 13), plain, 0.0))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs["b"])
    tokens = [t for o in outs["a"] for t in o.new_token_ids]
    assert [o.prompt_logprobs is not None for o in outs["a"]] == [True] + [False] * 5
    sampled = [lp for o in outs["a"] for lp in o.logprobs]
    # The model over prompt + answer at once: position p's logits score token p + 1.
    full = torch.tensor([ids + tokens])
    with torch.inference_mode():
        ref = torch.log_softmax(loaded_demo_model.model(full).logits[0].float(), -1)
    scored = outs["a"][0].prompt_logprobs + sampled
    assert len(scored) == len(ids) - 1 + len(tokens)
    for pos, lp in enumerate(scored):
        target = (ids + tokens)[pos + 1]
        assert lp.token_id == target
        assert math.isclose(lp.logprob, ref[pos, target].item(), abs_tol=1e-4), pos
        above = ref[pos] - ref[pos, target]  # rank within fp tolerance of ties
        assert int((above > 1e-4).sum()) + 1 <= lp.rank <= int((above > -1e-4).sum()), pos
        k = 2 if pos < len(ids) - 1 else 3
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), ref[pos].topk(k).values, atol=1e-4, rtol=0)
    assert all(lp.rank == 1 for lp in sampled)  # greedy


def test_engine_refuses_out_of_range_processor_values_per_request(loaded_demo_model):
    engine = make_engine(loaded_demo_model)
    bad = [
        dict(presence_penalty=3.0),
        dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0.0),
        dict(min_p=1.5),
        dict(logit_bias=((demo_model.VOCAB_SIZE + 5, 1.0),)),
        dict(logit_bias=((3, 101.0),)),
        dict(logprobs=demo_model.VOCAB_SIZE + 1),  # (the API server applies --max-logprobs)
        dict(prompt_logprobs=-1),
    ]
    for i, extra in enumerate(bad):
        out = engine.add_request(AddRequest(f"x{i}", [5, 6], SamplingParams(max_tokens=2, **extra), 0.0))
        assert out is not None and out.finish_reason == FINISH_ERROR, extra
        name = next(iter(extra))
        assert name in out.error, (name, out.error)
    assert not engine.has_unfinished()


def test_preempted_requests_keep_one_logprob_per_token_and_their_prompt_scores(loaded_demo_model):
    """Recompute after preemption runs prompt and outputs again: no position is scored twice."""
    from dpserve.engine.loader import kv_shape

    block = 8
    per_token = kv_shape(loaded_demo_model).bytes_per_token
    engine = make_engine(loaded_demo_model, block_size=block, kv_cache_memory_bytes=24 * block * per_token)
    ids = {f"p{i}": prompt(300 + i, 20 + 3 * i) for i in range(5)}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = run(engine, *(AddRequest(rid, p, params, 0.0) for rid, p in ids.items()))
    assert engine.num_preemptions > 0
    # The same requests alone, on a cache that fits them: the same scores.
    roomy = make_engine(loaded_demo_model)
    for rid, p in ids.items():
        alone = run(roomy, AddRequest(rid, p, params, 0.0))[rid]
        assert [len(o.logprobs) for o in outs[rid]] == [1] * 40
        assert [o.prompt_logprobs is not None for o in outs[rid]] == [True] + [False] * 39
        assert len(outs[rid][0].prompt_logprobs) == len(p) - 1
        for mine, ref in zip(outs[rid][0].prompt_logprobs + [lp for o in outs[rid] for lp in o.logprobs],
                             alone[0].prompt_logprobs + [lp for o in alone for lp in o.logprobs]):
            assert mine.token_id == ref.token_id and math.isclose(mine.logprob, ref.logprob, abs_tol=1e-4)


def test_a_guided_grammar_constrains_every_token_and_a_bad_one_fails_alone(loaded_demo_model):
    import re

    import llguidance
    from tokenizers import Tokenizer

    engine = make_engine(loaded_demo_model)
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-z]{2,6}-[0-9]{1,3}")
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, guided_grammar=grammar) for s in range(4)]
    outs = run(engine, *(AddRequest(f"g{i}", prompt(i, 9), p, 0.0) for i, p in enumerate(params)),
               AddRequest("plain", prompt(9, 9), SamplingParams(max_tokens=5, temperature=0.0), 0.0))
    tok = Tokenizer.from_file(f"{loaded_demo_model.model_dir}/tokenizer.json")
    eos = loaded_demo_model.eos_token_ids
    for i in range(4):
        ids = [t for o in outs[f"g{i}"] for t in o.new_token_ids if t not in eos]
        assert outs[f"g{i}"][-1].finish_reason == "stop"
        assert re.fullmatch("[a-z]{2,6}-[0-9]{1,3}", tok.decode(ids)), tok.decode(ids)
    # A grammar compiles off the step loop (engine/grammar.py): a bad one fails its request from a step.
    assert engine.add_request(AddRequest("bad", [5, 6], SamplingParams(max_tokens=3, guided_grammar="{not a grammar"), 0.0)) is None
    bad = [o for _ in range(100) for o in engine.step() if o.request_id == "bad"]
    assert bad and bad[0].finish_reason == FINISH_ERROR


def test_a_grammar_past_the_resource_limits_fails_its_own_answer_and_spares_the_others(loaded_demo_model):
    """A regex like a{100000} (the API server's cost model refuses it; sent here
    directly) cost the engine's loop tens of ms per token under llguidance's
    default limits. Under GRAMMAR_LIMITS its lexer runs out of fuel: that
    request fails at once (never a "stop" with broken output), the others go
    on as alone."""
    import llguidance

    engine = make_engine(loaded_demo_model)
    grammar = llguidance.LLMatcher.grammar_from_regex("a{100000}")
    assert engine.add_request(AddRequest("huge", prompt(1, 9), SamplingParams(max_tokens=60, temperature=0.0, guided_grammar=grammar), 0.0)) is None
    huge = []
    for _ in range(200):
        huge = huge or [o for o in engine.step() if o.request_id == "huge" and o.finish_reason]
    assert huge[0].finish_reason == FINISH_ERROR and "grammar" in huge[0].error, huge
    outs = run(engine, AddRequest("plain", prompt(9, 9), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), 0.0))
    alone = run(make_engine(loaded_demo_model), AddRequest("plain", prompt(9, 9), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), 0.0))
    assert [t for o in outs["plain"] for t in o.new_token_ids] == [t for o in alone["plain"] for t in o.new_token_ids]


def test_logprob_token_ids_report_those_ids_in_their_order():
    # vLLM's logprob_token_ids: the listed ids' logprobs in place of the top ones, row by row
    logits = torch.randn(2, VOCAB)
    ref = torch.log_softmax(logits, dim=-1)
    plain, listed = token_logprobs(logits, [3, 4], [2, 2], [(), (9, 0, 4)])
    assert plain.top_ids == ref[0].topk(2).indices.tolist()
    assert listed.top_ids == [9, 0, 4] and listed.token_id == 4
    torch.testing.assert_close(torch.tensor(listed.top_logprobs), ref[1, [9, 0, 4]])
    assert listed.rank == int((ref[1] > ref[1, 4]).sum()) + 1


def test_draws_follow_the_distribution_and_never_pick_a_ruled_out_token():
    """The inverse-transform draw against the probabilities it was given: 40,000 rows, each token's
    count within 5 standard deviations of its expectation, and zero-probability tokens (between,
    before and after the allowed ones) never drawn."""
    probs = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.2, 1e-3, 0.099, 0.0])
    n = 40_000
    sampler = Sampler(frozenset(), torch.Generator().manual_seed(5))
    picked = sampler._draw(probs.expand(n, -1), [seq([1], temperature=1.0) for _ in range(n)])
    counts = torch.bincount(picked, minlength=len(probs)).double()
    for token, p in enumerate(probs.double().tolist()):
        if p == 0:
            assert counts[token] == 0, token
        else:
            assert abs(counts[token] - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (token, counts[token].item(), n * p)


def test_a_seeded_draw_depends_on_its_seed_and_position_only():
    probs = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)), -1).expand(4, -1)
    sampler = Sampler(frozenset(), torch.Generator().manual_seed(0))
    rows = [seq([1], temperature=1.0, seed=7), seq([1], [4, 5], temperature=1.0, seed=7),
            seq([9], temperature=1.0, seed=7), seq([1], temperature=1.0, seed=8)]
    first = sampler._draw(probs, rows).tolist()
    again = Sampler(frozenset(), torch.Generator().manual_seed(99))._draw(probs, rows).tolist()
    assert first == again  # the engine-wide generator plays no part in seeded rows
    assert first[0] == first[2]  # same seed, same position: same token, whatever the prompt
    draws = {tuple(sampler._draw(probs[:1], [seq([1], [2] * k, temperature=1.0, seed=7)]).tolist()) for k in range(40)}
    assert len(draws) > 1  # the position moves the draw


def _reference_truncated_pick(row: torch.Tensor, p: SamplingParams, u: float) -> tuple[int, set[int]]:
    """The draw over the fully sorted row (the sampler's former path): top-k, then top-p over the
    renormalised top-k set, then the first token whose running mass passes u x the kept total."""
    values, order = row.sort(descending=True, stable=True)
    if p.top_k > 0:
        values[p.top_k:] = float("-inf")
    probs = values.softmax(-1)
    if p.top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs > p.top_p, 0.0)
    cdf = probs.double().cumsum(-1)
    pick = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64), right=True))
    return int(order[pick]), {int(t) for t in order[probs > 0]}


@pytest.mark.parametrize("shape, params", [
    ("peaked", dict(top_k=20)),
    ("peaked", dict(top_k=300)),  # wider than the top-p candidates
    ("peaked", dict(top_p=0.9)),  # the nucleus fits the candidates
    ("wide", dict(top_p=0.9)),  # it does not: 16x as many candidates hold it
    ("flat", dict(top_p=0.9)),  # they could not either: the whole row is sorted
    ("flat", dict(top_k=40, top_p=0.5)),
    ("peaked", dict(top_k=60, top_p=0.95, min_p=0.01)),
])
def test_truncated_draws_equal_a_draw_over_the_fully_sorted_row(shape, params):
    """top-k / top-p sort only their candidates, yet a seeded row picks exactly the token the
    draw over the fully sorted vocabulary picks with the same uniform, and only kept tokens;
    beside plain, greedy and other truncated rows of the batch."""
    vocab, spread = 49_152, {"peaked": 4.0, "wide": 3.0, "flat": 0.05}[shape]  # nucleus ~235, ~2,500, ~44,000
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler(frozenset(), torch.Generator().manual_seed(0))
    for trial in range(12):
        logits = torch.randn(4, vocab, generator=gen) * spread
        rows = [seq([1], [2] * trial, temperature=0.8, seed=100 + trial, **params),
                seq([1], temperature=1.0),  # plain
                seq([1], temperature=0.0),  # greedy
                seq([1], [3] * trial, temperature=1.3, top_k=7, seed=5)]
        tokens, _ = sampler(logits, rows)
        assert tokens[2] == int(logits[2].argmax())
        for i in (0, 3):
            s = rows[i]
            g = torch.Generator().manual_seed(seed_for(s.params.seed, s.num_output_tokens))
            u = torch.rand(1, generator=g, dtype=torch.float64).item()
            scaled = logits[i] / s.params.temperature
            if s.params.min_p > 0:
                probs = scaled.softmax(-1)
                scaled = scaled.masked_fill(probs < s.params.min_p * probs.max(), float("-inf"))
            want, kept = _reference_truncated_pick(scaled, s.params, u)
            assert tokens[i] in kept and tokens[i] == want, (trial, i, tokens[i], want)


def test_top_k_one_is_the_argmax_even_among_ties():
    logits = torch.zeros(3, VOCAB)
    logits[:, [4, 9, 30]] = 2.0  # a three-way tie for the most likely token
    rows = [seq([1], temperature=1.5, top_k=1), seq([1], temperature=0.7, top_k=1, seed=3),
            seq([1], temperature=1.0, top_k=1, top_p=0.2)]
    assert Sampler(frozenset(), torch.Generator().manual_seed(0))(logits, rows)[0] == [4, 4, 4]


@pytest.mark.parametrize("width", [7, 256, 1000, 49_152, 50_257])
def test_the_blocked_running_sum_picks_what_one_running_sum_over_the_row_picks(width):
    """inverse_transform sums by blocks, then inside one; against searchsorted over the row's own
    float64 cumsum: the same column for every u (ties of float64 rounding aside, none here), a
    tail block shorter than the others included, and never a zero-probability column."""
    from dpserve.engine.sampler import inverse_transform

    gen = torch.Generator().manual_seed(width)
    probs = torch.rand(6, width, generator=gen) ** 4
    probs[:, ::3] = 0.0  # ruled-out columns between the others
    probs[1, : width // 2] = 0.0  # mass only at the end of the row
    probs[2, width // 3 + 1:] = 0.0  # only at its start
    u = torch.rand(6, 1, generator=gen, dtype=torch.float64)
    u[3] = 0.0
    u[4] = 1.0 - 2 ** -53  # the largest uniform
    cdf = probs.cumsum(-1, dtype=torch.float64)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    got = inverse_transform(probs, u)
    assert got.tolist() == want.tolist()
    assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())
