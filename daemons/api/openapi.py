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
from dpserve.daemons.api.openai_types import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from dpserve.daemons.api.request_checks import UNSUPPORTED

_REF = "#/components/schemas/{name}"
ROLES = ["system", "developer", "user", "assistant", "tool"]


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}}}


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generation_responses(response: str, api_key: bool) -> dict:
    out = {
        "200": {
            "description": "The answer; with `stream: true`, server-sent events ending in `data: [DONE]`.",
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(name=response)}},
                # each event: `data: <chunk JSON>`, the last one `data: [DONE]`
                "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}},
            },
        },
        "400": _error("Invalid request: the message names the parameter (`param`)."),
        "404": _error("Unknown model."),
        "413": _error("Request body over --max-request-body-bytes."),
        "415": _error("Content-Type is not application/json."),
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


def _restrict_requests(schemas: dict, model_name: str, vocab_size: int, max_model_len: int) -> None:
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    for kind in (CompletionRequest, ChatCompletionRequest):
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
    schemas["ChatMessage"]["properties"]["role"] = {"type": "string", "enum": ROLES}
    schemas["ContentPart"] = {
        "title": "ContentPart",
        "type": "object",
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }


def build_openapi(model_name: str, vocab_size: int, max_model_len: int, *, api_key: bool, version: str) -> dict[str, Any]:
    """The whole document, as plain JSON-able data."""
    _, schemas = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse, ModelList, ErrorResponse],
        ref_template=_REF,
    )
    _restrict_requests(schemas, model_name, vocab_size, max_model_len)
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
                "responses": _generation_responses(response, api_key),
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
        },
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"}}
    return doc
