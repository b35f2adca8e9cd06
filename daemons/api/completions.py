"""POST /v1/completions: a prompt (text or token ids, or a batch of them) to choices.

Decodes and checks the request, tokenizes, and hands the engine requests to the
one-choice fast path or, when the request uses an extra, to many_choices.
"""

from __future__ import annotations

import time

from aiohttp import web
from dpserve.daemons.api.guided import guided_grammar
from dpserve.daemons.api.many_choices import ChoiceOptions, ManyChoicesServing, text_options
from dpserve.daemons.api.one_choice import OneChoiceServing
from dpserve.daemons.api.openai_types import ApiError, CompletionRequest
from dpserve.daemons.api.request_checks import completion_prompt, completion_prompts, uses_extras


class CompletionsServing(OneChoiceServing, ManyChoicesServing):
    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        req = await self.read_request(request, CompletionRequest)
        if uses_extras(req):
            return await self._completions_with_extras(request, req, t0)
        prompt = completion_prompt(req)
        if isinstance(prompt, str):
            ids = await self.tokenize(request, self.prompt_ids, prompt)
        else:
            ids = self.check_token_ids(prompt)
        return await self.generate_one(request, req, ids, req.max_tokens or 16, chat=False, t0=t0)

    async def _completions_with_extras(self, request: web.Request, req: CompletionRequest, t0: float) -> web.StreamResponse:
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens 0 is only accepted with echo (to score the prompt).", param="max_tokens")
        ids_list: list[list[int]] = []
        for prompt in completion_prompts(req):
            if isinstance(prompt, str):
                ids_list.append(await self.tokenize(request, self.prompt_ids, prompt))
            else:
                ids_list.append(self.check_token_ids(prompt))
        text = text_options(req, req.logprobs is not None)
        opts = ChoiceOptions(False, text, req.logprobs, req.prompt_logprobs, echo=bool(req.echo))
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        engine_prompt_logprobs = req.prompt_logprobs
        if opts.echo and req.logprobs is not None:
            engine_prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
        choices = []
        n = req.n or 1
        grammar = await guided_grammar(req, self.cfg, n * len(ids_list))
        for i, ids in enumerate(ids_list):
            echo_text = self.tokenizer.decode(ids, skip_special_tokens=text.skip_special) if opts.echo else None
            for j in range(n):
                choices.append(self.new_choice(req, i * n + j, ids, max_tokens, j, req.logprobs, engine_prompt_logprobs, echo_text, grammar))
        return await self.generate_many(request, req, choices, opts, sum(len(ids) for ids in ids_list), t0)
