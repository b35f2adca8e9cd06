"""POST /v1/completions: a prompt (text or token ids, or a batch of them) to choices.

Decodes and checks the request, tokenizes (a `suffix` through the vocabulary's
fill-in-the-middle tokens), and hands the engine requests to the one-choice fast
path or, when the request uses an extra, to many_choices.
"""

from __future__ import annotations

import time

from aiohttp import web
from dpserve.daemons.api.guided import guided_grammar
from dpserve.daemons.api.many_choices import ManyChoicesServing, choice_options
from dpserve.daemons.api.one_choice import OneChoiceServing
from dpserve.daemons.api.openai_types import ApiError, CompletionRequest
from dpserve.daemons.api.request_checks import (
    check_logprobs,
    completion_prompt,
    completion_prompts,
    logprob_token_ids,
    truncate_prompt,
    uses_extras,
)


class CompletionsServing(OneChoiceServing, ManyChoicesServing):
    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        req = await self.read_request(request, CompletionRequest)
        if uses_extras(req) or self.defaults.needs_processors:
            return await self._completions_with_extras(request, req, t0)
        ids = await self._completion_ids(request, req, completion_prompt(req))
        return await self.generate_one(request, req, ids, req.max_tokens or 16, chat=False, t0=t0)

    def check_token_ids(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids: each must be in the vocabulary (vLLM's message)."""
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            raise ApiError(400, f"Token id {low if low < 0 else high} is out of vocabulary (size {self.vocab_size}).", param="prompt")
        return ids

    async def _completion_ids(self, request: web.Request, req: CompletionRequest, prompt: str | list[int]) -> list[int]:
        """One prompt's ids: text tokenized (with the suffix, as fill-in-the-middle), or
        token ids checked; then vLLM's truncate_prompt_tokens."""
        if req.suffix:
            if not isinstance(prompt, str):
                raise ApiError(400, "suffix requires text prompt input for FIM completion rendering", param="suffix")
            fim = self.tokenizer.fim_prompt(prompt, req.suffix)
            if fim is None:
                raise ApiError(400, "suffix is only supported for models with FIM completion rendering: this "
                               "model's vocabulary has no fill-in-the-middle tokens.", param="suffix")
            prompt = fim
        if isinstance(prompt, str):
            ids = await self.tokenize(request, self.prompt_ids, prompt)
        else:
            ids = self.check_token_ids(prompt)
        return truncate_prompt(ids, req.truncate_prompt_tokens, self.max_model_len, req.truncation_side)

    async def _completions_with_extras(self, request: web.Request, req: CompletionRequest, t0: float) -> web.StreamResponse:
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens 0 is only accepted with echo (to score the prompt).", param="max_tokens")
        num_top = check_logprobs("logprobs", req.logprobs, self.vocab_size, self.cfg.max_logprobs)
        num_prompt_top = check_logprobs("prompt_logprobs", req.prompt_logprobs, self.vocab_size, self.cfg.max_logprobs)
        explicit = logprob_token_ids(req, self.vocab_size, self.cfg.max_logprobs)
        render_top = max(num_top or 0, len(explicit)) if explicit else num_top  # vLLM shows every one of them
        prompts = completion_prompts(req)
        ids_list = [await self._completion_ids(request, req, prompt) for prompt in prompts]
        opts = choice_options(False, req, render_top, num_prompt_top, echo=bool(req.echo),
                              tokens_as_ids=self.cfg.return_tokens_as_token_ids)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        engine_prompt_logprobs = num_prompt_top
        if opts.echo and num_top is not None:
            engine_prompt_logprobs = max(num_top, num_prompt_top or 0)
        choices = []
        n = req.n or 1
        grammar = await guided_grammar(req, self.cfg, n * len(ids_list), self.vocab_size)
        for i, (prompt, ids) in enumerate(zip(prompts, ids_list)):
            # vLLM echoes token ids as their decode with special tokens' text (and shows them so in
            # logprobs); a text prompt's echo leaves out the special tokens tokenizing added (a BOS)
            token_prompt = not isinstance(prompt, str)
            echo_text = self.tokenizer.decode(ids, skip_special_tokens=opts.text.skip_special and not token_prompt) if opts.echo else None
            for j in range(n):
                choice = self.new_choice(req, i * n + j, ids, max_tokens, j, num_top, engine_prompt_logprobs, echo_text, grammar, explicit)
                choice.echo_specials = token_prompt
                choices.append(choice)
        return await self.generate_many(request, req, choices, opts, sum(len(ids) for ids in ids_list), t0)

