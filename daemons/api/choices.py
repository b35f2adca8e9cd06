"""Requests that use issue 14's parameters: n, batched prompts, logprobs, echo, structured output,
prompt_logprobs, penalties / min_p / logit_bias, include_stop_str_in_output and
skip_special_tokens.

Each choice (prompt i, sample j; OpenAI's index i x n + j) is its own engine
request, routed like any other: the n samples of a prompt do not share its
prefill (the engine has no prefix cache to share it through). With a seed,
choice j samples with seed + j (vLLM's rule), so each is reproducible alone.
This path lives apart from serving.py so that a plain request pays only for
the scan that sends it here (openai_types.uses_extras); it must never be
entered by one.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from aiohttp import web
from dpserve.daemons.api.detokenizer import IncrementalDetokenizer, StopChecker
from dpserve.daemons.api.engine_client import RequestState
from dpserve.daemons.api.guided import guided_grammar
from dpserve.daemons.api.openai_types import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    chat_messages,
    completion_prompts,
    encode,
    stop_strings,
)
from dpserve.engine.common.protocol import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AddRequest,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)

_DONE = b"data: [DONE]\n\n"
_INT64 = 2**64


class ChoiceState(RequestState):
    """A RequestState that also keeps the logprobs the engine sends."""

    __slots__ = ("logprobs", "prompt_logprobs", "num_outputs")

    def __init__(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(request_id, prompt_tokens, max_tokens)
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.num_outputs = 0

    def _push(self, out: RequestOutput) -> None:
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_outputs += 1
        super()._push(out)

    def take_logprobs(self) -> list[TokenLogprobs]:
        got, self.logprobs = self.logprobs, []
        return got


@dataclass(slots=True)
class _Choice:
    index: int
    prompt_ids: list[int]
    state: ChoiceState
    params: SamplingParams
    echo_text: str | None = None  # the prompt's text, when echoed
    score_only: bool = False  # max_tokens 0 with echo: the engine's one token is dropped


@dataclass(slots=True)
class _Piece:
    """Text of one choice that became final, the positions it scored, and the finish.

    A position is an int for the first prompt token (echo: it has no logprob)."""

    text: str
    positions: list[TokenLogprobs | int] = field(default_factory=list)
    finish: str | None = None


@dataclass(slots=True)
class _Options:
    chat: bool
    stops: list[str]
    include_stop: bool
    skip_special: bool
    num_top: int | None  # completions: logprobs; chat: top_logprobs (None: no logprobs)
    prompt_logprobs: int | None  # vLLM's extra, reported as such
    echo: bool


class _EngineFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_TOKEN_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_texts(tokenizer) -> dict[int, str]:
    texts = _TOKEN_TEXT.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXT[tokenizer] = {}
    return texts


def _token_text(tokenizer, texts: dict[int, str], token_id: int) -> str:
    """A token as vLLM renders it in logprobs: that one token decoded, specials shown."""
    text = texts.get(token_id)
    if text is None:
        text = texts[token_id] = tokenizer._tok.decode([token_id], skip_special_tokens=False)
    return text


def _seed(seed: int | None, j: int) -> int | None:
    if seed is None or j == 0:
        return seed
    wrapped = (seed + j) % _INT64
    return wrapped - _INT64 if wrapped >= 2**63 else wrapped


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab_size}); got {key[:20]!r}.", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


class ChoicesServing:
    """The issue-14 path of one OpenAIServing: builds the choices, runs them, answers."""

    def __init__(self, serving) -> None:
        self.s = serving

    # ------------------------------------------------------------ endpoints

    async def completions(self, request: web.Request, req: CompletionRequest, t0: float) -> web.StreamResponse:
        s = self.s
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens 0 is only accepted with echo (to score the prompt).", param="max_tokens")
        prompts = completion_prompts(req)
        ids_list: list[list[int]] = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids_list.append(await s._tokenize(request, s._prompt_ids, prompt))
            else:
                if min(prompt) < 0 or max(prompt) >= s.vocab_size:
                    raise ApiError(400, f"Token ids must be in [0, {s.vocab_size}).", param="prompt")
                ids_list.append(prompt)
        opts = _Options(
            chat=False,
            stops=stop_strings(req),
            include_stop=bool(req.include_stop_str_in_output),
            skip_special=req.skip_special_tokens is not False,
            num_top=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            echo=bool(req.echo),
        )
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        engine_prompt_logprobs = req.prompt_logprobs
        if opts.echo and req.logprobs is not None:
            engine_prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
        choices = []
        n = req.n or 1
        grammar = guided_grammar(req)
        for i, ids in enumerate(ids_list):
            echo_text = self._decode(ids, opts.skip_special) if opts.echo else None
            for j in range(n):
                choices.append(self._choice(req, i * n + j, ids, max_tokens, j, req.logprobs, engine_prompt_logprobs, echo_text, grammar))
        return await self._run(request, req, choices, opts, sum(len(ids) for ids in ids_list), t0)

    async def chat_completions(self, request: web.Request, req: ChatCompletionRequest, t0: float) -> web.StreamResponse:
        s = self.s
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        messages = chat_messages(req)
        ids = await s._tokenize(request, s._chat_ids, messages, req.add_generation_prompt)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(s.max_model_len - len(ids), 1)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        opts = _Options(
            chat=True,
            stops=stop_strings(req),
            include_stop=bool(req.include_stop_str_in_output),
            skip_special=req.skip_special_tokens is not False,
            num_top=num_top,
            prompt_logprobs=req.prompt_logprobs,
            echo=False,
        )
        grammar = guided_grammar(req)
        choices = [self._choice(req, j, ids, max_tokens, j, num_top, req.prompt_logprobs, None, grammar) for j in range(req.n or 1)]
        return await self._run(request, req, choices, opts, len(ids), t0)

    # ------------------------------------------------------------ building

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.s.tokenizer._tok.decode(ids, skip_special_tokens=skip_special)

    def _choice(self, req, index: int, ids: list[int], max_tokens: int, j: int, logprobs: int | None,
                prompt_logprobs: int | None, echo_text: str | None, grammar: str | None) -> _Choice:
        s = self.s
        score_only = max_tokens == 0
        engine_max = 1 if score_only else max_tokens  # vLLM's way: one token, dropped
        base = s._sampling(req, len(ids), engine_max)
        params = msgspec.structs.replace(
            base,
            seed=_seed(base.seed, j),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0,
            logit_bias=_logit_bias(req.logit_bias, s.vocab_size),
            logprobs=None if score_only else logprobs,
            prompt_logprobs=prompt_logprobs,
            guided_grammar=grammar,
        )
        rid = f"{s._id_prefix}-{next(s._ids):x}"
        return _Choice(index, ids, ChoiceState(rid, len(ids), engine_max), params, echo_text, score_only)

    # ------------------------------------------------------------ running

    async def _run(self, request, req, choices: list[_Choice], opts: _Options, num_prompt: int, t0: float) -> web.StreamResponse:
        s = self.s
        endpoint = "chat" if opts.chat else "completions"
        pinned = _pinned(s, request)
        started: list[_Choice] = []
        s.request_began()
        try:
            for choice in choices:
                add = AddRequest(choice.state.request_id, choice.prompt_ids, choice.params, time.time())
                rank = await s._send(choice.state, add, pinned)
                s.metrics.routed_to(rank)
                started.append(choice)
            if req.stream:
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                resp = await self._stream(request, choices, opts, num_prompt, include_usage)
            else:
                resp = await self._complete(choices, opts, num_prompt)
            s.metrics.observe(endpoint, resp.status, time.perf_counter() - t0)
            return resp
        except _EngineFailure as exc:
            s.metrics.observe(endpoint, exc.status)
            kind, code = _failure_kind(exc.status)
            raise ApiError(exc.status, str(exc), type=kind, code=code) from None
        finally:
            s.request_ended()
            for choice in started:
                if not choice.state.is_finished:
                    s.client.abort(choice.state)

    async def _pieces(self, choice: _Choice, opts: _Options) -> AsyncIterator[_Piece]:
        """A choice's pieces as its outputs arrive: echo first, the finish last; raises _EngineFailure."""
        state = choice.state
        tok = self.s.tokenizer
        if choice.echo_text is not None:
            positions: list[TokenLogprobs | int] = []
            if opts.num_top is not None:
                await self._wait_first(state)
                positions = [choice.prompt_ids[0], *(state.prompt_logprobs or ())]
            yield _Piece(choice.echo_text, positions)
        if choice.score_only:
            while not state.is_finished:
                await self._wait_first(state)
                if state.finish_reason == FINISH_ERROR:
                    break
                if state.num_outputs:
                    self.s.client.abort(state)
                    state.finish_reason = FINISH_LENGTH
            _check_error(state)
            yield _Piece("", [], FINISH_LENGTH)
            return
        detok = IncrementalDetokenizer(tok, choice.prompt_ids, skip_special_tokens=opts.skip_special)
        stopper = StopChecker(opts.stops) if opts.stops else None
        eos = tok.eos_token_ids
        while True:
            if not state.pending and not state.is_finished:
                await state.event.wait()
            ids = state.take()
            positions = state.take_logprobs() if opts.num_top is not None else []
            finished = state.finish_reason
            _check_error(state)
            if finished == FINISH_STOP and ids and not opts.include_stop:
                last = ids[-1]
                if last == state.stop_token_id or (state.stop_token_id is None and last in eos):
                    ids = ids[:-1]  # the token that stopped it is not shown (vLLM: unless include_stop_str_in_output)
            text = detok.step(ids) if ids else ""
            if finished:
                text += detok.flush()
            if stopper is not None:
                text, hit = stopper.feed(text)
                if hit:
                    if opts.include_stop:
                        text += stopper.stop_reason
                    self.s.client.abort(state)
                    state.finish_reason = FINISH_STOP
                    yield _Piece(text, positions, FINISH_STOP)
                    return
                if finished:
                    text += stopper.flush()
            if finished:
                yield _Piece(text, positions, finished)
                return
            if text or positions:
                yield _Piece(text, positions)

    @staticmethod
    async def _wait_first(state: ChoiceState) -> None:
        while not state.num_outputs and not state.is_finished:
            state.event.clear()
            await state.event.wait()

    # ------------------------------------------------------------ rendering

    def _logprobs(self, positions: list[TokenLogprobs | int], opts: _Options, offset: int) -> tuple[dict | None, int]:
        """The choice's logprobs object for these positions, and the text offset after them."""
        if opts.num_top is None:
            return None, offset
        tok = self.s.tokenizer
        texts = _token_texts(tok)
        if opts.chat:
            content = []
            for pos in positions:
                if isinstance(pos, int):
                    continue
                token = _token_text(tok, texts, pos.token_id)
                tops = [
                    {"token": (t := _token_text(tok, texts, i)), "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}
                    for i, lp in zip(pos.top_ids[: opts.num_top], pos.top_logprobs)
                ]
                content.append({"token": token, "logprob": pos.logprob, "bytes": list(token.encode("utf-8", "replace")), "top_logprobs": tops})
            return {"content": content, "refusal": None}, offset
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for pos in positions:
            token_id = pos if isinstance(pos, int) else pos.token_id
            token = _token_text(tok, texts, token_id)
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
            if isinstance(pos, int):
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(pos.logprob)
            # vLLM's dict: the top alternatives, and the chosen token (even outside them).
            tops = {_token_text(tok, texts, i): lp for i, lp in zip(pos.top_ids[: opts.num_top], pos.top_logprobs)}
            tops.setdefault(token, pos.logprob)
            top_logprobs.append(tops)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}, offset

    def _prompt_logprobs(self, choice: _Choice) -> list | None:
        """vLLM's prompt_logprobs: null for the first token, then {id: {logprob, rank, decoded_token}}."""
        tok = self.s.tokenizer
        texts = _token_texts(tok)
        out: list = [None]
        for pos in choice.state.prompt_logprobs or ():
            entry = {str(pos.token_id): {"logprob": pos.logprob, "rank": pos.rank, "decoded_token": _token_text(tok, texts, pos.token_id)}}
            for rank, (i, lp) in enumerate(zip(pos.top_ids, pos.top_logprobs), start=1):
                entry.setdefault(str(i), {"logprob": lp, "rank": rank, "decoded_token": _token_text(tok, texts, i)})
            out.append(entry)
        return out

    def _usage(self, choices: list[_Choice], num_prompt: int) -> dict:
        completion = sum(0 if c.score_only else c.state.num_output_tokens for c in choices)
        # Counted once per prompt, like prompt_tokens: its first choice's (the n choices
        # of one prompt share its ids list; vLLM reports the first output's too).
        firsts = {id(c.prompt_ids): c for c in reversed(choices)}.values()
        cached = sum(c.state.num_cached_tokens for c in firsts)
        return {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _headers(self, choices: list[_Choice], stream: bool) -> dict:
        s = self.s
        rank = choices[0].state.rank
        return (s._sse_headers if stream else s._json_headers)[rank]

    async def _complete(self, choices: list[_Choice], opts: _Options, num_prompt: int) -> web.Response:
        async def collect(choice: _Choice) -> tuple[str, list, str]:
            parts, positions, finish = [], [], FINISH_STOP
            async for piece in self._pieces(choice, opts):
                parts.append(piece.text)
                positions.extend(piece.positions)
                finish = piece.finish or finish
            return "".join(parts), positions, finish

        tasks = [asyncio.ensure_future(collect(c)) for c in choices]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one choice failed (or the client left): the others stop waiting too
                task.cancel()
        s = self.s
        created = int(time.time())
        rid = choices[0].state.request_id
        out = []
        for choice, (text, positions, finish) in zip(choices, results):
            logprobs, _ = self._logprobs(positions, opts, 0)
            if opts.chat:
                item = {"index": choice.index, "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": logprobs, "finish_reason": finish}
            else:
                item = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
                if opts.prompt_logprobs is not None:
                    item["prompt_logprobs"] = self._prompt_logprobs(choice)
            out.append(item)
        body = {"id": f"{'chatcmpl' if opts.chat else 'cmpl'}-{rid}", "object": "chat.completion" if opts.chat else "text_completion",
                "created": created, "model": s.model_name, "choices": out, "usage": self._usage(choices, num_prompt)}
        if opts.chat and opts.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(choices[0])  # vLLM: top level for chat
        resp = web.Response(body=encode(body), headers=self._headers(choices, False))
        if s.draining:
            resp.force_close()
        return resp

    async def _stream(self, request, choices: list[_Choice], opts: _Options, num_prompt: int, include_usage: bool) -> web.StreamResponse:
        """Every choice's pieces as they come, one chunk per piece, each naming its choice's index."""
        s = self.s
        created = int(time.time())
        rid = f"{'chatcmpl' if opts.chat else 'cmpl'}-{choices[0].state.request_id}"
        kind = "chat.completion.chunk" if opts.chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for piece in self._pieces(choice, opts):
                    queue.put_nowait((choice, piece))
            except _EngineFailure as exc:
                queue.put_nowait((choice, exc))

        def chunk(items: list[dict], usage: dict | None = None) -> bytes:
            body = {"id": rid, "object": kind, "created": created, "model": s.model_name, "choices": items}
            if usage is not None:
                body["usage"] = usage
            return b"data: " + encode(body) + b"\n\n"

        resp = _EventStream(status=200, headers=self._headers(choices, True))
        if s.draining:
            resp.force_close()
        await resp.prepare(request)
        if opts.chat:
            await resp.write(b"".join(
                chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                for c in choices))
        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        offsets = {c.index: 0 for c in choices}
        try:
            remaining = len(choices)
            while remaining:
                choice, piece = await queue.get()
                if isinstance(piece, _EngineFailure):
                    kind_, code = _failure_kind(piece.status)
                    err = ErrorResponse(ErrorBody(str(piece), kind_, None, code or "engine_error"))
                    await resp.write_eof(b"data: " + encode(err) + b"\n\n" + _DONE)
                    s.metrics.observe("stream", piece.status)
                    return resp
                logprobs, offsets[choice.index] = self._logprobs(piece.positions, opts, offsets[choice.index])
                if opts.chat:
                    delta = {"content": piece.text} if piece.text or piece.finish is None else {}
                    item = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish}
                else:
                    item = {"index": choice.index, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish}
                    if opts.prompt_logprobs is not None and piece.finish is not None:
                        item["prompt_logprobs"] = self._prompt_logprobs(choice)
                await resp.write(chunk([item]))
                if piece.finish is not None:
                    remaining -= 1
        finally:
            for task in tasks:
                task.cancel()
        tail = chunk([], self._usage(choices, num_prompt)) if include_usage else b""
        await resp.write_eof(tail + _DONE)
        return resp


def _check_error(state: RequestState) -> None:
    if state.finish_reason == FINISH_ERROR:
        raise _EngineFailure(state.error_status, state.error or "engine error")


def _failure_kind(status: int) -> tuple[str, str | None]:
    if status == 503:
        return "service_unavailable", "engine_error"
    if status == 504:
        return "server_error", "first_token_timeout"
    return "invalid_request_error", None


class _EventStream(web.StreamResponse):
    _send_headers_immediately = False


def _pinned(serving, request) -> int | None:
    """The pin header, parsed and checked with the plain path's own helpers."""
    from dpserve.daemons import serving as plain  # (imported late: serving.py imports this module)

    pinned = plain.parse_rank_header(request.headers.get(plain._RANK_HEADER), serving.router.size)
    if pinned is not None:
        try:
            serving.router.check_pin(pinned)
        except ApiError:
            raise
        except Exception as exc:  # a routing error the plain path turns into its HTTP answer
            convert = getattr(plain, "routing_error", None)
            if convert is None:
                raise
            raise convert(exc) from None
    return pinned
