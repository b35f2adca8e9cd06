"""vLLM's current API on a real node, through the openai client where it has the call:
the utility endpoints (/tokenize, /detokenize, /tokenizer_info, /v1/models, /load,
/invocations), and the request fields of vLLM 0.32's OpenAI entrypoint
(structured_outputs, allowed_token_ids, -1 logprobs, return_token_ids, ...).
One server (DP=2, two API servers) for the whole module."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.integration.conftest import API_KEY  # (conftest's `client` fixture speaks to this module's server)
from tests.server import DpServer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(demo_model_dir):
    with DpServer(
        demo_model_dir,
        "--data-parallel-size", "2",
        "--api-server-count", "2",
        "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "32",
        "--max-logprobs", "-1",
        "--enable-server-load-tracking",
        "--enable-tokenizer-info-endpoint",
        "--api-server-launch", "exec",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from dpserve.daemons.api.tokenizer import TextTokenizer

    return TextTokenizer.from_dir(demo_model_dir)


def call(server, path: str, body: dict | None = None, key: bool = False) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {API_KEY}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def bad_request(client, param: str, create, **kwargs) -> str:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        create(model="demo", **kwargs)
    assert info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


# ------------------------------------------------------------------ part 4: utility endpoints


def test_tokenize_and_detokenize_round_trip_a_prompt(server, tokenizer):
    status, got = call(server, "/tokenize", {"model": "demo", "prompt": "hello world", "return_token_strs": True})
    ids = tokenizer.encode("hello world")
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == MAX_MODEL_LEN
    assert got["token_strs"] == tokenizer.token_strs(ids) and len(got["token_strs"]) == len(ids)
    status, plain = call(server, "/tokenize", {"model": "demo", "prompt": "hello world", "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode("hello world", add_special_tokens=False) and plain["token_strs"] is None
    status, back = call(server, "/detokenize", {"model": "demo", "tokens": plain["tokens"]})
    assert status == 200 and back == {"prompt": "hello world"}


def test_tokenize_messages_gives_the_ids_a_chat_completion_is_charged_for(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    status, got = call(server, "/tokenize", {"model": "demo", "messages": messages})
    answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=1)
    assert status == 200 and got["count"] == answer.usage.prompt_tokens
    status, cont = call(server, "/tokenize", {"model": "demo", "add_generation_prompt": False, "continue_final_message": True,
                                              "messages": [*messages, {"role": "assistant", "content": "Sure, the"}]})
    _, back = call(server, "/detokenize", {"model": "demo", "tokens": cont["tokens"]})
    assert status == 200 and back["prompt"].endswith("<|im_start|>assistant\nSure, the")


def test_tokenize_errors_name_the_field(server):
    assert call(server, "/tokenize", {"model": "demo"})[0] == 400
    status, err = call(server, "/tokenize", {"model": "demo", "prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert status == 400 and err["error"]["param"] in ("prompt", "messages")
    status, err = call(server, "/detokenize", {"model": "demo", "tokens": [1, 5000, 7000]})
    assert status == 400 and err["error"]["param"] == "tokens" and "[5000, 7000]" in err["error"]["message"]
    assert "out-of-vocab" in err["error"]["message"]
    assert call(server, "/tokenize", {"model": "other", "prompt": "a"})[0] == 404


def test_tokenizer_info_models_and_load(server, client, demo_model_dir):
    status, info = call(server, "/tokenizer_info")
    assert status == 200 and info["tokenizer_class"] and "<|im_start|>" in info["chat_template"]
    assert not any(k in info for k in ("vocab_file", "merges_file", "tokenizer_file"))
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"] and models[0].root == demo_model_dir
    status, load = call(server, "/load")
    assert status == 200 and load["server_load"] >= 0


def test_invocations_serves_chat_and_completion_bodies(server):
    assert call(server, "/invocations", {"model": "demo", "prompt": "hi", "max_tokens": 2})[0] == 401
    status, comp = call(server, "/invocations", {"model": "demo", "prompt": "hi", "max_tokens": 2}, key=True)
    assert status == 200 and comp["object"] == "text_completion"
    status, chat = call(server, "/invocations", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, key=True)
    assert status == 200 and chat["object"] == "chat.completion"
    status, err = call(server, "/invocations", {"model": "demo", "input": "hi"}, key=True)
    assert status == 400 and "Cannot find suitable handler" in err["error"]["message"]


def test_batch_chat_answers_each_conversation_in_its_choice(server, client):
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]]
    status, got = call(server, "/v1/chat/completions/batch", {"model": "demo", "messages": conversations, "max_tokens": 3,
                                                             "temperature": 0}, key=True)
    assert status == 200 and [c["index"] for c in got["choices"]] == [0, 1], got
    for i, conversation in enumerate(conversations):  # each choice is what the conversation alone answers
        alone = client.chat.completions.create(model="demo", messages=conversation, max_tokens=3, temperature=0)
        assert got["choices"][i]["message"]["content"] == alone.choices[0].message.content
    status, err = call(server, "/v1/chat/completions/batch", {"model": "demo", "messages": conversations, "stream": True}, key=True)
    assert status == 400 and err["error"]["param"] == "stream"


def test_max_completion_tokens_and_continuous_usage_stats(client):
    answer = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "count"}],
                                            max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
    for kind in ("chat", "completions"):
        kwargs = dict(model="demo", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True},
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
        if kind == "chat":
            chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "go"}], **kwargs))
        else:
            chunks = list(client.completions.create(prompt="go on", **kwargs))
        assert all(c.usage is not None for c in chunks), kind
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 6, (kind, counts)
        assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_suffix_needs_fill_in_the_middle_tokens(client):
    message = bad_request(client, "suffix", client.completions.create, prompt="def f(", suffix="return x", max_tokens=4)
    assert "FIM" in message


# ------------------------------------------------------------------ part 6: vLLM's request API


def test_structured_outputs_and_guided_aliases(client):
    for extra in ({"structured_outputs": {"choice": ["red", "green"]}}, {"guided_choice": ["red", "green"]}):
        got = client.completions.create(model="demo", prompt="color:", max_tokens=5, extra_body=extra)
        assert got.choices[0].text in ("red", "green")
    got = client.completions.create(model="demo", prompt="n:", max_tokens=6, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", got.choices[0].text)
    grammar = 'root ::= "SELECT " col " FROM t"\ncol ::= "a" | "b"'
    got = client.completions.create(model="demo", prompt="sql:", max_tokens=20, extra_body={"structured_outputs": {"grammar": grammar}})
    assert got.choices[0].text in ("SELECT a FROM t", "SELECT b FROM t")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    got = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "json"}], max_tokens=40, temperature=1.0, seed=3,
                                         extra_body={"structured_outputs": {"json": schema}})
    if got.choices[0].finish_reason == "stop":
        assert set(json.loads(got.choices[0].message.content)) == {"name"}  # no other keys: strict, as vLLM
    bad_request(client, "structured_outputs", client.completions.create, prompt="x", max_tokens=2,
                extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})


def test_allowed_token_ids_restrict_every_token(client, tokenizer):
    allowed = tokenizer.encode(" the of and", add_special_tokens=False)
    got = client.completions.create(model="demo", prompt="hello", max_tokens=12, temperature=1.0, seed=1,
                                    extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True})
    ids = got.choices[0].token_ids
    assert ids and set(ids) <= set(allowed), ids
    message = bad_request(client, "allowed_token_ids", client.completions.create, prompt="x", max_tokens=2,
                          extra_body={"allowed_token_ids": [3, 99999]})
    assert "[99999]" in message and "Vocabulary size" in message


def test_logprobs_of_the_whole_vocabulary_and_the_chosen_token_first(client, tokenizer):
    got = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=1.0, seed=5,
                                         logprobs=True, top_logprobs=-1)
    for pos in got.choices[0].logprobs.content:
        assert len(pos.top_logprobs) == tokenizer.vocab_size
        assert pos.top_logprobs[0].token == pos.token and pos.top_logprobs[0].logprob == pos.logprob
    got = client.completions.create(model="demo", prompt="hello there", max_tokens=1, extra_body={"prompt_logprobs": -1})
    assert all(len(entry) >= tokenizer.vocab_size for entry in got.choices[0].prompt_logprobs[1:])


def test_token_ids_as_ids_and_truncation(client, tokenizer):
    prompt = "one two three four five six"
    ids = tokenizer.encode(prompt)
    got = client.completions.create(model="demo", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                    extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "truncate_prompt_tokens": 4})
    choice = got.choices[0]
    assert choice.prompt_token_ids == ids[-4:] and got.usage.prompt_tokens == 4
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids[: len(choice.logprobs.tokens)]]
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"return_token_ids": True})
    assert chat.prompt_token_ids and len(chat.prompt_token_ids) == chat.usage.prompt_tokens and chat.choices[0].token_ids


def test_streamed_token_ids_add_up_and_match_the_logprobs(client, tokenizer):
    stream = client.completions.create(model="demo", prompt="tell me", max_tokens=8, temperature=0, stream=True, logprobs=1,
                                       extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].prompt_token_ids == tokenizer.encode("tell me")
    streamed = [t for c in chunks for t in c.choices[0].token_ids]
    from_logprobs = [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]
    assert len(streamed) == 8 and streamed == from_logprobs
    chat = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                                               extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chat[0].prompt_token_ids and all(getattr(c, "prompt_token_ids", None) is None for c in chat[1:])
    assert len([t for c in chat if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]) == 4


def test_vllm_fields_are_always_sent(server):
    status, comp = call(server, "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2}, key=True)
    assert status == 200 and comp["choices"][0]["prompt_logprobs"] is None and comp["choices"][0]["prompt_token_ids"] is None
    status, chat = call(server, "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, key=True)
    assert status == 200 and chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None


def test_custom_roles_reach_the_template(server):
    messages = [{"role": "observer", "content": "noted"}, {"role": "user", "content": "hi"}]
    status, got = call(server, "/tokenize", {"model": "demo", "messages": messages})
    _, text = call(server, "/detokenize", {"model": "demo", "tokens": got["tokens"]})
    assert status == 200 and "<|im_start|>observer\nnoted" in text["prompt"]


def test_chat_echo_continues_the_final_assistant_message(client):
    msgs = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    got = client.chat.completions.create(model="demo", messages=msgs, max_tokens=3, temperature=0, extra_body=extra)
    plain = client.chat.completions.create(model="demo", messages=msgs, max_tokens=3, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert got.choices[0].message.content == "one two" + plain.choices[0].message.content
    streamed = client.chat.completions.create(model="demo", messages=msgs, max_tokens=3, temperature=0, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == got.choices[0].message.content


def test_vllm_errors(client):
    chat = client.chat.completions.create
    msgs = [{"role": "user", "content": "hi"}]
    assert "beam search" in bad_request(client, "use_beam_search", chat, messages=msgs, extra_body={"use_beam_search": True})
    assert "stream=True" in bad_request(client, "stream_options", chat, messages=msgs, stream_options={"include_usage": True})
    message = bad_request(client, "logit_bias", chat, messages=msgs, logit_bias={"5": 1, "70000": 2, "x": 1})
    assert "70000" in message and "'x'" in message
    assert "out of vocabulary" in bad_request(client, "prompt", client.completions.create, prompt=[1, 2, 99999])


def test_echoed_special_tokens_agree_with_offsets(client, tokenizer):
    # vLLM's: a token-id prompt echoes as its decode with special tokens' text, and logprobs show them so
    got = client.completions.create(model="demo", prompt=[0, 0, 0], echo=True, max_tokens=1, logprobs=0, temperature=0)
    lp = got.choices[0].logprobs
    text = got.choices[0].text
    assert text.startswith(tokenizer.decode([0, 0, 0], skip_special_tokens=False)) and lp.tokens[0] == tokenizer.decode([0], False)
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    got = client.completions.create(model="demo", prompt="hello there", echo=True, max_tokens=1, logprobs=0, temperature=0)
    text, lp = got.choices[0].text, got.choices[0].logprobs
    assert text.startswith("hello there") and [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_logprob_token_ids_report_the_listed_ids(client, tokenizer):
    # vLLM's logprob_token_ids: the chosen token, then exactly the listed ones, at every position
    msgs = [{"role": "user", "content": "hi"}]
    listed = [5, 100, 1000]
    body = {"logprob_token_ids": listed, "return_tokens_as_token_ids": True}
    got = client.chat.completions.create(model="demo", messages=msgs, max_tokens=3, temperature=0, logprobs=True, top_logprobs=1,
                                         extra_body=body)
    for pos in got.choices[0].logprobs.content:
        ids = [int(t.token.removeprefix("token_id:")) for t in pos.top_logprobs]
        chosen = int(pos.token.removeprefix("token_id:"))
        assert ids[0] == chosen and set(ids) == {chosen, *listed} and len(ids) == len(set(ids))
    streamed = client.chat.completions.create(model="demo", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                              stream=True, extra_body=body)
    chunks = [pos for chunk in streamed if chunk.choices and chunk.choices[0].logprobs for pos in chunk.choices[0].logprobs.content]
    assert [[t.token for t in pos.top_logprobs] for pos in chunks] == [[t.token for t in pos.top_logprobs] for pos in got.choices[0].logprobs.content]
    got = client.completions.create(model="demo", prompt="hello", max_tokens=2, temperature=0, logprobs=0,
                                    extra_body={"logprob_token_ids": listed})
    for token, tops in zip(got.choices[0].logprobs.tokens, got.choices[0].logprobs.top_logprobs):
        assert set(tops) == {token, *(tokenizer.decode([i]) for i in listed)}
    assert "[99999]" in bad_request(client, "logprob_token_ids", client.chat.completions.create, messages=msgs, logprobs=True,
                                    extra_body={"logprob_token_ids": [5, 99999]})
    bad_request(client, "logprob_token_ids", client.chat.completions.create, messages=msgs, extra_body={"logprob_token_ids": [5]})


# ------------------------------------------------------------------ part 5: vLLM's request metrics


def scrape_metrics(server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:  # a new connection: either API server
        return resp.read().decode()


def metric_total(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and 'model_name="demo"' in line)


def test_every_series_of_vllms_dashboard_is_served_and_summed_over_the_api_servers(server, client):
    import time
    from pathlib import Path

    names = [line for line in (Path(__file__).parents[1] / "data" / "vllm_grafana_metrics.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    time.sleep(1.2)  # every API server has saved its totals since the last request
    before = metric_total(scrape_metrics(server), "vllm:prompt_tokens_total")
    prompt_tokens = 0
    for i in range(6):
        got = client.completions.create(model="demo", prompt=f"metrics {i}", max_tokens=4, temperature=0)
        prompt_tokens += got.usage.prompt_tokens
    time.sleep(1.2)
    scrapes = [scrape_metrics(server) for _ in range(6)]
    for text in scrapes:
        missing = [n for n in names if not re.search(rf'^{re.escape(n)}\{{[^}}]*model_name="demo"', text, re.M)]
        assert not missing, missing
        # whichever API server answers, the node's sum: this test's prompts exactly on top of before
        assert metric_total(text, "vllm:prompt_tokens_total") - before == prompt_tokens
        assert metric_total(text, "vllm:e2e_request_latency_seconds_count") >= 6
