"""POST /v1/chat/completions: messages, through the model's chat template, to choices.

Decodes and checks the request, renders and tokenizes the conversation, and hands
the engine requests to the one-choice fast path or, when the request uses an
extra, to many_choices. Tools (tools/choice.py) and a reasoning parser
(--reasoning-parser, reasoning.py) are extras: their answers are parsed there,
and a forced tool call or structured output binds only the answer after the
reasoning (reasoning.answer_grammar).
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import cached_property

from aiohttp import web
from dpserve.daemons.api.guided import asked_for, guided_grammar
from dpserve.daemons.api.many_choices import ManyChoicesServing, choice_options
from dpserve.daemons.api.one_choice import OneChoiceServing
from dpserve.daemons.api.openai_types import ApiError, ChatCompletionRequest
from dpserve.daemons.api.reasoning import REASONING_PARSERS, THINK_END, THINK_START, answer_grammar, thinking_enabled
from dpserve.daemons.api.request_checks import (
    chat_echo_text,
    chat_logprob_counts,
    chat_messages,
    chat_template_args,
    logprob_token_ids,
    truncate_prompt,
    uses_extras,
)
from dpserve.daemons.api.tools.answer import ChatAnswer
from dpserve.daemons.api.tools.choice import ToolPlan, tool_grammar, tool_plan


class ChatServing(OneChoiceServing, ManyChoicesServing):
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        req = await self.read_request(request, ChatCompletionRequest)
        plan = None
        if req.tools is not None or req.tool_choice is not None:
            plan = tool_plan(req, self.cfg.enable_auto_tool_choice, self.cfg.tool_call_parser)
        extras = uses_extras(req) or self.cfg.reasoning_parser is not None or self.defaults.needs_processors
        num_top, num_prompt_top = chat_logprob_counts(req, self.vocab_size, self.cfg.max_logprobs)
        explicit = logprob_token_ids(req, self.vocab_size, self.cfg.max_logprobs)
        if explicit:  # vLLM shows every one of them after the chosen token, whatever top_logprobs says
            num_top = len(explicit) + 1
        template_args = chat_template_args(req)
        if plan is not None and plan.tools:
            template_args["tools"] = plan.tools
        ids = await self.tokenize(request, self.chat_ids, chat_messages(req), req.add_generation_prompt, template_args)
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, self.max_model_len, req.truncation_side)
        max_tokens = req.max_completion_tokens or req.max_tokens or self._default_max_tokens(len(ids))
        if not extras:
            return await self.generate_one(request, req, ids, max_tokens, chat=True, t0=t0)
        opts = choice_options(True, req, num_top, num_prompt_top, tokens_as_ids=self.cfg.return_tokens_as_token_ids)
        thinking = self.cfg.reasoning_parser is not None and thinking_enabled(self.cfg.reasoning_parser, req.chat_template_kwargs)
        opts.answer = self._answer(req, plan, thinking)
        if plan is not None and plan.mode == "auto":  # as vLLM: tool tags may be special tokens
            opts.text = replace(opts.text, skip_special=False)
        grammar = await self._grammar(req, plan, thinking)
        echo = chat_echo_text(req)
        choices = [self.new_choice(req, j, ids, max_tokens, j, num_top, num_prompt_top, echo, grammar, explicit)
                   for j in range(req.n or 1)]
        return await self.generate_many(request, req, choices, opts, len(ids), t0)

    def _answer(self, req: ChatCompletionRequest, plan: ToolPlan | None, thinking: bool):
        """A factory of each choice's ChatAnswer, or None when answers are plain content."""
        parser = self.cfg.reasoning_parser
        uses_tools = plan is not None and plan.mode != "none" and (plan.mode != "auto" or plan.parser is not None)
        if parser is None and not uses_tools:
            return None

        def new_answer() -> ChatAnswer:
            reasoning = REASONING_PARSERS[parser](thinking) if parser is not None else None
            tools = plan.new_parser() if uses_tools else None
            return ChatAnswer(reasoning, tools, named=plan is not None and plan.mode == "named",
                              show_reasoning=req.include_reasoning is not False,
                              single_call=req.parallel_tool_calls is False)

        return new_answer

    async def _grammar(self, req: ChatCompletionRequest, plan: ToolPlan | None, thinking: bool) -> str | None:
        """The answer's grammar: a forced tool call's, else the request's structured output;
        bound to the answer after the reasoning when the model thinks."""
        n = req.n or 1
        if plan is not None and plan.schema is not None:
            asked = asked_for(req)
            if asked is not None:
                raise ApiError(400, f"tool_choice {plan.mode!r} forces a tool call's JSON; it cannot be combined with {asked[0]}.",
                               param="tool_choice")
            grammar = await tool_grammar(plan, self.cfg, n)
        else:
            grammar = await guided_grammar(req, self.cfg, n, self.vocab_size)
        if grammar is None or not thinking:
            return grammar
        return answer_grammar(grammar, self._think_tokens)

    def _default_max_tokens(self, num_prompt: int) -> int:
        """A chat request without max_tokens: the context left (vLLM's), or the generation
        config's max_new_tokens when that is less."""
        left = max(self.max_model_len - num_prompt, 1)
        cap = self.defaults.max_new_tokens
        return left if cap is None else min(left, cap)

    @cached_property
    def _think_tokens(self) -> bool:
        """Whether <think> and </think> are special added tokens (llguidance then knows them
        only as tokens: regular text cannot spell them; engine/grammar.llg_tokenizer)."""
        special = {t.content for t in self.tokenizer.backend.get_added_tokens_decoder().values() if t.special}
        return THINK_START in special and THINK_END in special

