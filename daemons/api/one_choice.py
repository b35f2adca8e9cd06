"""Responses of a request with one choice and none of the extras (nearly all requests).

The fast path: events from prebuilt byte templates, and a whole answer without
stop strings decoded once at its end. A request that sets any extra (see
request_checks.uses_extras) must never come here; it goes to many_choices.py.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web
from dpserve.daemons.aiohttp_compat import EventStream
from dpserve.daemons.api.generation import (
    PLAIN_TEXT,
    EngineFailure,
    Generation,
    TextOptions,
    join_pieces,
    text_pieces,
    whole_text,
)
from dpserve.daemons.api.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    Usage,
    encode,
)
from dpserve.daemons.api.request_checks import stop_strings
from dpserve.daemons.api.serving import DONE, ServingBase, failure_event

_json_str = msgspec.json.encode


def _usage(gen: Generation) -> Usage:
    state = gen.state
    num_prompt = len(gen.prompt_ids)
    return Usage(num_prompt, state.num_output_tokens, num_prompt + state.num_output_tokens, PromptTokensDetails(state.num_cached_tokens))


class OneChoiceServing(ServingBase):
    async def generate_one(self, request: web.Request, req, ids: list[int], max_tokens: int, *, chat: bool,
                           t0: float) -> web.StreamResponse:
        """Send one engine request for `req` and answer it, whole or streamed."""
        params = self.sampling(req, len(ids), max_tokens)
        stops = stop_strings(req)
        text = TextOptions(stops) if stops else PLAIN_TEXT
        pinned = self.pinned_rank(request)
        gen = Generation(self.new_request_id(), ids, params)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            respond = lambda: self._stream_one(request, gen, text, chat, include_usage)  # noqa: E731
        else:
            respond = lambda: self._whole_one(gen, text, chat)  # noqa: E731
        return await self.run("chat" if chat else "completions", t0, (gen,), pinned, respond, request.get("tenant"))

    async def _whole_one(self, gen: Generation, text: TextOptions, chat: bool) -> web.Response:
        if text.stops:
            answer, _, reason = await join_pieces(text_pieces(gen, self.tokenizer, self.client, text))
        else:
            answer, reason = await whole_text(gen, self.tokenizer)
        rid = gen.state.request_id
        if chat:
            body = ChatCompletionResponse(f"chatcmpl-{rid}", int(time.time()), self.model_name,
                                          [ChatChoice(0, AssistantMessage(answer), None, reason)], usage=_usage(gen),
                                          prompt_logprobs=None, prompt_token_ids=None)
        else:
            body = CompletionResponse(f"cmpl-{rid}", int(time.time()), self.model_name,
                                      [CompletionChoice(0, answer, None, reason)], usage=_usage(gen))
        return self.finish_response(web.Response(body=encode(body), headers=self.json_headers[gen.state.rank]))

    async def _stream_one(self, request: web.Request, gen: Generation, text: TextOptions, chat: bool,
                          include_usage: bool) -> web.StreamResponse:
        created = int(time.time())
        rid = f"chatcmpl-{gen.state.request_id}" if chat else f"cmpl-{gen.state.request_id}"
        head = encode({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created, "model": self.model_name})[:-1]
        if chat:
            prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            suffix_open = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            prefix = b"data: " + head + b',"choices":[{"index":0,"text":'
            suffix_open = b',"logprobs":null,"finish_reason":null}]}\n\n'
        resp = self.finish_response(EventStream(status=200, headers=self.sse_headers[gen.state.rank]))
        await resp.prepare(request)
        if chat:
            first = ChatCompletionChunk(rid, created, self.model_name, [ChatChunkChoice(0, Delta(role="assistant", content=""), None, None)])
            await resp.write(b"data: " + encode(first) + b"\n\n")
        # The last event, the usage chunk, [DONE] and the end of the chunked body
        # leave in one write: nothing is awaited between them anyway.
        tail = b""
        try:
            async for piece in text_pieces(gen, self.tokenizer, self.client, text):
                fin = piece.finish
                if fin is None:
                    await resp.write(prefix + _json_str(piece.text) + suffix_open)
                    continue
                if chat:
                    last = ChatCompletionChunk(rid, created, self.model_name, [ChatChunkChoice(0, Delta(content=piece.text or None), None, fin)])
                else:
                    last = CompletionResponse(rid, created, self.model_name, [CompletionChoice(0, piece.text, None, fin)])
                tail = b"data: " + encode(last) + b"\n\n"
        except EngineFailure as exc:
            await resp.write_eof(failure_event(exc))
            self.metrics.observe("stream", exc.status)
            return resp
        if include_usage:
            tail_type = ChatCompletionChunk if chat else CompletionResponse
            tail += b"data: " + encode(tail_type(rid, created, self.model_name, [], usage=_usage(gen))) + b"\n\n"
        await resp.write_eof(tail + DONE)
        return resp
