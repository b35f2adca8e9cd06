"""A chat request's tools and tool_choice, checked (400s naming the field) and
turned into what serving needs: the tools the template renders, the grammar that
forces a call (tool_choice "required" or a named function, vLLM's JSON schemas),
and the parser that reads the answer. Also the history's tool fields for the
template. vLLM's rules throughout; never touches sockets or engines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dpserve.daemons.api.openai_types import ApiError
from dpserve.daemons.api.tools.base import ToolParser
from dpserve.daemons.api.tools.parsers import TOOL_PARSERS, JsonArrayToolParser

MODES = ("none", "auto", "required")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools ask for. mode: none, auto, required or named."""

    tools: list[dict] | None  # as the chat template receives them (None: no tools)
    mode: str
    function: str | None = None  # the named function
    schema: dict | None = None  # the JSON schema forcing the call(s) (required, named)
    parser: str | None = None  # --tool-call-parser, for auto

    def new_parser(self) -> ToolParser | None:
        """A fresh parser for one answer (None: the answer is content only)."""
        if self.mode == "named":
            return NamedToolParser(self.function)
        if self.mode == "required":
            return JsonArrayToolParser()
        if self.mode == "auto" and self.parser is not None:
            return TOOL_PARSERS[self.parser]()
        return None


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the whole answer is that call's arguments (as
    vLLM does, even when the grammar was cut short by max_tokens)."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self._new_call(function)

    def _advance(self, final: bool) -> None:
        call = self.calls[0]
        call.arguments = self.text.strip()
        call.complete = final

    def _valid(self, call) -> bool:
        return call.complete


def check_tools(tools: list | None) -> list[dict] | None:
    """The tool definitions, each {"type": "function", "function": {"name", ...}}; a 400
    naming the first bad field."""
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise ApiError(400, f"{where}.type must be 'function'; got {str(tool.get('type'))[:40]!r}.", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function must be an object with at least a name.", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ApiError(400, f"{where}.function.name must be a non-empty string of at most 64 characters.",
                           param=f"{where}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema object.", param=f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ApiError(400, f"{where}.function.description must be a string.", param=f"{where}.function.description")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ApiError(400, f"{where}.function.strict must be a boolean.", param=f"{where}.function.strict")
    return tools


def tool_plan(req, auto_enabled: bool, parser: str | None) -> ToolPlan | None:
    """The request's plan, or None when it uses no tools (vLLM's validation: tool_choice
    needs tools; "auto" needs --enable-auto-tool-choice and --tool-call-parser)."""
    tools, choice = check_tools(req.tools), req.tool_choice
    if choice is None:
        if not tools:
            return None
        choice = "auto"
    if choice == "none":
        return ToolPlan(tools or None, "none")
    if tools == [] and choice == "auto":  # (vLLM takes an empty list as no tools)
        return None
    if not tools:
        raise ApiError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, str):
        if choice not in MODES:
            raise ApiError(400, f"Invalid value for `tool_choice`: {choice[:40]!r}; expected 'none', 'auto', 'required' "
                           "or {\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")
        if choice == "auto":
            if not (auto_enabled and parser):
                raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                               param="tool_choice")
            return ToolPlan(tools, "auto", parser=parser)
        return ToolPlan(tools, "required", schema=required_schema(tools, req.parallel_tool_calls))
    name = _named(choice)
    for tool in tools:
        if tool["function"]["name"] == name:
            return ToolPlan(tools, "named", name, schema=_parameters(tool))
    raise ApiError(400, f"The tool specified in `tool_choice` ({name[:64]!r}) does not match any of the specified `tools`.",
                   param="tool_choice")


def _named(choice: dict) -> str:
    fn = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(fn, dict):
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}.", param="tool_choice.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "tool_choice.function.name must be a non-empty string.", param="tool_choice.function.name")
    return name


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict], parallel: bool | None) -> dict:
    """vLLM's schema for tool_choice "required": an array of at least one
    {"name": one tool's name, "parameters": its schema} (at most one without
    parallel_tool_calls); the tools' $defs are lifted to the top."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        params = dict(_parameters(tool))
        for key, schema in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != schema:
                raise ApiError(400, f"Tool definition {key!r} has multiple schemas, which is not supported.",
                               param=f"tools[{i}].function.parameters")
            defs[key] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class _SchemaRequest:
    """The one structured-output parameter guided.py reads from a request: this schema
    as guided_json (every other parameter unset)."""

    def __init__(self, schema: dict) -> None:
        self.guided_json = schema

    def __getattr__(self, name: str):
        return None


async def tool_grammar(plan: ToolPlan, cfg, copies: int) -> str | None:
    """The grammar forcing the plan's call(s), or None; the structured-output budgets
    apply, and their 400s name tools (required) or tool_choice (named)."""
    if plan.schema is None:
        return None
    from dpserve.daemons.api.guided import guided_grammar

    param = "tools" if plan.mode == "required" else "tool_choice"
    try:
        return await guided_grammar(_SchemaRequest(plan.schema), cfg, copies)
    except ApiError as exc:
        raise ApiError(exc.status, exc.message.replace("guided_json", param), param=param, code=exc.code) from None


def history_fields(msg, i: int) -> dict:
    """A history message's tool and reasoning fields as the template reads them:
    tool_calls with their arguments parsed into objects (as vLLM hands them to
    templates), tool_call_id, reasoning_content."""
    out: dict[str, Any] = {}
    if msg.tool_calls:
        calls = []
        for j, call in enumerate(msg.tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs a function with a name.",
                               param=f"messages[{i}].tool_calls[{j}].function")
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except (ValueError, RecursionError):
                    pass  # the template gets the string as it came
            calls.append({**call, "function": {**fn, "arguments": args}})
        out["tool_calls"] = calls
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    reasoning = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out
