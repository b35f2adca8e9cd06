"""--generation-config / --override-generation-config read as vLLM reads them: the model's
recommended sampling values (auto), the neutral ones (vllm) or another directory's, the override
over either; a value a request could not send is refused, naming where it came from."""

from __future__ import annotations

import json

import pytest
from dpserve.daemons.api.sampling_defaults import NEUTRAL, load


def model(tmp_path, name: str = "m", **config) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2], **config}))
    return str(d)


def test_auto_takes_the_models_sampling_fields_and_nothing_else(tmp_path):
    d = model(tmp_path, temperature=0.6, top_p=0.9, top_k=20, do_sample=True, max_new_tokens=512, min_p=None)
    got = load(d, "auto")
    assert got.differences() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 512}
    assert not got.needs_processors  # truncation and temperature ride the plain path
    assert load(d, "vllm") == NEUTRAL


def test_a_model_without_the_file_or_the_fields_has_the_neutral_defaults(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    assert load(str(bare), "auto") == NEUTRAL
    assert load(model(tmp_path), "auto") == NEUTRAL


def test_a_directory_replaces_the_models_file_and_the_override_goes_over_it(tmp_path):
    d = model(tmp_path, temperature=0.6)
    other = model(tmp_path, "other", temperature=0.2, repetition_penalty=1.1)
    got = load(d, other, '{"top_k": 5, "repetition_penalty": 1.05}')
    assert got.differences() == {"temperature": 0.2, "top_k": 5, "repetition_penalty": 1.05}
    assert got.needs_processors  # a penalty every request pays
    assert load(d, "vllm", '{"max_new_tokens": 7}').differences() == {"max_new_tokens": 7}
    assert load(d, "auto", "  ") == load(d, "auto")


@pytest.mark.parametrize("source, override, words", [
    ("auto", '{"temperature": -1}', "--override-generation-config"),
    ("auto", '{"top_p": 0}', "top_p"),
    ("auto", '{"temperatur": 0.5}', "unknown field(s) temperatur"),
    ("auto", "[0.5]", "must be a JSON object"),
    ("auto", "{temperature: 1}", "is not JSON"),
    ("/no/such/dir", "", "not auto, vllm or a directory"),
])
def test_values_a_request_could_not_send_are_refused_by_name(tmp_path, source, override, words):
    with pytest.raises(ValueError, match=None) as info:
        load(model(tmp_path), source, override)
    assert words in str(info.value), info.value


def test_a_bad_value_in_the_models_file_names_the_file(tmp_path):
    d = model(tmp_path, repetition_penalty=0.0)
    with pytest.raises(ValueError) as info:
        load(d, "auto")
    assert "generation_config.json" in str(info.value) and "repetition_penalty" in str(info.value)
    assert load(d, "vllm") == NEUTRAL  # the operator's way out
    (tmp_path / "m" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="--generation-config vllm"):
        load(d, "auto")
