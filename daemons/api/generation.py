"""A request's state as this API server holds it, and the one loop that turns its
engine outputs into text.

Generation is the whole of an engine request on this side: what was asked and
every token received. Every endpoint reads outputs through take_outputs, and
text through text_pieces (or whole_text, its one-decode shortcut for a whole
answer without stop strings), so a rule about stop tokens, stop strings or
engine errors is written once, here. Nothing here knows HTTP or response shapes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from dpserve.daemons.api.detokenizer import IncrementalDetokenizer, StopChecker, decode_continuation
from dpserve.daemons.api.engine_client import EngineClient
from dpserve.daemons.api.request_state import RequestState
from dpserve.daemons.api.tokenizer import TextTokenizer
from dpserve.engine.common.protocol import FINISH_ERROR, FINISH_STOP, AddRequest, SamplingParams


class EngineFailure(Exception):
    """The engine side ended a request with an error (status: 503 rank failed,
    504 no first token in time, 4xx the engine refused the request)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Generation:
    """One engine request: everything it takes to send it, and all it produced.

    `prompt_ids` and `params` are what is asked of the engine; `output_ids` every
    token taken from `state` so far, in order, the stop token included; `state`
    the engine request in flight (engine_client.RequestState: rank, outputs not yet
    taken, finish). `index` is OpenAI's choice index. Invariant: nothing else about
    the engine request lives outside this object, so it can be sent again as a
    continuation (prompt_ids + output_ids, max_tokens less len(output_ids)) on a
    fresh state: that is where request migration hooks in.
    """

    __slots__ = ("index", "prompt_ids", "params", "output_ids", "state")

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int = 0,
                 state_type: type[RequestState] = RequestState) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.state = state_type(request_id, len(prompt_ids), params.max_tokens)

    def add_request(self) -> AddRequest:
        """The message that starts this request on a rank."""
        return AddRequest(self.state.request_id, self.prompt_ids, self.params, time.time())


@dataclass(slots=True, frozen=True)
class TextOptions:
    """How outputs become text: stop strings, whether the stop (string or token) shows,
    whether special tokens are skipped, whether logprob positions come along."""

    stops: Sequence[str] = ()
    include_stop: bool = False
    skip_special: bool = True
    logprobs: bool = False


PLAIN_TEXT = TextOptions()


@dataclass(slots=True)
class Piece:
    """Text that became final, the logprob positions it covers, and the finish if it ended.

    A position is a protocol TokenLogprobs, or an int for an echoed prompt's first
    token (which has no logprob)."""

    text: str
    positions: Sequence = ()
    finish: str | None = None


def take_outputs(gen: Generation, eos_ids: frozenset[int], include_stop: bool = False) -> tuple[list[int], str | None]:
    """The ids that arrived (recorded in gen.output_ids) and the finish reason, if any.

    The token that stopped the request (a stop token id, or an EOS) is counted in
    usage but not shown, unless include_stop. Raises EngineFailure.
    """
    state = gen.state
    ids = state.take()
    gen.output_ids += ids
    finished = state.finish_reason
    if finished is None:
        return ids, None
    if finished == FINISH_ERROR:
        raise EngineFailure(state.error_status, state.error or "engine error")
    if finished == FINISH_STOP and ids and not include_stop:
        last, stop_id = ids[-1], state.stop_token_id
        if last == stop_id or (stop_id is None and last in eos_ids):
            ids = ids[:-1]
    return ids, finished


async def text_pieces(gen: Generation, tokenizer: TextTokenizer, client: EngineClient,
                      opts: TextOptions = PLAIN_TEXT) -> AsyncIterator[Piece]:
    """The request's text as its outputs arrive, cut at the first stop string; the last
    piece carries the finish. The text continues the prompt's (see prompt_context).
    A stop string aborts the engine request. Raises EngineFailure."""
    state = gen.state
    detok = IncrementalDetokenizer(tokenizer, gen.prompt_ids, skip_special_tokens=opts.skip_special)
    stopper = StopChecker(opts.stops) if opts.stops else None
    eos = tokenizer.eos_token_ids
    positions: Sequence = ()
    while True:
        if not state.pending and not state.is_finished:
            await state.event.wait()
        ids, finished = take_outputs(gen, eos, opts.include_stop)
        if opts.logprobs:
            positions = state.take_logprobs()
        text = detok.step(ids) if ids else ""
        if finished:
            text += detok.flush()
        if stopper is not None:
            text, hit = stopper.feed(text)
            if hit:
                if opts.include_stop:
                    text += stopper.stop_reason
                client.abort(state)
                state.finish_reason = FINISH_STOP
                yield Piece(text, positions, FINISH_STOP)
                return
            if finished:
                text += stopper.flush()
        if finished:
            yield Piece(text, positions, finished)
            return
        if text or positions:
            yield Piece(text, positions)


async def whole_text(gen: Generation, tokenizer: TextTokenizer) -> tuple[str, str]:
    """(text, finish) of a whole answer without stop strings: wait for the end, decode once.

    The same text as text_pieces joined: the incremental detokenizer exists to
    reproduce exactly this one decode piece by piece, which a whole answer does not need.
    """
    state = gen.state
    eos = tokenizer.eos_token_ids
    ids: list[int] = []
    while True:
        if not state.pending and not state.is_finished:
            await state.event.wait()
        last, finished = take_outputs(gen, eos)
        ids += last
        if finished:
            return (decode_continuation(tokenizer, gen.prompt_ids, ids) if ids else ""), finished


async def join_pieces(pieces: AsyncIterator[Piece]) -> tuple[str, list, str]:
    """(text, positions, finish) of a whole answer read piece by piece."""
    parts: list[str] = []
    positions: list = []
    finish = FINISH_STOP
    async for piece in pieces:
        parts.append(piece.text)
        positions.extend(piece.positions)
        finish = piece.finish or finish
    return "".join(parts), positions, finish
