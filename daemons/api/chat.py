"""POST /v1/chat/completions: messages, through the model's chat template, to choices.

Decodes and checks the request, renders and tokenizes the conversation, and hands
the engine requests to the one-choice fast path or, when the request uses an
extra, to many_choices.
"""

from __future__ import annotations

import time

from aiohttp import web
from dpserve.daemons.api.guided import guided_grammar
from dpserve.daemons.api.many_choices import ChoiceOptions, ManyChoicesServing, text_options
from dpserve.daemons.api.one_choice import OneChoiceServing
from dpserve.daemons.api.openai_types import ApiError, ChatCompletionRequest
from dpserve.daemons.api.request_checks import chat_messages, uses_extras


class ChatServing(OneChoiceServing, ManyChoicesServing):
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        req = await self.read_request(request, ChatCompletionRequest)
        extras = uses_extras(req)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        ids = await self.tokenize(request, self.chat_ids, chat_messages(req), req.add_generation_prompt)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(self.max_model_len - len(ids), 1)
        if not extras:
            return await self.generate_one(request, req, ids, max_tokens, chat=True, t0=t0)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        opts = ChoiceOptions(True, text_options(req, num_top is not None), num_top, req.prompt_logprobs)
        grammar = await guided_grammar(req, self.cfg, req.n or 1)
        choices = [self.new_choice(req, j, ids, max_tokens, j, num_top, req.prompt_logprobs, None, grammar) for j in range(req.n or 1)]
        return await self.generate_many(request, req, choices, opts, len(ids), t0)
