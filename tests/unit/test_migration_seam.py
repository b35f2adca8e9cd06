"""The seam of a moved request, as property tests: wherever the move falls, the answer is the same.

A deterministic stand-in for a rank's model (each next id a function of the whole
context, what a greedy model is) feeds a Generation's RequestState, as the EngineClient
would; at a random point the request is moved: migration.continuation() builds the
message for the next rank, whose outputs are then computed from that message's prompt
alone. Some outputs may still be pending in the state (not yet taken by the handler)
when the move comes. The text read through text_pieces (stop strings, EOS, logprob
positions) and the usage must equal the same request never moved.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from dpserve.daemons.api.generation import Generation, TextOptions, join_pieces, text_pieces
from dpserve.daemons.api.logprobs import ScoredRequestState
from dpserve.daemons.api.migration import continuation
from dpserve.daemons.api.tokenizer import TextTokenizer
from dpserve.engine.common.protocol import FINISH_LENGTH, FINISH_STOP, RequestOutput, SamplingParams, TokenLogprobs
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def tok(demo_model_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(demo_model_dir)


def model(context: list[int], vocab: int) -> int:
    """A 'greedy model': the next id from a hash of the whole context (ids 3.. : no specials but EOS sometimes)."""
    h = int.from_bytes(hashlib.blake2b(str(context).encode(), digest_size=8).digest(), "little")
    return 2 if h % 97 == 0 else 3 + h % (vocab - 3)


class FakeClient:
    def __init__(self) -> None:
        self.aborted = []

    def abort(self, state) -> None:
        self.aborted.append(state.request_id)


async def answer(tok, prompt: list[int], params: SamplingParams, opts: TextOptions, cut: int, pending: int, move: bool):
    """(text, finish, num_output_tokens, continuation or None, logprob positions) of one request,
    moved (if `move`) after `cut` outputs with the last `pending` of them not yet taken by the
    handler when the move came. The handler reads at the same points either way."""
    gen = Generation("r", prompt, params, state_type=ScoredRequestState)
    gen.state.owner = gen
    client = FakeClient()
    eos = tok.eos_token_ids
    reader = asyncio.ensure_future(join_pieces(text_pieces(gen, tok, client, opts)))
    context = list(prompt)
    produced = 0
    moved = None
    while produced < params.max_tokens and not gen.state.is_finished:
        if move and produced == cut and moved is None:
            moved = continuation(gen.state)
            context = list(moved.prompt_token_ids)  # the next rank knows only the message
        token = model(context, tok.vocab_size)
        context.append(token)
        produced += 1
        finish = FINISH_STOP if token in eos else (FINISH_LENGTH if produced == params.max_tokens else None)
        lp = TokenLogprobs(token, -0.5, 1, [token], [-0.5]) if params.logprobs is not None else None
        gen.state.push(RequestOutput("r", [token], finish, stop_token_id=None, logprobs=[lp] if lp else None))
        # let the handler take what arrived, except the last `pending` outputs before the cut
        if produced < cut - pending or produced > cut:
            await asyncio.sleep(0)
        if finish:
            break
    text, positions, finish = await reader
    return text, finish, gen.state.num_output_tokens, moved, len(positions)


@settings(max_examples=60, deadline=None)
@given(
    prompt_seed=st.integers(0, 10_000),
    max_tokens=st.integers(2, 40),
    cut_frac=st.floats(0.0, 1.0),
    pending=st.integers(0, 4),
    stop=st.sampled_from([(), ("e",), ("th", "an"), ("zq",)]),
    logprobs=st.booleans(),
)
def test_a_move_anywhere_leaves_the_answer_unchanged(tok, prompt_seed, max_tokens, cut_frac, pending, stop, logprobs):
    prompt = [3 + (prompt_seed * 7 + i * 13) % (tok.vocab_size - 3) for i in range(1 + prompt_seed % 9)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1 if logprobs else None, prompt_logprobs=2)
    opts = TextOptions(stops=stop, logprobs=logprobs)
    cut = max(1, min(max_tokens - 1, int(cut_frac * max_tokens)))

    async def both():
        return (await answer(tok, prompt, params, opts, cut, pending, False),
                await answer(tok, prompt, params, opts, cut, pending, True))

    (text, finish, used, _, npos), (text2, finish2, used2, moved, npos2) = asyncio.run(both())
    assert (text2, finish2, used2, npos2) == (text, finish, used, npos)
    if moved is not None:  # the answer was still running at the cut
        assert moved.num_prior_outputs == cut
        assert moved.prompt_token_ids[: len(prompt)] == prompt and len(moved.prompt_token_ids) == len(prompt) + cut
        assert moved.params.prompt_logprobs is None  # they came with the first output already
        assert moved.params.max_tokens == max_tokens  # the engine counts the prior outputs against it


def test_a_move_before_the_first_output_resends_the_request_as_it_was(tok):
    params = SamplingParams(max_tokens=8, prompt_logprobs=3)
    gen = Generation("r", [5, 6, 7], params)
    gen.state.owner = gen
    again = continuation(gen.state)
    assert (again.prompt_token_ids, again.params, again.num_prior_outputs) == ([5, 6, 7], params, 0)
