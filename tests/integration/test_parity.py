"""Issue 14's parameters on a real DP=2 node through the official openai client:
n, batched prompts, logprobs (checked against transformers' own logits), echo and
prompt scoring, penalties, min_p, logit_bias, include_stop_str_in_output,
skip_special_tokens, and the 400s for what is not supported."""

from __future__ import annotations

import json
import math
import urllib.request

import openai
import pytest

from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"


def post(server, path: str, payload: dict, headers: dict | None = None):
    """(status, parsed JSON or SSE events, headers)."""
    hdrs = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(server.url + path, data=json.dumps(payload).encode(), headers=hdrs, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, data, rh = resp.status, resp.read().decode(), resp.headers
    except urllib.error.HTTPError as exc:
        status, data, rh = exc.code, exc.read().decode(), exc.headers
    if payload.get("stream") and status == 200:
        events = [line[len("data: "):] for line in data.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return status, [json.loads(e) for e in events[:-1]], rh
    return status, json.loads(data), rh


@pytest.fixture(scope="module")
def hf(demo_model_dir):
    """transformers' model and the tokenizer, for reference logprobs."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    return model, Tokenizer.from_file(f"{demo_model_dir}/tokenizer.json")


def reference_logprobs(hf, ids: list[int]):
    """log-softmax of the model's logits over `ids`: row p scores token p + 1."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), -1)


def joined_stream(events: list[dict], key: str = "text") -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c[key] if key == "text" else c["delta"].get("content") or ""
            out[c["index"]] = out.get(c["index"], "") + piece
    return out


# ------------------------------------------------------------------ n and batched prompts


def test_n_choices_are_indexed_and_each_reproduces_with_its_own_seed(client):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    got = client.completions.create(n=3, **kw)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert got.usage.prompt_tokens == client.completions.create(**kw).usage.prompt_tokens  # counted once per prompt
    assert got.usage.completion_tokens == 3 * 8
    again = client.completions.create(n=3, **kw)
    assert [c.text for c in again.choices] == [c.text for c in got.choices]
    # Choice j samples with seed + j (vLLM's rule), so it can be replayed alone.
    for j in range(3):
        alone = client.completions.create(**{**kw, "seed": 1234 + j})
        assert alone.choices[0].text == got.choices[j].text
    assert len({c.text for c in got.choices}) > 1


def test_n_streamed_equals_not_streamed(server):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 7, "n": 2}
    _, whole, _ = post(server, "/v1/completions", body)
    status, events, _ = post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert joined_stream(events[:-1]) == {c["index"]: c["text"] for c in whole["choices"]}
    finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_chat_n_streamed_and_not(client, server):
    msgs = [{"role": "user", "content": "Say something."}]
    got = client.chat.completions.create(model="demo", messages=msgs, max_tokens=6, n=2, temperature=0.0)
    assert [c.index for c in got.choices] == [0, 1]
    assert got.choices[0].message.content == got.choices[1].message.content  # greedy
    stream = client.chat.completions.create(model="demo", messages=msgs, max_tokens=6, n=2, temperature=0.0, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: got.choices[0].message.content, 1: got.choices[1].message.content}


def test_batched_prompts_index_prompt_times_n(client):
    prompts = ["Hello there", "A second prompt"]
    got = client.completions.create(model="demo", prompt=prompts, n=2, max_tokens=5, temperature=0.0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        alone = client.completions.create(model="demo", prompt=p, max_tokens=5, temperature=0.0).choices[0].text
        assert got.choices[2 * i].text == got.choices[2 * i + 1].text == alone
    ids = client.completions.create(model="demo", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0.0)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


# ------------------------------------------------------------------ logprobs


def test_completion_logprobs_match_transformers(client, server, hf, openai_schema):
    model, tok = hf
    ids = tok.encode(PROMPT).ids
    got = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0.0, logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    # Greedy: each chosen token is the most likely, and its value the model's maximum.
    full = list(ids)
    for k in range(6):
        ref = reference_logprobs(hf, full)[-1]
        best = int(ref.argmax())
        assert math.isclose(lp.token_logprobs[k], ref[best].item(), abs_tol=1e-4)
        assert sorted(lp.top_logprobs[k].values(), reverse=True)[:3] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-4)
        assert lp.tokens[k] == tok.decode([best], skip_special_tokens=False)
        full.append(best)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(6)]
    _, body, _ = post(server, "/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 3, "logprobs": 2})
    openai_schema(body, "CreateCompletionResponse")


def test_sampled_logprobs_follow_the_temperature(client, hf):
    model, tok = hf
    ids = tok.encode(PROMPT).ids
    got = client.completions.create(model="demo", prompt=ids, max_tokens=1, temperature=0.5, seed=3, logprobs=0,
                                    extra_body={"return_token_ids": True})
    lp = got.choices[0].logprobs
    (token, value), = lp.top_logprobs[0].items()  # logprobs=0: only the chosen token
    ref = (reference_logprobs(hf, ids)[-1] * 2).log_softmax(-1)  # logits / 0.5
    token_id, = got.choices[0].token_ids  # by id: two tokens may share a text (byte fallbacks)
    assert tok.decode([token_id], skip_special_tokens=False) == token
    assert math.isclose(value, ref[token_id].item(), abs_tol=1e-4) and lp.token_logprobs[0] == value


def assert_same_up_to_rounding(got, want, path: str = "") -> None:
    """got == want, except that floats (logprobs) need only agree to 1e-5: two requests of one greedy prompt
    can share a rank's step with different neighbours, and a float32 GEMM's rounding follows the batch."""
    if isinstance(want, float) or isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5), (path, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, got, want)
        for k in want:
            assert_same_up_to_rounding(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_up_to_rounding(g, w, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)


def test_chat_logprobs_shape_streamed_and_not(client, server, openai_schema):
    msgs = [{"role": "user", "content": "Tell me a story."}]
    body = {"model": "demo", "messages": msgs, "max_tokens": 5, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    _, whole, _ = post(server, "/v1/chat/completions", body)
    openai_schema(whole, "CreateChatCompletionResponse")
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1 and all(len(c["top_logprobs"]) == 2 for c in content)
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and c["top_logprobs"][0]["logprob"] == c["logprob"]  # greedy
    _, events, _ = post(server, "/v1/chat/completions", {**body, "stream": True})
    for e in events:
        openai_schema(e, "CreateChatCompletionStreamResponse")
    streamed = [c for e in events for ch in e["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
    assert_same_up_to_rounding(streamed, content)
    sdk = client.chat.completions.create(model="demo", messages=msgs, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2)
    assert [c.token for c in sdk.choices[0].logprobs.content] == [c["token"] for c in content]


def test_streamed_completion_logprobs_equal_the_whole(server):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 2}
    _, whole, _ = post(server, "/v1/completions", body)
    _, events, _ = post(server, "/v1/completions", {**body, "stream": True})
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for c in e["choices"]:
            if c["logprobs"]:
                for key in merged:
                    merged[key] += c["logprobs"][key]
    assert_same_up_to_rounding(merged, whole["choices"][0]["logprobs"])


# ------------------------------------------------------------------ echo and prompt scoring


def test_echo_with_max_tokens_0_scores_the_prompt_like_transformers(client, server, hf):
    """What lm-evaluation-harness's loglikelihood requests do."""
    model, tok = hf
    ids = tok.encode(PROMPT).ids
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0.0)
    choice = got.choices[0]
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    ref = reference_logprobs(hf, ids)
    for p in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[p], ref[p - 1, ids[p]].item(), abs_tol=1e-4), p
    status, events, _ = post(server, "/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True})
    assert status == 200 and "".join(c["text"] for e in events for c in e["choices"]) == choice.text
    streamed = [v for e in events for c in e["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == lp.token_logprobs


def test_echo_prepends_the_prompt_and_prompt_logprobs_is_vllms_shape(client, hf):
    model, tok = hf
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0.0).choices[0].text
    echoed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0.0, extra_body={"prompt_logprobs": 2})
    scored = got.choices[0].model_extra["prompt_logprobs"]
    ids = tok.encode(PROMPT).ids
    ref = reference_logprobs(hf, ids)
    assert scored[0] is None and len(scored) == len(ids)
    for p in range(1, len(ids)):
        entry = scored[p][str(ids[p])]
        assert math.isclose(entry["logprob"], ref[p - 1, ids[p]].item(), abs_tol=1e-4)
        assert entry["rank"] >= 1 and 2 <= len(scored[p]) <= 3


# ------------------------------------------------------------------ processors


def greedy_ids(client, hf, **extra) -> list[int]:
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=0,
                                    extra_body={"ignore_eos": True, **extra.pop("extra_body", {})}, **extra)
    tokens = got.choices[0].logprobs.tokens
    vocab = {hf[1].decode([i], skip_special_tokens=False): i for i in range(hf[1].get_vocab_size())}
    return [vocab[t] for t in tokens]


def unique_text_ids(hf, count: int) -> list[int]:
    """Ids whose one-token text no other id shares (so logprobs' tokens name them)."""
    tok = hf[1]
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]
    return [i for i in range(300, len(texts)) if texts.count(texts[i]) == 1][:count]


def reference_greedy(hf, bias: dict[int, float], rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> list[int]:
    """Greedy decoding over transformers' logits with vLLM's bias and penalties, written out."""
    prompt = hf[1].encode(PROMPT).ids
    out: list[int] = []
    for _ in range(12):
        logits = reference_logprobs(hf, prompt + out)[-1].clone()  # log-softmax only shifts a row
        for token, value in bias.items():
            logits[token] += value
        for token in set(prompt + out):
            logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
        for token in set(out):
            logits[token] -= freq * out.count(token) + pres
        out.append(int(logits.argmax()))
    return out


def test_logit_bias_and_penalties_steer_greedy_decoding_as_vllm_defines(client, hf):
    a, b = unique_text_ids(hf, 2)
    assert set(greedy_ids(client, hf, logit_bias={str(a): 100})) == {a}
    both = {str(a): 100, str(b): 100}
    cases = [
        (dict(logit_bias=both), dict()),
        (dict(logit_bias=both, extra_body={"repetition_penalty": 2.0}), dict(rep=2.0)),
        (dict(logit_bias=both, frequency_penalty=2.0), dict(freq=2.0)),
        (dict(logit_bias=both, presence_penalty=1.5), dict(pres=1.5)),
        (dict(extra_body={"repetition_penalty": 1.5}), dict(rep=1.5)),
    ]
    seen = []
    for request, penalties in cases:
        bias = {int(k): v for k, v in request.get("logit_bias", {}).items()}
        got = greedy_ids(client, hf, **request)
        assert got == reference_greedy(hf, bias, **penalties), request
        seen.append(got)
    assert len({tuple(x) for x in seen}) >= 3  # the penalties changed the answers


def test_min_p_1_samples_the_greedy_answer(client):
    greedy = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0.0).choices[0].text
    for seed in (1, 2):
        got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, extra_body={"min_p": 1.0})
        assert got.choices[0].text == greedy


def test_include_stop_str_in_output(client):
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}).choices[0].text
    stop = plain[4:7]
    assert stop and stop in plain
    cut = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop], extra_body={"ignore_eos": True})
    kept = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop == plain[: plain.index(stop)] + stop
    assert kept.choices[0].finish_reason == "stop"


def test_skip_special_tokens_false_shows_special_tokens(client, hf):
    im_start = hf[1].token_to_id("<|im_start|>")
    kw = dict(model="demo", prompt=PROMPT, max_tokens=3, temperature=0.0, logit_bias={str(im_start): 100})
    assert client.completions.create(**kw).choices[0].text == ""
    shown = client.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0].text
    assert shown == "<|im_start|>" * 3


def test_pinned_n_choices_all_run_on_the_pinned_rank(server):
    for rank in (0, 1):
        status, body, headers = post(server, "/v1/completions", {"model": "demo", "prompt": "pin", "max_tokens": 2, "n": 3}, {"X-data-parallel-rank": str(rank)})
        assert status == 200 and headers["X-data-parallel-rank"] == str(rank) and len(body["choices"]) == 3


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 129}, "n"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"min_p": 1.5}, "min_p"),
        ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": ["ok", 5]}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", []]}, "prompt"),
        ("/v1/completions", {"prompt": ["p"] * 100, "n": 3}, "prompt"),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ("/v1/completions", {"guided_regex": "a("}, "guided_regex"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/completions", {"guided_grammar": "start: a"}, "guided_grammar"),
        ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto: off here
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "none"}, "tools[0].function.name"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ],
)
def test_bad_values_get_a_400_naming_the_parameter(server, path, extra, param):
    base = {"model": "demo", "max_tokens": 2}
    base.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    status, body, _ = post(server, path, {**base, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param, body
    if param == "tool_choice":  # vLLM's messages
        assert "--enable-auto-tool-choice" in body["error"]["message"] or "`tools` must be set" in body["error"]["message"]
    if param == "guided_grammar":
        assert "cannot be followed" in body["error"]["message"]


def test_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="x", max_tokens=2, n=0)


def test_a_batch_with_one_bad_prompt_is_refused_whole_and_the_server_serves_on(server, client):
    long_prompt = list(range(10, 10 + 300))  # past the 256-token context
    status, body, _ = post(server, "/v1/completions", {"model": "demo", "prompt": [[5, 6], long_prompt], "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    got = client.completions.create(model="demo", prompt=["a", "b"], n=2, max_tokens=2)
    assert len(got.choices) == 4


# ------------------------------------------------------------------ structured output

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates_every_time(client, temperature):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a person."}]
    got = client.chat.completions.create(model="demo", messages=msgs, max_tokens=120, n=4, temperature=temperature,
                                         seed=11, response_format=fmt)
    for choice in got.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    sampled = client.completions.create(model="demo", prompt=PROMPT, max_tokens=120, n=3, temperature=temperature, seed=5,
                                        extra_body={"guided_json": PERSON})
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_json_object_regex_and_choice(client, server):
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=120, temperature=1.0, seed=2, n=3,
                                    extra_body={"response_format": {"type": "json_object"}})
    for choice in got.choices:
        # Any object at all: a random model may write keys until max_tokens (then only a prefix of one).
        assert choice.text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.finish_reason == "length" and got.usage.completion_tokens >= 120
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3, n=3,
                                    extra_body={"guided_regex": "[a-z]{3,8}-[0-9]{2}"})
    import re

    assert all(re.fullmatch("[a-z]{3,8}-[0-9]{2}", c.text) for c in got.choices), [c.text for c in got.choices]
    choices = ["yes", "no", "maybe so"]
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 4, "n": 4, "guided_choice": choices}
    _, whole, _ = post(server, "/v1/completions", body)
    assert all(c["text"] in choices for c in whole["choices"]), whole
    _, events, _ = post(server, "/v1/completions", {**body, "stream": True})
    assert joined_stream(events) == {c["index"]: c["text"] for c in whole["choices"]}
