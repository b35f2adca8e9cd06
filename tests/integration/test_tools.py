"""Tool calling and reasoning output through a real node, with the official openai client.

The demo model with the tools chat template (Hermes / Qwen-style tags, a <think>
block), served with --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3. A random-weight model calls no tool by itself: forced
calls (required, named) come from the grammar, and "auto" answers are made to be
recorded answers with guided_regex, so that the parser runs on the server.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server import DpServer

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CALL_JSON = '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'


def spelled(*parts: str) -> str:
    """A Lark grammar of exactly this text; the tags, added tokens that are not special,
    are text to llguidance too (engine/grammar.llg_tokenizer), so the text spells them."""
    return "start: " + " ".join(json.dumps(p) for p in parts)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dpserve.engine.testing.demo_model import create_demo_model

    model = create_demo_model(str(tmp_path_factory.mktemp("tools-model") / "model"), chat="tools")
    srv = DpServer(model, "--max-model-len", "1024", "--dtype", "float32", "--enable-auto-tool-choice",
                   "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def ask(client, **kw):
    base = {"model": "demo", "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 120}
    return client.chat.completions.create(**{**base, **kw})


def joined_stream(client, **kw):
    """(content, reasoning, {index: [id, name, arguments]}, finish_reason, raw chunks) of a streamed answer."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, []
    for chunk in ask(client, stream=True, **kw):
        chunks.append(chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or ():
                if tc.index not in calls:
                    assert tc.id and tc.function.name and tc.type == "function"  # id and name first, once
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish, chunks


def assert_valid_calls(calls, only=None):
    assert calls
    for call in calls:
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_openai_tool_calling_flow(client):
    """tools -> a tool_calls answer -> the tool's result -> the final answer, whole and streamed."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(client, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                seed=1, extra_body=NO_THINKING)
    msg, choice = first.choices[0].message, first.choices[0]
    assert choice.finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    assert_valid_calls(msg.tool_calls)
    call = msg.tool_calls[0]
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    final = ask(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0, extra_body=NO_THINKING)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    # the history's call and result are in the prompt: it is longer than the question and the tools alone
    bare = ask(client, tools=TOOLS, tool_choice="none", max_tokens=1, extra_body=NO_THINKING)
    assert final.usage.prompt_tokens > bare.usage.prompt_tokens + 20
    content, _, calls, finish, _ = joined_stream(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=16,
                                                 temperature=0, extra_body=NO_THINKING)
    assert not calls and finish in ("stop", "length") and content == final.choices[0].message.content


def test_openai_tool_calling_flow_streamed(client):
    """The same flow with every turn streamed: the call is put together from its deltas."""
    messages = [{"role": "user", "content": "What time is it in Berlin?"}]
    content, _, calls, finish, _ = joined_stream(client, messages=messages, tools=TOOLS,
                                                 tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                 seed=2, extra_body=NO_THINKING)
    assert finish == "stop" and content == "" and len(calls) == 1
    call_id, name, arguments = calls[0]
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "12:00 CET"}]
    content, _, calls, finish, _ = joined_stream(client, messages=messages, tools=TOOLS, max_tokens=8, temperature=0,
                                                 extra_body=NO_THINKING)  # auto: the answer is text, not a call
    assert not calls and finish in ("stop", "length") and content


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_arguments_are_schema_valid(client, temperature):
    for seed in range(4):
        named = ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    temperature=temperature, seed=seed, n=2, extra_body=NO_THINKING)
        for choice in named.choices:
            assert choice.finish_reason == "stop"  # OpenAI's finish for a named function
            assert_valid_calls(choice.message.tool_calls, only="get_weather")
        required = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=temperature,
                       seed=seed, max_tokens=200, extra_body=NO_THINKING)
        assert required.choices[0].finish_reason == "tool_calls"
        assert len(required.choices[0].message.tool_calls) == 1
        assert_valid_calls(required.choices[0].message.tool_calls)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_fragments_reassemble_to_the_whole_call(client, openai_schema, choice):
    kw = dict(tools=TOOLS, tool_choice=choice, temperature=1.0, seed=7, max_tokens=200, extra_body=NO_THINKING)
    whole = ask(client, **kw)
    content, _, calls, finish, chunks = joined_stream(client, **kw)
    expected = [[c.function.name, c.function.arguments] for c in whole.choices[0].message.tool_calls]
    assert [[name, args] for _, name, args in calls.values()] == expected
    assert finish == whole.choices[0].finish_reason and content == ""
    openai_schema(whole.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    for chunk in chunks:
        openai_schema(chunk, "CreateChatCompletionStreamResponse")


def test_auto_parses_the_answer_with_the_hermes_parser(client):
    kw = dict(tools=TOOLS, guided_grammar=spelled("Checking.\n", "<tool_call>", CALL_JSON, "</tool_call>"))
    whole = ask(client, extra_body={**NO_THINKING, **kw})
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]
    content, _, calls, finish, _ = joined_stream(client, extra_body={**NO_THINKING, **kw})
    assert content == "Checking.\n" and finish == "tool_calls"
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == [("get_weather", {"city": "Paris", "days": 3})]


def test_text_that_does_not_parse_is_content(client):
    text = "<tool_call>\nnot json at all\n</tool_call>"
    grammar = spelled("<tool_call>", "\nnot json at all\n", "</tool_call>")
    whole = ask(client, extra_body={**NO_THINKING, "tools": TOOLS, "guided_grammar": grammar})
    assert whole.choices[0].message.content == text and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"
    content, _, calls, finish, _ = joined_stream(client, extra_body={**NO_THINKING, "tools": TOOLS, "guided_grammar": grammar})
    assert content == text and not calls and finish == "stop"


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_invalid_tool_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, extra_body=body)
    assert err.value.body["param"] == param


def test_reasoning_content_apart_from_the_answer(client):
    """Thinking on: the reasoning (pushed to end soon by a bias on </think>) comes apart
    from the answer, which the JSON schema binds; streamed deltas join to the same."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"]}
    kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
              logit_bias={"7": 6.0}, seed=3, temperature=1.0, max_tokens=200)  # 7: </think>
    whole = ask(client, **kw)
    msg = whole.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert whole.choices[0].finish_reason == "stop" and reasoning is not None and msg.model_extra["reasoning"] == reasoning
    jsonschema.validate(json.loads(msg.content), schema)
    content, streamed_reasoning, calls, finish, _ = joined_stream(client, **kw)
    assert (content, streamed_reasoning, finish) == (msg.content, reasoning, "stop") and not calls
    hidden = ask(client, extra_body={"include_reasoning": False, "return_token_ids": True}, **kw)
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {}) and hidden.choices[0].message.content == msg.content
    # vLLM's reasoning_tokens: the ids before </think> (7), counted when the reasoning is hidden too
    ids = hidden.choices[0].model_extra["token_ids"]
    assert whole.usage.completion_tokens_details.reasoning_tokens == hidden.usage.completion_tokens_details.reasoning_tokens
    assert hidden.usage.completion_tokens_details.reasoning_tokens == ids.index(7) - (ids[0] == 6) > 0
    last = list(ask(client, stream=True, stream_options={"include_usage": True}, **kw))[-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == ids.index(7) - (ids[0] == 6)


def test_a_forced_call_follows_the_reasoning(client):
    """Thinking on and a named function: the grammar lets the model reason first, then
    binds the call; reasoning and call come apart, streamed as whole."""
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              logit_bias={"7": 6.0}, seed=5, temperature=1.0, max_tokens=200)
    whole = ask(client, **kw)
    msg = whole.choices[0].message
    assert msg.model_extra["reasoning_content"] is not None and "</think>" not in msg.model_extra["reasoning_content"]
    assert_valid_calls(msg.tool_calls, only="get_weather")
    content, reasoning, calls, finish, _ = joined_stream(client, **kw)
    assert reasoning == msg.model_extra["reasoning_content"] and finish == whole.choices[0].finish_reason
    assert [(name, args) for _, name, args in calls.values()] == [("get_weather", msg.tool_calls[0].function.arguments)]


def test_tokenize_renders_tools_and_the_batch_reads_the_reasoning(server, client):
    """vLLM's /tokenize with tools counts what a chat completion with those tools is charged
    for; /v1/chat/completions/batch puts each answer's thinking in reasoning_content."""
    import urllib.request

    def post(path, body):
        req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools = post("/tokenize", {"model": "demo", "messages": messages, "tools": TOOLS})["count"]
    assert with_tools > post("/tokenize", {"model": "demo", "messages": messages})["count"]
    assert ask(client, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens == with_tools
    got = post("/v1/chat/completions/batch", {"model": "demo", "messages": [messages, messages], "max_tokens": 60, "seed": 3,
                                              "temperature": 1.0, "logit_bias": {"7": 6.0}})
    for choice in got["choices"]:
        reasoning = choice["message"]["reasoning_content"]
        assert reasoning is not None and "</think>" not in reasoning  # (the answer after the first may hold more)
    assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
