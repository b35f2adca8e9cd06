"""Request decoding and validation: every bad input is a 400 naming the field."""

from __future__ import annotations

import json

import pytest
from dpserve.daemons.openai_types import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_unsupported,
    completion_prompt,
    decode_request,
    stop_strings,
)


def completion(**kw) -> CompletionRequest:
    return decode_request(json.dumps({"model": "m", "prompt": "hi", **kw}).encode(), CompletionRequest)


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 0), ("max_tokens", "3"), ("temperature", -1), ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("n", 0), ("stream", "yes")],
)
def test_range_and_type_errors_name_the_field(field, value):
    with pytest.raises(ApiError) as err:
        completion(**{field: value})
    assert err.value.status == 400 and err.value.param == field


def test_malformed_json_and_wrong_top_level():
    for body in (b"{", b"[]", b'"x"', b""):
        with pytest.raises(ApiError) as err:
            decode_request(body, CompletionRequest)
        assert err.value.status == 400


def test_unknown_fields_are_tolerated():
    assert completion(logit_bias={}, frequency_penalty=0).prompt == "hi"


def test_prompt_shapes():
    assert completion_prompt(completion(prompt="x")) == "x"
    assert completion_prompt(completion(prompt=[1, 2])) == [1, 2]
    assert completion_prompt(completion(prompt=["only one"])) == "only one"
    assert completion_prompt(completion(prompt=[[5, 6]])) == [5, 6]
    for bad in ([], ["a", "b"], [1, "a"], [{"x": 1}]):
        with pytest.raises(ApiError):
            completion_prompt(completion(prompt=bad))


def test_unsupported_parameters_are_refused_not_ignored():
    for kw in ({"n": 2}, {"presence_penalty": 0.5}, {"echo": True}, {"logprobs": 3}):
        with pytest.raises(ApiError):
            check_unsupported(completion(**kw))
    check_unsupported(completion(presence_penalty=0))


def test_stop_strings():
    assert stop_strings(completion(stop="x")) == ["x"]
    assert stop_strings(completion(stop=["a", "", "b"])) == ["a", "b"]
    with pytest.raises(ApiError):
        stop_strings(completion(stop=[str(i) for i in range(17)]))


def test_chat_messages_join_text_parts_and_check_roles():
    req = decode_request(json.dumps({"model": "m", "messages": [
        {"role": "developer", "content": "be nice"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}).encode(), ChatCompletionRequest)
    assert chat_messages(req) == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "ab"}]
    bad = decode_request(json.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).encode(), ChatCompletionRequest)
    with pytest.raises(ApiError):
        chat_messages(bad)
