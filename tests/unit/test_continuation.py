"""A request moved mid-answer (AddRequest.num_prior_outputs) goes on exactly where it was.

The native engine against itself on the demo model (float32): an answer cut after k
tokens and sent again as a continuation (prompt + those k tokens, the original
parameters) ends with the same tokens, logprobs and finish as the answer never cut,
seeded sampling, penalties, min_tokens and a grammar included.
"""

from __future__ import annotations

import asyncio

import pytest
from dpserve.engine.common.protocol import AddRequest, SamplingParams, seed_for

from tests.unit.test_sampler import make_engine, prompt, run

pytestmark = pytest.mark.timeout(120)


def answer(engine, rid: str, ids: list[int], params: SamplingParams, prior: list[int] = ()) -> tuple[list[int], list, str]:
    """(token ids, logprobs, finish) of one request run alone to its end."""
    req = AddRequest(rid, list(ids) + list(prior), params, 0.0, len(prior))
    outs = run(engine, req)[rid]
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in (o.logprobs or ())]
    return tokens, logprobs, outs[-1].finish_reason


CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True),
    "seeded-top-k-p": SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=-7, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=24, temperature=1.0, seed=5, presence_penalty=1.5, frequency_penalty=1.0,
                                repetition_penalty=1.3, ignore_eos=True),
    "min-tokens": SamplingParams(max_tokens=24, temperature=1.0, seed=9, min_tokens=20),
    "logprobs": SamplingParams(max_tokens=24, temperature=1.0, seed=11, logprobs=3, ignore_eos=True),
}


@pytest.mark.parametrize("cut", [1, 7, 23])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_continuation_ends_as_the_uncut_answer(loaded_demo_model, case, cut):
    engine = make_engine(loaded_demo_model)
    params, ids = CASES[case], prompt(3, 12)
    whole, whole_lp, finish = answer(engine, "whole", ids, params)
    if cut >= len(whole):
        pytest.skip("the answer ended before the cut")
    rest, rest_lp, rest_finish = answer(engine, "rest", ids, params, whole[:cut])
    assert whole[:cut] + rest == whole
    assert rest_finish == finish
    if params.logprobs:
        assert [lp.token_id for lp in rest_lp] == [lp.token_id for lp in whole_lp[cut:]]
        assert [lp.logprob for lp in rest_lp] == pytest.approx([lp.logprob for lp in whole_lp[cut:]], abs=1e-4)


def test_a_guided_continuation_resumes_its_grammar(loaded_demo_model):
    from dpserve.daemons.api.guided import guided_grammar
    from dpserve.daemons.api.openai_types import CompletionRequest

    grammar = asyncio.run(guided_grammar(CompletionRequest(model="m", prompt="x", guided_regex="(ab|cd){3,6}z")))
    engine = make_engine(loaded_demo_model)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=42, guided_grammar=grammar)
    ids = prompt(4, 8)
    whole, _, finish = answer(engine, "whole", ids, params)
    assert len(whole) > 2
    rest, _, rest_finish = answer(engine, "rest", ids, params, whole[:2])
    assert whole[:2] + rest == whole and rest_finish == finish


def test_a_continuation_that_broke_the_grammar_fails_alone(loaded_demo_model):
    from dpserve.daemons.api.guided import guided_grammar
    from dpserve.daemons.api.openai_types import CompletionRequest
    from dpserve.engine.common.protocol import FINISH_ERROR

    grammar = asyncio.run(guided_grammar(CompletionRequest(model="m", prompt="x", guided_regex="(ab)+z")))
    engine = make_engine(loaded_demo_model)
    bad = AddRequest("bad", prompt(4, 8) + [prompt(9, 1)[0]], SamplingParams(max_tokens=8, guided_grammar=grammar), 0.0, 1)
    assert engine.add_request(bad) is None
    outs = []
    for _ in range(200):
        outs += engine.step()
        if not engine.has_unfinished():
            break
    assert [o.finish_reason for o in outs] == [FINISH_ERROR] and "resume" in outs[0].error


@pytest.mark.parametrize("prior, max_tokens", [(-1, 8), (8, 8), (9, 8)])
def test_impossible_prior_counts_are_refused(loaded_demo_model, prior, max_tokens):
    engine = make_engine(loaded_demo_model)
    out = engine.add_request(AddRequest("r", prompt(1, 12), SamplingParams(max_tokens=max_tokens), 0.0, prior))
    assert out is not None and out.error and not engine.has_unfinished()


def test_seeds_of_neighbouring_positions_and_seeds_differ():
    seen = {seed_for(s, p) for s in range(-4, 60) for p in range(64)}
    assert len(seen) == 64 * 64
    assert all(0 <= v < 2**64 for v in seen)
