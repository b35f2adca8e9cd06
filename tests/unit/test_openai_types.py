"""Request decoding and validation: every bad input is a 400 naming the field."""

from __future__ import annotations

import json

import pytest
from dpserve.daemons.api.openai_types import INT32_MAX, ApiError, ChatCompletionRequest, CompletionRequest
from dpserve.daemons.api.request_checks import (
    UNSUPPORTED,
    chat_messages,
    check_unsupported,
    completion_prompt,
    completion_prompts,
    decode_request,
    stop_strings,
    uses_extras,
)


def completion(**kw) -> CompletionRequest:
    return decode_request(json.dumps({"model": "m", "prompt": "hi", **kw}).encode(), CompletionRequest)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", -1), ("max_tokens", "3"), ("temperature", -1), ("top_p", 0), ("top_p", 1.01), ("top_k", -2),
        ("n", 0), ("stream", "yes"), ("stream", 1), ("echo", "true"),
        # Numbers an engine cannot hold: top_k once crashed a rank from int64 overflow.
        ("top_k", 2**64 - 1), ("top_k", 10**30), ("top_k", INT32_MAX + 1), ("max_tokens", INT32_MAX + 1),
        ("max_tokens", 10**30), ("min_tokens", -1), ("min_tokens", INT32_MAX + 1), ("seed", 2**63), ("seed", -(2**63) - 1),
        ("temperature", 101), ("temperature", 10**30), ("n", 129), ("presence_penalty", 3),
        ("stop_token_ids", [-1]), ("stop_token_ids", [INT32_MAX + 1]), ("stop_token_ids", list(range(1025))),
        ("stop", [str(i) for i in range(17)]), ("stop", "x" * 1025), ("stop", ["x" * 1025]),
    ],
)
def test_range_and_type_errors_name_the_field(field, value):
    with pytest.raises(ApiError) as err:
        completion(**{field: value})
    assert err.value.status == 400 and err.value.param is not None and err.value.param.split("[")[0] == field


def test_limits_that_are_allowed_decode():
    req = completion(top_k=INT32_MAX, seed=-(2**63), stop_token_ids=list(range(1024)), stop=["x" * 1024] * 16, max_tokens=INT32_MAX)
    assert req.top_k == INT32_MAX and req.seed == -(2**63)


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "max_tokens", "seed", "min_tokens"])
@pytest.mark.parametrize("number", [b"1e400", b"-1e400", b"1" + b"0" * 400, b"-1" + b"0" * 400])
def test_huge_json_numbers_are_a_400_naming_the_field(field, number):
    body = b'{"model": "m", "prompt": "hi", "%s": %s}' % (field.encode(), number)
    with pytest.raises(ApiError) as err:
        decode_request(body, CompletionRequest)
    assert err.value.status == 400 and err.value.param == field


@pytest.mark.parametrize("where", ["prompt", "unknown_field", "guided_json"])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(where):
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"model": "m", "prompt": "hi", "%s": %s}' % (where.encode(), deep)
    for on_unknown in (None, lambda name: None):
        with pytest.raises(ApiError) as err:
            decode_request(body, CompletionRequest, on_unknown)
        assert err.value.status == 400 and "nested too deeply" in err.value.message


def test_malformed_json_and_wrong_top_level():
    for body in (b"{", b"[]", b'"x"', b""):
        with pytest.raises(ApiError) as err:
            decode_request(body, CompletionRequest)
        assert err.value.status == 400


def test_unknown_fields_are_tolerated_and_reported():
    assert completion(logit_bias={}, frequency_penalty=0).prompt == "hi"
    heard = []
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1}}).encode()
    req = decode_request(body, CompletionRequest, heard.append)
    assert isinstance(req, CompletionRequest) and req.max_tokens == 2 and heard == ["frobnicate"]
    decode_request(json.dumps({"model": "m", "prompt": "hi"}).encode(), CompletionRequest, heard.append)
    assert heard == ["frobnicate"]  # nothing unknown, nothing heard
    # A bad known field is still the error, whichever comes first.
    for order in ({"zz": 1, "top_k": -5}, {"top_k": -5, "zz": 1}):
        with pytest.raises(ApiError) as err:
            decode_request(json.dumps({"model": "m", "prompt": "hi", **order}).encode(), CompletionRequest, heard.append)
        assert err.value.param == "top_k"


NULLS = {"n": None, "stream": None, "echo": None, "logprobs": None, "ignore_eos": None, "min_tokens": None, "stop": None,
         "stream_options": None, "temperature": None, "top_p": None, "top_k": None, "seed": None,
         "max_tokens": None, "suffix": None, "best_of": None, "presence_penalty": None, "frequency_penalty": None,
         "logit_bias": None, "user": None, "stop_token_ids": None}


def test_nullable_fields_accept_null_as_their_default():
    req = completion(**NULLS)
    check_unsupported(req)
    assert (req.stream, req.ignore_eos, req.min_tokens, req.stream_options) == (False, False, 0, None)
    assert completion(stream=True, stream_options={"include_usage": None}).stream_options.include_usage is False
    check_unsupported(completion(stream_options={}))  # vLLM's: only {} passes without a stream
    with pytest.raises(ApiError) as err:
        check_unsupported(completion(stream_options={"include_usage": None}))
    assert err.value.param == "stream_options"
    chat = decode_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": None, "name": None}], **NULLS, "logprobs": None,
        "top_logprobs": None, "max_completion_tokens": None, "add_generation_prompt": None, "tools": None,
        "tool_choice": None, "response_format": None, "echo": None, "suffix": None,
    }).encode(), ChatCompletionRequest)
    check_unsupported(chat)
    assert chat.add_generation_prompt is True and chat.stream is False


NON_DEFAULT = {
    "best_of": 3, "use_beam_search": True, "length_penalty": 0.5, "bad_words": ["x"],
}
CHAT_NON_DEFAULT = {
    "functions": [{"name": "f"}], "function_call": {"name": "f"},  # (tools and tool_choice are served: test_tool_parsers)
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "web_search_options": {},
}


def chat(**kw) -> ChatCompletionRequest:
    return decode_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode(), ChatCompletionRequest)


@pytest.mark.parametrize("field", sorted(NON_DEFAULT))
def test_known_but_unsupported_parameters_are_a_400_naming_them(field):
    with pytest.raises(ApiError) as err:
        check_unsupported(completion(**{field: NON_DEFAULT[field]}))
    assert err.value.status == 400 and err.value.param == field and "not supported" in err.value.message


@pytest.mark.parametrize("field", sorted(CHAT_NON_DEFAULT))
def test_known_but_unsupported_chat_parameters_are_a_400_naming_them(field):
    with pytest.raises(ApiError) as err:
        check_unsupported(chat(**{field: CHAT_NON_DEFAULT[field]}))
    assert err.value.status == 400 and err.value.param == field


def test_unsupported_parameters_at_their_default_are_accepted():
    assert set(NON_DEFAULT) | set(CHAT_NON_DEFAULT) == set(UNSUPPORTED)  # every entry has a refusal test
    defaults = {name: accepted[0] for name, accepted in UNSUPPORTED.items() if accepted}
    check_unsupported(chat(**defaults))
    check_unsupported(completion(**defaults))
    check_unsupported(chat(tool_choice="auto", tools=[], parallel_tool_calls=True))


def test_prompt_shapes():
    assert completion_prompt(completion(prompt="x")) == "x"
    assert completion_prompt(completion(prompt=[1, 2])) == [1, 2]
    assert completion_prompt(completion(prompt=["only one"])) == "only one"
    assert completion_prompt(completion(prompt=[[5, 6]])) == [5, 6]
    for bad in ([], ["a", "b"], [1, "a"], [{"x": 1}]):
        with pytest.raises(ApiError):
            completion_prompt(completion(prompt=bad))


def test_unsupported_parameters_are_refused_not_ignored():
    for kw in ({"best_of": 2}, {"use_beam_search": True}, {"stream_options": {"include_usage": True}}):
        with pytest.raises(ApiError):
            check_unsupported(completion(**kw))
    check_unsupported(completion(best_of=1))


def test_issue_14_parameters_take_the_extras_path_and_plain_requests_do_not():
    assert not uses_extras(completion(prompt="x", max_tokens=3, temperature=0.5, stop=["a"]))
    assert not uses_extras(completion(prompt=[[1, 2]]))
    assert not uses_extras(chat(max_tokens=3))
    for kw in ({"n": 2}, {"logprobs": 0}, {"echo": False}, {"max_tokens": 0}, {"prompt": ["a", "b"]},
               {"presence_penalty": 0.5}, {"logit_bias": {"5": 1}}, {"min_p": 0.1}, {"skip_special_tokens": False}):
        assert uses_extras(completion(**kw)), kw
    for kw in ({"logprobs": True}, {"top_logprobs": 2}, {"n": 3}, {"repetition_penalty": 1.1}):
        assert uses_extras(chat(**kw)), kw


def test_batched_prompts():
    assert completion_prompts(completion(prompt=["a", [5, 6]], n=2)) == ["a", [5, 6]]
    assert completion_prompts(completion(prompt="a")) == ["a"]
    for bad in (["a", 1], ["a", []], ["a", {"x": 1}]):
        with pytest.raises(ApiError) as err:
            completion_prompts(completion(prompt=bad))
        assert err.value.param == "prompt"
    with pytest.raises(ApiError):
        completion_prompts(completion(prompt=["a"] * 129, n=2))


def test_stop_strings():
    assert stop_strings(completion(stop="x")) == ["x"]
    assert stop_strings(completion(stop=["a", "", "b"])) == ["a", "b"]
    with pytest.raises(ApiError):
        stop_strings(completion(stop=[str(i) for i in range(17)]))


def test_text_part_without_text_names_the_missing_field():
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}])
    with pytest.raises(ApiError) as err:
        chat_messages(req)
    assert err.value.param == "messages[0].content[1].text"
    assert "without 'text'" in err.value.message and "not supported" not in err.value.message
    req = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ApiError) as err:
        chat_messages(req)
    assert err.value.param == "messages[0].content[0].type" and "not supported" in err.value.message


def test_chat_messages_join_text_parts_and_check_roles():
    req = decode_request(json.dumps({"model": "m", "messages": [
        {"role": "developer", "content": "be nice"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}).encode(), ChatCompletionRequest)
    assert chat_messages(req) == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "ab"}]
    custom = decode_request(json.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).encode(), ChatCompletionRequest)
    assert chat_messages(custom) == [{"role": "robot", "content": "x"}]  # vLLM hands custom roles to the template
    bad = decode_request(json.dumps({"model": "m", "messages": [{"role": "", "content": "x"}]}).encode(), ChatCompletionRequest)
    with pytest.raises(ApiError):
        chat_messages(bad)


@pytest.mark.parametrize("sent, read", [("true", True), ("TRUE", True), ("yes", True), ("on", True), ("1", True), (1, True),
                                        (1.0, True), ("false", False), ("No", False), ("off", False), ("0", False), (0, False)])
def test_bools_sent_as_strings_are_read_as_pydantic_does(sent, read):
    # vLLM's pydantic lax mode: its own test_chat_echo sends "logprobs": "true"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": sent}
    req = decode_request(json.dumps(body).encode(), ChatCompletionRequest, lambda name: None)
    assert req.logprobs is read


def test_lax_bools_loosen_nothing_else():
    # other bools, an int, a float, a nested bool stay strict; another field's error still names that field
    for extra, param in (({"max_tokens": "3"}, "max_tokens"), ({"temperature": "1"}, "temperature"), ({"echo": 2}, "echo"),
                         ({"stream": "true"}, "stream"), ({"use_beam_search": 0}, "use_beam_search"),
                         ({"stream_options": {"include_usage": "true"}, "stream": True}, "stream_options.include_usage"),
                         ({"logprobs": "true", "temperature": -1}, "temperature"), ({"logprobs": "true", "n": "2"}, "n")):
        with pytest.raises(ApiError) as err:
            decode_request(json.dumps({"model": "m", "messages": [], **extra}).encode(), ChatCompletionRequest)
        assert err.value.param == param, (extra, err.value.message)


@pytest.mark.parametrize("seed, words", [(2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")])
def test_range_errors_carry_pydantics_type_names(seed, words):
    # vLLM's test_long_seed looks for pydantic's names in the message; the param stays named
    with pytest.raises(ApiError) as err:
        completion(seed=seed)
    assert err.value.param == "seed" and f"[type={words}]" in err.value.message and "Expected `int`" in err.value.message


def test_logprob_token_ids_are_checked_as_vllm_does():
    from dpserve.daemons.api.request_checks import logprob_token_ids

    def chat(**kw):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
        return decode_request(json.dumps(body).encode(), ChatCompletionRequest)

    assert logprob_token_ids(chat(logprobs=True, logprob_token_ids=[5, 0]), 100, 20) == (5, 0)
    assert logprob_token_ids(chat(logprob_token_ids=[]), 100, 20) == ()
    assert logprob_token_ids(completion(logprobs=0, logprob_token_ids=[1]), 100, 20) == (1,)
    for req, max_logprobs, words in ((chat(logprob_token_ids=[5]), 20, "must be set to true"),
                                     (completion(logprob_token_ids=[5]), 20, "must be set"),
                                     (completion(logprobs=1, echo=True, max_tokens=0, logprob_token_ids=[5]), 20, "no output tokens"),
                                     (chat(logprobs=True, logprob_token_ids=[5, 100, -1]), 20, "[100, -1]"),
                                     (chat(logprobs=True, logprob_token_ids=list(range(21))), 20, "max allowed: 20"),
                                     (chat(logprobs=True, logprob_token_ids=list(range(101))), -1, "max allowed: 100")):
        with pytest.raises(ApiError) as err:
            logprob_token_ids(req, 100, max_logprobs)
        assert err.value.param == "logprob_token_ids" and words in err.value.message


def test_the_published_lax_bool_forms_are_exactly_those_accepted():
    # schemathesis's negative cases must never be accepted: the OpenAPI document states the lax forms
    import re

    from dpserve.daemons.api.lax_decode import lax_bool, lax_bool_schemas

    text, number = lax_bool_schemas()
    pattern = re.compile(text["pattern"])
    for value in ("true", "TrUe", "yes", "Y", "on", "1", "0", "off", "no", "f", "maybe", " true", "truee", "", "10", "tru"):
        assert (pattern.fullmatch(value) is not None) == (lax_bool(value) is not None), value
    assert [v for v in (0, 1, 2, -1) if lax_bool(v) is not None] == number["enum"]
