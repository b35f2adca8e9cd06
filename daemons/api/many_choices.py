"""Responses of requests that use the extras: n, batched prompts, logprobs, echo,
structured output, prompt_logprobs, penalties / min_p / logit_bias,
include_stop_str_in_output and skip_special_tokens.

Each choice (prompt i, sample j; OpenAI's index i x n + j) is its own engine
request, routed like any other; a native rank computes a prompt its n samples
share once (its scheduler holds the copies until the prompt's blocks are
cached), and only a prompt's first choice asks for its prompt logprobs. Before
any of that, the response-size budget (--max-response-bytes) refuses a request
whose response could be too large. With a seed, choice j samples with seed + j (vLLM's rule), so each is
reproducible alone. A plain request never comes here (see one_choice.py): it
pays only for the scan that would send it here (request_checks.uses_extras).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import msgspec
from aiohttp import web
from dpserve.daemons.aiohttp_compat import EventStream
from dpserve.daemons.api.generation import EngineFailure, Generation, Piece, TextOptions, join_pieces, text_pieces
from dpserve.daemons.api.logprobs import (
    Echoed,
    ScoredRequestState,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from dpserve.daemons.api.openai_types import encode
from dpserve.daemons.api.request_checks import check_response_bytes, logit_bias_pairs, response_bytes, stop_strings
from dpserve.daemons.api.serving import DONE, ServingBase, failure_event
from dpserve.daemons.api.tools.answer import ChatAnswer
from dpserve.engine.common.protocol import FINISH_ERROR, FINISH_LENGTH

_INT64 = 2**64
# Within one request: a choice's request id -> the state of its prompt's first choice,
# whose rank it is sent to (see ManyChoicesServing.send).
_FOLLOWS: ContextVar[dict[str, ScoredRequestState] | None] = ContextVar("follows", default=None)


@dataclass(slots=True)
class Choice:
    gen: Generation  # its state is a ScoredRequestState
    echo_text: str | None = None  # the prompt's text, when echoed
    score_only: bool = False  # max_tokens 0 with echo: the engine's one token is dropped
    echo_specials: bool = False  # the echoed prompt's logprob tokens show special tokens' text (a token-id prompt)
    # The choice whose engine request computes this prompt's logprobs (the first of its
    # prompt's choices); None: this one does. Its siblings share them instead of each
    # computing the whole prompt again (prompt logprobs bypass the prefix cache).
    prompt_from: ScoredRequestState | None = None

    @property
    def prompt_state(self) -> ScoredRequestState:
        return self.prompt_from or self.gen.state


@dataclass(slots=True)
class ChoiceOptions:
    chat: bool
    text: TextOptions
    num_top: int | None  # completions: logprobs; chat: top_logprobs (None: no logprobs)
    prompt_logprobs: int | None  # vLLM's extra, reported as such
    echo: bool = False
    token_ids: bool = False  # vLLM's return_token_ids: prompt_token_ids and token_ids in the answer
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:N"
    usage_every_chunk: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    answer: Callable[[], ChatAnswer] | None = None  # chat: each choice's reasoning / tool-call reader

    def texts(self, tokenizer) -> TokenTexts:
        return TokenTexts(tokenizer, self.text.skip_special, self.tokens_as_ids)


def choice_options(chat: bool, req, num_top: int | None, prompt_logprobs: int | None, echo: bool = False,
                   tokens_as_ids: bool = False) -> ChoiceOptions:
    """The options a request's extras set (both endpoints); `tokens_as_ids` is
    --return-tokens-as-token-ids, for a request that does not say."""
    usage = req.stream_options is not None and bool(req.stream_options.include_usage and req.stream_options.continuous_usage_stats)
    return ChoiceOptions(chat, text_options(req, num_top is not None), num_top, prompt_logprobs, echo,
                         bool(req.return_token_ids), tokens_as_ids if req.return_tokens_as_token_ids is None else req.return_tokens_as_token_ids,
                         usage)


def text_options(req, logprobs: bool) -> TextOptions:
    """The text rules the extras can change."""
    return TextOptions(stop_strings(req), bool(req.include_stop_str_in_output), req.skip_special_tokens is not False, logprobs)


def choice_seed(seed: int | None, j: int) -> int | None:
    """Sample j's seed: seed + j, wrapped into int64 (vLLM's rule)."""
    if seed is None or j == 0:
        return seed
    wrapped = (seed + j) % _INT64
    return wrapped - _INT64 if wrapped >= 2**63 else wrapped


def share_prompt_logprobs(choices: list[Choice]) -> None:
    """Only the first choice of each prompt asks its engine for prompt logprobs; the
    others read that choice's, so n choices compute a prompt's logits once, and their
    engine requests can take the prompt from the prefix cache. (The choices of one
    prompt share its ids list.)"""
    first: dict[int, Choice] = {}
    for choice in choices:
        if choice.gen.params.prompt_logprobs is None:
            continue
        owner = first.setdefault(id(choice.gen.prompt_ids), choice)
        if owner is not choice:
            choice.prompt_from = owner.gen.state
            choice.gen.params = msgspec.structs.replace(choice.gen.params, prompt_logprobs=None)


def follow_the_first(choices: list[Choice]) -> dict[str, ScoredRequestState]:
    """Each choice's request id -> its prompt's first choice's state (not the first's own)."""
    first: dict[int, ScoredRequestState] = {}
    follows = {}
    for choice in choices:
        state = first.setdefault(id(choice.gen.prompt_ids), choice.gen.state)
        if state is not choice.gen.state:
            follows[choice.gen.state.request_id] = state
    return follows


class ManyChoicesServing(ServingBase):
    def new_choice(self, req, index: int, ids: list[int], max_tokens: int, j: int, logprobs: int | None,
                   prompt_logprobs: int | None, echo_text: str | None, grammar: str | None,
                   logprob_ids: tuple[int, ...] = ()) -> Choice:
        """Choice `index`, sample j of prompt `ids`, with every extra sampling parameter;
        `logprob_ids`: vLLM's logprob_token_ids (checked), reported in place of the top ones."""
        score_only = max_tokens == 0
        engine_max = 1 if score_only else max_tokens  # vLLM's way: one token, dropped
        base = self.sampling(req, len(ids), engine_max)
        defaults = self.defaults
        params = msgspec.structs.replace(
            base,
            seed=choice_seed(base.seed, j),
            presence_penalty=defaults.presence_penalty if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=defaults.frequency_penalty if req.frequency_penalty is None else req.frequency_penalty,
            repetition_penalty=defaults.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
            min_p=defaults.min_p if req.min_p is None else req.min_p,
            logit_bias=logit_bias_pairs(req.logit_bias, self.vocab_size),
            logprobs=None if score_only else (len(logprob_ids) if logprob_ids else logprobs),
            prompt_logprobs=prompt_logprobs,
            guided_grammar=grammar,
            logprob_token_ids=logprob_ids,
        )
        gen = Generation(self.new_request_id(), ids, params, index, ScoredRequestState)
        return Choice(gen, echo_text, score_only)

    async def generate_many(self, request: web.Request, req, choices: list[Choice], opts: ChoiceOptions,
                            num_prompt: int, t0: float) -> web.StreamResponse:
        self._check_response_size(choices, opts, bool(req.stream))
        share_prompt_logprobs(choices)
        pinned = self.pinned_rank(request)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            respond = lambda: self._stream_many(request, choices, opts, num_prompt, include_usage)  # noqa: E731
        else:
            respond = lambda: self._whole_many(choices, opts, num_prompt)  # noqa: E731
        follows = _FOLLOWS.set(follow_the_first(choices))
        try:
            return await self.run("chat" if opts.chat else "completions", t0, [c.gen for c in choices], pinned, respond,
                                  request.get("tenant"))
        finally:
            _FOLLOWS.reset(follows)

    async def send(self, gen: Generation, pinned: int | None) -> int:
        """A choice goes to the rank its prompt's first choice went to (as vLLM keeps a
        request's n samples in one engine), so that rank computes the prompt once."""
        first = (_FOLLOWS.get() or {}).get(gen.state.request_id)
        if pinned is None and first is not None and first.rank >= 0:
            pinned = first.rank
        return await super().send(gen, pinned)

    def _check_response_size(self, choices: list[Choice], opts: ChoiceOptions, stream: bool) -> None:
        """The response-size budget, before any engine work (a 400 naming the costliest parameter)."""
        cost: dict[str, int] = {}
        for i, choice in enumerate(choices):
            params = choice.gen.params
            rendered_prompt = params.prompt_logprobs if (i == 0 or not opts.chat) else None  # chat: once, at the top
            for name, size in response_bytes(
                chat=opts.chat, stream=stream, num_prompt=len(choice.gen.prompt_ids),
                num_generated=0 if choice.score_only else params.max_tokens, num_top=opts.num_top,
                prompt_logprobs=rendered_prompt if opts.prompt_logprobs is not None else None,
                echo=choice.echo_text is not None,
            ).items():
                cost[name] = cost.get(name, 0) + size
        check_response_bytes(cost, len(choices), self.cfg.max_response_bytes, opts.chat)

    async def _pieces(self, choice: Choice, opts: ChoiceOptions):
        """A choice's pieces as its outputs arrive: echo first, the finish last; raises EngineFailure."""
        gen = choice.gen
        state: ScoredRequestState = gen.state
        if choice.prompt_from is not None:  # the prompt logprobs it shows come with that choice's first output
            await choice.prompt_from.wait_first_output()
        if choice.echo_text is not None:
            positions: list = []
            if opts.num_top is not None and opts.echo:  # (chat echo shows no prompt logprobs)
                await state.wait_first_output()
                positions = [gen.prompt_ids[0], *(choice.prompt_state.prompt_logprobs or ())]
                if choice.echo_specials:
                    positions = [Echoed(pos) for pos in positions]
            yield Piece(choice.echo_text, positions)
        if not choice.score_only:
            async for piece in text_pieces(gen, self.tokenizer, self.client, opts.text):
                yield piece
            return
        while not state.is_finished:
            await state.wait_first_output()
            if state.finish_reason == FINISH_ERROR:
                break
            if state.num_outputs:
                self.client.abort(state)
                state.finish_reason = FINISH_LENGTH
        if state.finish_reason == FINISH_ERROR:
            raise EngineFailure(state.error_status, state.error or "engine error")
        yield Piece("", [], FINISH_LENGTH)

    # ------------------------------------------------------------ rendering

    def _logprobs(self, texts: TokenTexts, positions, opts: ChoiceOptions, offset: int) -> tuple[dict | None, int]:
        """The choice's logprobs object for these positions, and the text offset after them."""
        if opts.num_top is None:
            return None, offset
        if opts.chat:
            return chat_logprobs(texts, positions, opts.num_top), offset
        return completion_logprobs(texts, positions, opts.num_top, offset)

    def _reasoning_tokens(self, choices: list[Choice], answers: dict | None) -> int | None:
        """vLLM's usage.completion_tokens_details.reasoning_tokens, summed over the choices;
        None (no details) without a reasoning parser, as vLLM."""
        if answers is None or self.cfg.reasoning_parser is None:
            return None
        return sum(answers[c.gen.index].reasoning_tokens(c.gen.output_ids, self.tokenizer) for c in choices)

    @staticmethod
    def _usage(choices: list[Choice], num_prompt: int, reasoning: int | None = None) -> dict:
        completion = sum(0 if c.score_only else c.gen.state.num_output_tokens for c in choices)
        # Counted once per prompt, like prompt_tokens: its first choice's (the n choices
        # of one prompt share its ids list; vLLM reports the first output's too).
        firsts = {id(c.gen.prompt_ids): c for c in reversed(choices)}.values()
        cached = sum(c.gen.state.num_cached_tokens for c in firsts)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    async def _whole_many(self, choices: list[Choice], opts: ChoiceOptions, num_prompt: int) -> web.Response:
        tasks = [asyncio.ensure_future(join_pieces(self._pieces(c, opts))) for c in choices]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one choice failed (or the client left): the others stop waiting too
                task.cancel()
        texts = opts.texts(self.tokenizer)
        answers = {c.gen.index: opts.answer() for c in choices} if opts.answer is not None else None
        out = []
        for choice, (text, positions, finish) in zip(choices, results):
            logprobs, _ = self._logprobs(texts, positions, opts, 0)
            index = choice.gen.index
            token_ids = (choice.gen.output_ids if not choice.score_only else []) if opts.token_ids else None
            if opts.chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                if answers is not None:
                    answer = answers[index]
                    message.update(answer.message(text))
                    finish = answer.finish_reason(finish)
                item = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish, "token_ids": token_ids}
            else:
                item = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "token_ids": token_ids,
                        "prompt_logprobs": None, "prompt_token_ids": choice.gen.prompt_ids if opts.token_ids else None}
                if opts.prompt_logprobs is not None:
                    item["prompt_logprobs"] = prompt_logprobs(texts, choice.prompt_state.prompt_logprobs)
            out.append(item)
        first = choices[0].gen.state
        body = {"id": f"{'chatcmpl' if opts.chat else 'cmpl'}-{first.request_id}", "object": "chat.completion" if opts.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": out,
                "usage": self._usage(choices, num_prompt, self._reasoning_tokens(choices, answers))}
        if opts.chat:  # vLLM: top level for chat, always sent
            body["prompt_logprobs"] = prompt_logprobs(texts, first.prompt_logprobs) if opts.prompt_logprobs is not None else None
            body["prompt_token_ids"] = choices[0].gen.prompt_ids if opts.token_ids else None
        return self.finish_response(web.Response(body=encode(body), headers=self.json_headers[first.rank]))

    async def _stream_many(self, request, choices: list[Choice], opts: ChoiceOptions, num_prompt: int,
                           include_usage: bool) -> web.StreamResponse:
        """Every choice's pieces as they come, one chunk per piece, each naming its choice's index."""
        created = int(time.time())
        first = choices[0].gen.state
        rid = f"{'chatcmpl' if opts.chat else 'cmpl'}-{first.request_id}"
        kind = "chat.completion.chunk" if opts.chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for piece in self._pieces(choice, opts):
                    queue.put_nowait((choice, piece))
            except EngineFailure as exc:
                queue.put_nowait((choice, exc))

        def chunk(items: list[dict], usage: dict | None = None, prompt_ids: list[int] | None = None) -> bytes:
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": items}
            if usage is not None:
                body["usage"] = usage
            if prompt_ids is not None:  # vLLM's return_token_ids: a chat stream's first chunk
                body["prompt_token_ids"] = prompt_ids
            return b"data: " + encode(body) + b"\n\n"

        resp = self.finish_response(EventStream(status=200, headers=self.sse_headers[first.rank]))
        await resp.prepare(request)
        answers = {c.gen.index: opts.answer() for c in choices} if opts.answer is not None else None
        usage = lambda: self._usage(choices, num_prompt, self._reasoning_tokens(choices, answers))  # noqa: E731
        if opts.chat:
            await resp.write(b"".join(
                chunk([{"index": c.gen.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                      usage() if opts.usage_every_chunk else None, c.gen.prompt_ids if opts.token_ids else None)
                for c in choices))
        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            if not await self._pump_events(resp, queue, choices, opts, chunk, usage, answers):
                return resp
        finally:
            for task in tasks:
                task.cancel()
        tail = chunk([], usage()) if include_usage else b""
        await resp.write_eof(tail + DONE)
        return resp

    async def _pump_events(self, resp: web.StreamResponse, queue: asyncio.Queue, choices: list[Choice],
                           opts: ChoiceOptions, chunk, usage, answers: dict | None) -> bool:
        """Write each choice's pieces as they come until all finished (True) or one failed
        (False: the failure event ended the stream). `usage()`: the usage so far."""
        texts = opts.texts(self.tokenizer)
        offsets = {c.gen.index: 0 for c in choices}
        shown = dict.fromkeys(offsets, -1) if opts.token_ids else None  # output ids each choice's chunks showed (-1: no chunk yet)
        remaining = len(choices)
        while remaining:
            choice, piece = await queue.get()
            if isinstance(piece, EngineFailure):
                await resp.write_eof(failure_event(piece))
                self.metrics.observe("stream", piece.status)
                return False
            index = choice.gen.index
            logprobs, offsets[index] = self._logprobs(texts, piece.positions, opts, offsets[index])
            if opts.chat and answers:
                delta = answers[index].feed(piece.text, piece.finish is not None)
                finish = answers[index].finish_reason(piece.finish) if piece.finish is not None else None
                if not delta and finish is None and logprobs is None:
                    continue  # text held back (it may be a tag): nothing to send yet
                item = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            elif opts.chat:
                delta = {"content": piece.text} if piece.text or piece.finish is None else {}
                item = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish}
            else:
                item = {"index": index, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish}
                if opts.prompt_logprobs is not None and piece.finish is not None:
                    item["prompt_logprobs"] = prompt_logprobs(texts, choice.prompt_state.prompt_logprobs)
            if shown is not None:  # vLLM's return_token_ids: each chunk's new ids; a completion's first chunk its prompt's
                if shown[index] < 0 and not opts.chat:
                    item["prompt_token_ids"] = choice.gen.prompt_ids
                item["token_ids"] = choice.gen.output_ids[max(shown[index], 0):]
                shown[index] = len(choice.gen.output_ids)
            await resp.write(chunk([item], usage() if opts.usage_every_chunk else None))
            if piece.finish is not None:
                remaining -= 1
        return True
