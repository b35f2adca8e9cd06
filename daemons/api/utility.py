"""vLLM's utility endpoints: /tokenize, /detokenize, /tokenizer_info, /v1/models, /load,
SageMaker's /invocations and /v1/chat/completions/batch, with vLLM's shapes.

All but the last never reach an engine: each answers from this API server's
tokenizer and counters alone; /invocations only picks the endpoint a body belongs
to, and the batch endpoint sends its conversations as the choices of one request.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
from aiohttp import web
from dpserve.daemons.api.chat import ChatServing
from dpserve.daemons.api.guided import guided_grammar
from dpserve.daemons.api.many_choices import choice_options
from dpserve.daemons.api.openai_types import (
    ApiError,
    BatchChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    encode,
)
from dpserve.daemons.api.reasoning import answer_grammar, thinking_enabled
from dpserve.daemons.api.request_checks import (
    chat_logprob_counts,
    chat_messages,
    chat_template_args,
    decode_request,
    logprob_token_ids,
    out_of_vocab,
    truncate_prompt,
)
from dpserve.daemons.api.tools.choice import check_tools

# tokenizer_config.json fields that name files on this machine: never shown.
_PRIVATE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def _plain(value: Any) -> Any:
    """tokenizer_config values as JSON: an AddedToken-like {"content": ...} becomes its text."""
    if isinstance(value, dict):
        if "content" in value and "__type" in value:
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class UtilityServing(ChatServing):
    async def tokenize_endpoint(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a `prompt` (special tokens added by default) or chat
        `messages` rendered by the chat template (the ids a chat completion would send)."""
        req: TokenizeRequest = decode_request(await self.read_body(request), TokenizeRequest, self.note_unknown_field)
        self.check_model(req.model)
        if (req.prompt is msgspec.UNSET) == (req.messages is msgspec.UNSET):
            raise ApiError(400, "Send exactly one of prompt (text) and messages (a chat).", param="prompt" if req.prompt is msgspec.UNSET else "messages")
        if req.prompt is not msgspec.UNSET:
            add_special = req.add_special_tokens is not False
            ids = await self.tokenize(request, self._prompt_ids_special, req.prompt, add_special)
        else:
            ids = await self.tokenize(request, self._chat_ids_for, req)
        strs = self.tokenizer.token_strs(ids) if req.return_token_strs else None
        return self._json(TokenizeResponse(len(ids), self.max_model_len, ids, strs))

    def _prompt_ids_special(self, prompt: str, add_special_tokens: bool) -> list[int]:
        self._check_prompt_size(prompt, "prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _chat_ids_for(self, req: TokenizeRequest) -> list[int]:
        tok = self.tokenizer
        kwargs = dict(req.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "continue_final_message", "tools"):
            kwargs.pop(reserved, None)
        tools = check_tools(req.tools)
        if tools:  # as a chat completion renders them (vLLM's /tokenize takes tools too)
            kwargs["tools"] = tools
        try:
            text = tok.apply_chat_template(chat_messages(req), add_generation_prompt=bool(req.add_generation_prompt),
                                           continue_final_message=bool(req.continue_final_message), **kwargs)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        self._check_prompt_size(text, "messages")
        if req.add_special_tokens:
            return tok.encode(text, add_special_tokens=True)
        return tok.encode_chat_prompt(text)

    async def detokenize_endpoint(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids to text, special tokens kept."""
        req: DetokenizeRequest = decode_request(await self.read_body(request), DetokenizeRequest, self.note_unknown_field)
        self.check_model(req.model)
        out_of_vocab("tokens", req.tokens, self.vocab_size)
        text = self.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return self._json(DetokenizeResponse(text))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's /tokenizer_info (behind --enable-tokenizer-info-endpoint): the
        tokenizer's configuration, without file paths, and its chat template."""
        tok = self.tokenizer
        info = {k: _plain(v) for k, v in tok.config.items() if k not in _PRIVATE_FIELDS}
        info["tokenizer_class"] = str(tok.config.get("tokenizer_class") or "PreTrainedTokenizerFast")
        if tok.chat_template_source:
            info["chat_template"] = tok.chat_template_source
        return self._json(info)

    async def models(self, request: web.Request) -> web.Response:
        """vLLM's /v1/models: the served name, `root` the model's path."""
        card = ModelCard(self.model_name, self._created, owned_by="vllm", max_model_len=self.max_model_len, root=self.cfg.model_dir)
        return self._json(ModelList([card]))

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's /load: this API server's requests in progress, counted with
        --enable-server-load-tracking (0 without it, as vLLM)."""
        load = self.num_active if self.cfg.enable_server_load_tracking else 0
        return self._json({"server_load": load})

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's /invocations: a chat body (messages) or a completion body (prompt),
        served by that endpoint; anything else is vLLM's 400."""
        body = await self.read_body(request)
        try:
            keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ApiError(400, f"JSON decode error: {exc}") from None
        # (aiohttp keeps the body read: the endpoint reads the same bytes again)
        if "messages" in keys:
            return await self.chat_completions(request)
        if "prompt" in keys:
            return await self.completions(request)
        raise ApiError(400, "Cannot find suitable handler for request. Expected one of: "
                       "['ChatCompletionRequest', 'CompletionRequest']")

    async def chat_batch(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /v1/chat/completions/batch: choice i answers conversation i; the other
        fields are a chat completion's, shared by every conversation."""
        t0 = time.perf_counter()
        req: BatchChatCompletionRequest = await self.read_request(request, BatchChatCompletionRequest)
        for name, bad, why in (("stream", req.stream, "streaming"), ("tools", req.tools, "tools"),
                               ("n", (req.n or 1) != 1, "n other than 1")):
            if bad:
                raise ApiError(400, f"Batch chat completions do not support {why}.", param=name)
        num_top, num_prompt_top = chat_logprob_counts(req, self.vocab_size, self.cfg.max_logprobs)
        explicit = logprob_token_ids(req, self.vocab_size, self.cfg.max_logprobs)
        if explicit:  # as a chat completion: the chosen token, then every listed id
            num_top = len(explicit) + 1
        args = chat_template_args(req)
        ids_list = []
        for conversation in req.messages:
            messages = chat_messages(SimpleNamespace(messages=conversation))
            ids = await self.tokenize(request, self.chat_ids, messages, req.add_generation_prompt, args)
            ids_list.append(truncate_prompt(ids, req.truncate_prompt_tokens, self.max_model_len, req.truncation_side))
        opts = choice_options(True, req, num_top, num_prompt_top, tokens_as_ids=self.cfg.return_tokens_as_token_ids)
        # the reasoning parser reads each answer, and structured output binds the answer after it, as in a chat completion
        thinking = self.cfg.reasoning_parser is not None and thinking_enabled(self.cfg.reasoning_parser, req.chat_template_kwargs)
        opts.answer = self._answer(req, None, thinking)
        grammar = await guided_grammar(req, self.cfg, len(ids_list), self.vocab_size)
        if grammar is not None and thinking:
            grammar = answer_grammar(grammar, self._think_tokens)
        asked = req.max_completion_tokens or req.max_tokens
        choices = [self.new_choice(req, i, ids, asked or self._default_max_tokens(len(ids)), 0, num_top, num_prompt_top, None, grammar,
                                   explicit) for i, ids in enumerate(ids_list)]
        return await self.generate_many(request, req, choices, opts, sum(map(len, ids_list)), t0)

    def _json(self, body: Any) -> web.Response:
        return web.Response(body=encode(body), content_type="application/json")
