"""The OpenAPI 3.1 document of this API server's own endpoints, served at /openapi.json.

Request schemas are generated from the very Structs that decode requests
(openai_types; UNSUPPORTED from request_checks), so the document cannot drift from what the server accepts;
only what a type cannot say (the served model's name, token ids below the
vocabulary size, context length, unsupported parameters' defaults) is added
here. Built once per process; nothing here runs per request.
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.structs
from dpserve.daemons.api.lax_decode import LAX_BOOL_FIELDS, lax_bool_schemas
from dpserve.daemons.api.openai_types import (
    MAX_CHOICES,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from dpserve.daemons.api.request_checks import UNSUPPORTED

_REF = "#/components/schemas/{name}"
# OpenAI's roles; any other (vLLM's custom roles) reaches the chat template as it is
ROLES = ["system", "developer", "user", "assistant", "tool"]


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}}}


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


# The 400s that the request schemas cannot say (each names its `param`), and the
# budgets behind them: (ServeConfig field, its flag, what it bounds).
RULES_400 = (
    "`guided_choice` empty or holding an empty string",
    "more than one of `guided_json`, `guided_regex`, `guided_choice`, `response_format` (json)",
    "a JSON schema with a non-local or self-referencing `$ref`, or a regex that does not compile",
    "`top_logprobs` without `logprobs: true` (chat)",
    "`logprobs`, `top_logprobs` or `prompt_logprobs` (-1: the vocabulary) over --max-logprobs",
    "`stream_options` without `stream: true`; `suffix` for a model without fill-in-the-middle tokens",
    "`structured_outputs` with other than exactly one of json, regex, choice, grammar; a grammar that does not parse",
    "`truncate_prompt_tokens` over the context length; `continue_final_message` with `add_generation_prompt`",
    "`max_tokens: 0` without `echo` (completions)",
    "a nonzero `priority` unless the server runs --scheduling-policy priority",
    "`min_tokens` over `max_tokens`; a prompt plus `max_tokens` over the context",
    "token ids (prompt, `stop_token_ids`, `logit_bias` keys) outside the vocabulary",
    "more choices than the limit (prompts x `n`)",
    "`X-data-parallel-rank` sent more than once, not ASCII digits, or a rank this API server does not route to",
)
BUDGETS_400 = (
    ("max_response_bytes", "--max-response-bytes", "the response a request could produce (n, prompts, max_tokens, logprobs, echo, prompt_logprobs), in bytes"),
    ("max_guided_grammar_bytes", "--max-guided-grammar-bytes", "a structured-output parameter's size, in bytes"),
    ("max_guided_bytes_per_request", "--max-guided-bytes-per-request", "that size x n x prompts"),
    ("max_guided_choices", "--max-guided-choices", "`guided_choice` entries, and a schema's enum/anyOf/oneOf lists"),
    ("max_guided_regex_size", "--max-guided-regex-size", "a regex with its repetitions expanded, the longest choice, schema length bounds"),
    ("max_guided_schema_properties", "--max-guided-schema-properties", "properties in a whole JSON schema"),
    ("max_guided_schema_depth", "--max-guided-schema-depth", "a JSON schema's nesting depth"),
)


def _describe_400(limits: dict[str, int]) -> str:
    rules = "; ".join(RULES_400)
    budgets = "; ".join(f"{what} over {flag} (here {limits[field]:,})" for field, flag, what in BUDGETS_400 if field in limits)
    text = f"Invalid request: `error.param` names the parameter. Besides the schema's rules, these are 400s: {rules}."
    return text + (f" Over a budget (code `grammar_too_large` for grammars): {budgets}." if budgets else "")


def _generation_responses(response: str, api_key: bool, limits: dict[str, int]) -> dict:
    out = {
        "200": {
            "description": "The answer; with `stream: true`, server-sent events ending in `data: [DONE]`.",
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(name=response)}},
                # each event: `data: <chunk JSON>`, the last one `data: [DONE]`
                "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}},
            },
        },
        "400": _error(_describe_400(limits)),
        "404": _error("Unknown model."),
        "413": _error("Request body over --max-request-body-bytes."),
        "415": _error("Content-Type is not application/json."),
        "417": _error("An Expect header other than 100-continue (`param`: Expect)."),
        "429": _error("Every rank's waiting queue is full; retry after Retry-After."),
        "503": _error("No engine rank can serve the request right now, or it failed on its rank."),
    }
    if api_key:
        out["401"] = _error("Missing or invalid API key.")
    return out


def _fits(value: Any, type_: Any) -> bool:
    try:
        msgspec.convert(value, type_, strict=True)
    except msgspec.ValidationError:
        return False
    return True


def _restrict_requests(schemas: dict, model_name: str, vocab_size: int, max_model_len: int, limits: dict[str, int]) -> None:
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    for kind in (CompletionRequest, ChatCompletionRequest, BatchChatCompletionRequest):
        schema = schemas[kind.__name__]
        props = schema["properties"]
        # model is optional in the Struct only so that a missing one gets a clear 400.
        props["model"] = {"type": "string", "enum": [model_name], "description": "The served model name (others get 404)."}
        schema["required"] = sorted({*schema.get("required", []), "model"})
        for field in ("max_tokens", "min_tokens", "max_completion_tokens"):
            if field in props:
                # Prompt plus max_tokens must fit the context (a 400 otherwise), so no
                # answer is longer than this; the type's own bound is larger.
                props[field]["anyOf"][0]["maximum"] = max_model_len - 1
        props["stop_token_ids"]["anyOf"][0]["items"] = token_id
        props["allowed_token_ids"]["anyOf"][0].update(items=token_id, minItems=1)
        props["logprob_token_ids"]["anyOf"][0]["items"] = token_id
        props["logprob_token_ids"]["description"] = "Needs logprobs set; at most --max-logprobs ids; without it, a 400."
        if "guided_choice" in props:  # an empty list, or an empty choice, is a 400
            choice = props["guided_choice"]["anyOf"][0]
            choice.update(minItems=1, items={"type": "string", "minLength": 1})
            if "max_guided_choices" in limits:
                choice["maxItems"] = limits["max_guided_choices"]
        if kind is ChatCompletionRequest and "top_logprobs" in props:
            props["top_logprobs"]["description"] = "Needs `logprobs: true`; without it, a 400."
        types = {f.name: f.type for f in msgspec.structs.fields(kind)}
        for field, accepted in UNSUPPORTED.items():
            if field in props:
                # Only the defaults this endpoint's type takes (a completion's logprobs is an int, not false).
                props[field] = {
                    "enum": [*(v for v in accepted if _fits(v, types[field])), None],
                    "description": "Not supported by dpserve: only its default (or null) is accepted; anything else is a 400.",
                }
    schemas["CompletionRequest"]["properties"]["prompt"] = {
        "description": (
            f"A string, a list of token ids, or a batch: a list of strings or of token-id lists "
            f"(at most {MAX_CHOICES} choices in all, prompts x n; choice index = prompt index x n + sample)."
        ),
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": token_id, "minItems": 1},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_CHOICES},
            {"type": "array", "items": {"type": "array", "items": token_id, "minItems": 1}, "minItems": 1, "maxItems": MAX_CHOICES},
        ],
    }
    schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1
    for name in ("ChatCompletionRequest", "BatchChatCompletionRequest"):
        for field in LAX_BOOL_FIELDS:  # pydantic's lax forms of these bools (lax_decode.py)
            prop = schemas[name]["properties"][field]
            if prop.get("anyOf", [None])[0] == {"type": "boolean"}:
                prop["anyOf"] += lax_bool_schemas()
    _restrict_utility(schemas, model_name, token_id)
    schemas["ChatMessage"]["properties"]["role"] = {"type": "string", "minLength": 1, "maxLength": 64, "examples": ROLES}
    schemas["ContentPart"] = {
        "title": "ContentPart",
        "type": "object",
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }


def _restrict_utility(schemas: dict, model_name: str, token_id: dict) -> None:
    """/tokenize takes exactly one of prompt and messages; /detokenize ids in the vocabulary."""
    model = {"type": "string", "enum": [model_name], "description": "The served model name (others get 404)."}
    tokenize = schemas["TokenizeRequest"]
    tokenize["properties"]["model"] = model
    tokenize["properties"]["prompt"] = {"type": "string"}
    tokenize["properties"]["messages"] = {"type": "array", "items": {"$ref": _REF.format(name="ChatMessage")}, "minItems": 1}
    tokenize["required"] = ["model"]
    tokenize["oneOf"] = [{"required": ["prompt"], "not": {"required": ["messages"]}},
                         {"required": ["messages"], "not": {"required": ["prompt"]}}]
    detokenize = schemas["DetokenizeRequest"]
    detokenize["properties"]["model"] = model
    detokenize["properties"]["tokens"] = {"type": "array", "items": token_id}
    detokenize["required"] = ["model", "tokens"]


def _utility_paths(auth: list, api_key: bool, tokenizer_info: bool) -> dict:
    """vLLM's utility endpoints (utility.py); /invocations generates, so it is secured."""
    def post(summary: str, op: str, request: dict, ok: dict, *, secured: bool = False) -> dict:
        responses = {"200": ok, "400": _error("Invalid request (`error.param` names it)."), "404": _error("Unknown model."),
                     "413": _error("Request body over --max-request-body-bytes."), "415": _error("Content-Type is not application/json."),
                     "417": _error("An Expect header other than 100-continue (`param`: Expect).")}
        item = {"summary": summary, "operationId": op, "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": responses}
        if secured:
            item["security"] = auth
            responses.update({"429": _error("Every rank's waiting queue is full."), "503": _error("No engine rank can serve it now.")})
            if api_key:
                responses["401"] = _error("Missing or invalid API key.")
        return {"post": item}

    ref = lambda name: {"$ref": _REF.format(name=name)}  # noqa: E731
    paths = {
        "/tokenize": post("Token ids of a prompt or of a chat (vLLM's)", "tokenize", ref("TokenizeRequest"),
                          _json("The ids, their count and the context length.", ref("TokenizeResponse"))),
        "/detokenize": post("Text of token ids (vLLM's)", "detokenize", ref("DetokenizeRequest"),
                            _json("The text.", ref("DetokenizeResponse"))),
        "/invocations": post("SageMaker's: a chat (messages) or completion (prompt) body, served by that endpoint", "invocations",
                             {"anyOf": [ref("ChatCompletionRequest"), ref("CompletionRequest")]},
                             {"description": "The endpoint's answer.", "content": {
                                 "application/json": {"schema": {"anyOf": [ref("ChatCompletionResponse"), ref("CompletionResponse")]}},
                                 "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}},
                             secured=True),
        "/v1/chat/completions/batch": post("vLLM's batch chat: choice i answers conversation i (no stream, tools or n)", "createBatchChatCompletion",
                                           ref("BatchChatCompletionRequest"), _json("One choice per conversation.", ref("ChatCompletionResponse")),
                                           secured=True),
        "/load": {"get": {"summary": "Requests in progress on this API server (vLLM's; 0 without --enable-server-load-tracking)",
                          "operationId": "load", "responses": {"200": _json("The count.", {
                              "type": "object", "properties": {"server_load": {"type": "integer", "minimum": 0}}, "required": ["server_load"]})}}},
    }
    if tokenizer_info:
        paths["/tokenizer_info"] = {"get": {"summary": "The tokenizer's configuration and chat template (vLLM's)", "operationId": "tokenizerInfo",
                                            "responses": {"200": _json("tokenizer_config.json without file paths.", {
                                                "type": "object", "properties": {"tokenizer_class": {"type": "string"}}, "required": ["tokenizer_class"]})}}}
    return paths


def build_openapi(
    model_name: str, vocab_size: int, max_model_len: int, *, api_key: bool, version: str, limits: dict[str, int] | None = None,
    tokenizer_info: bool = False,
) -> dict[str, Any]:
    """The whole document, as plain JSON-able data; `limits` are the serving budgets
    (ServeConfig fields named in BUDGETS_400) that the 400's description states."""
    limits = limits or {}
    _, schemas = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, BatchChatCompletionRequest, CompletionResponse, ChatCompletionResponse, ModelList, ErrorResponse,
         TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse],
        ref_template=_REF,
    )
    _restrict_requests(schemas, model_name, vocab_size, max_model_len, limits)
    auth = [{"bearer": []}] if api_key else []
    rank_header = {
        "name": "X-data-parallel-rank",
        "in": "header",
        "required": False,
        "description": "Pin the request to this data-parallel rank (ASCII digits; out of range is a 400).",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }

    def generate(summary: str, op: str, request: str, response: str) -> dict:
        return {
            "post": {
                "summary": summary,
                "operationId": op,
                "security": auth,
                "parameters": [rank_header],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(name=request)}}}},
                "responses": _generation_responses(response, api_key, limits),
            }
        }

    def get(summary: str, op: str, responses: dict, *, secured: bool = False) -> dict:
        item = {"summary": summary, "operationId": op, "responses": responses}
        if secured:
            item["security"] = auth
            if api_key:
                responses["401"] = _error("Missing or invalid API key.")
        return {"get": item}

    status = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "dpserve",
            "version": version,
            "description": "OpenAI-compatible completions and chat completions, served by data-parallel engine ranks. "
            "Unknown request fields are ignored (and logged); known but unsupported ones are a 400 unless at their default.",
        },
        "paths": {
            "/v1/completions": generate("Create a completion", "createCompletion", "CompletionRequest", "CompletionResponse"),
            "/v1/chat/completions": generate("Create a chat completion", "createChatCompletion", "ChatCompletionRequest", "ChatCompletionResponse"),
            "/v1/models": get("The served model", "listModels", {"200": _json("The one served model.", {"$ref": _REF.format(name="ModelList")})}, secured=True),
            "/health": get("Whether this API server can serve a request now", "health", {
                "200": _json("It can.", status),
                "503": _json("Draining, or no engine rank is ready.", status),
            }),
            "/readyz": get("Whether this API server can route to a rank", "readyz", {
                "200": _json("At least one rank is routable.", status),
                "503": _json("Draining, or no routable rank.", status),
            }),
            "/version": get("dpserve's version", "version", {"200": _json("The version.", {"type": "object", "properties": {"version": {"type": "string"}}, "required": ["version"]})}),
            "/metrics": get("Prometheus metrics", "metrics", {"200": {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}}),
            "/openapi.json": get("This document", "openapi", {"200": _json("OpenAPI 3.1.", {"type": "object"})}),
            **_utility_paths(auth, api_key, tokenizer_info),
        },
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"}}
    return doc
