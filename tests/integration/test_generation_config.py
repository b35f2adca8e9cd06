"""vLLM's --generation-config on a real node: a model whose generation_config.json recommends
sampling values gets them for every request that leaves them unset (chat's max_tokens from its
max_new_tokens), a request's own values win, and a value no request could send stops the start
with a configuration error naming it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.server import DpServer

pytestmark = pytest.mark.slow

RECOMMENDED = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def recommending_model(demo_model_dir, tmp_path_factory) -> str:
    """The demo model with its maker's recommended sampling in generation_config.json."""
    d = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(demo_model_dir, d)
    path = d / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **RECOMMENDED}))
    return str(d)


@pytest.fixture(scope="module")
def client(recommending_model):
    import openai

    with DpServer(recommending_model, "--data-parallel-size", "1", "--api-server-count", "1",
                  "--max-model-len", "256", "--dtype", "float32") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def chat(client, **extra):
    return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hello there"}],
                                          extra_body={"ignore_eos": True, **extra.pop("extra_body", {})}, **extra)


def test_unset_fields_take_the_models_recommended_values(client):
    plain = chat(client)
    assert plain.usage.completion_tokens == 6 and plain.choices[0].finish_reason == "length"  # max_new_tokens
    explicit = chat(client, temperature=0.0, max_tokens=6, extra_body={"repetition_penalty": 1.3})
    assert plain.choices[0].message.content == explicit.choices[0].message.content  # greedy, penalised
    assert chat(client).choices[0].message.content == plain.choices[0].message.content


def test_a_requests_own_values_win(client):
    longer = chat(client, max_tokens=9)
    assert longer.usage.completion_tokens == 9
    sampled = [chat(client, temperature=1.0, seed=s).choices[0].message.content for s in (1, 2, 3)]
    assert len(set(sampled)) > 1  # temperature 1 samples, where the default is greedy
    # completions keep vLLM's max_tokens of 16: max_new_tokens is chat's default only, as in vLLM
    done = client.completions.create(model="demo", prompt="hello", extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16


def test_a_value_no_request_could_send_stops_the_start(recommending_model):
    proc = subprocess.run(
        [sys.executable, "-m", "dpserve.daemons.cli.main", "serve", recommending_model, "--port", "0",
         "--data-parallel-supervisor-port", "0", "--override-generation-config", '{"top_p": 1.5}'],
        capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "--override-generation-config" in err and "top_p" in err, err
