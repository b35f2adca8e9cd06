"""Responses far larger than their requests, and n choices that share a prompt (a real node).

A small body must not ask for a response a thousand times its size: the
response-size budget (--max-response-bytes) refuses it with a 400 naming the
costliest parameter before any engine work, and no process restarts. A
request under the budget is served, its body within the budget's estimate.
The n choices of one prompt go to one rank, compute its prompt logprobs once
(the first choice asks; the others read them) and attach its blocks from the
prefix cache, so n multiplies decode, not prefill.
"""

from __future__ import annotations

import http.client
import json
import re
import time

import pytest
from dpserve.daemons.api.request_checks import response_bytes

from tests.server import DpServer, wait_until

pytestmark = pytest.mark.slow

API_KEY = "amplify-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
REPRO_FLAGS = {"max_tokens": 0, "echo": True, "logprobs": 20, "prompt_logprobs": 20}


@pytest.fixture(scope="module")
def server(demo_model_dir):
    srv = DpServer(
        demo_model_dir,
        "--data-parallel-size", "2",
        "--api-server-count", "1",
        "--max-model-len", "2048",
        "--max-request-body-bytes", str(8 << 20),
        "--dtype", "float32",
        env={"DPSERVE_API_KEY": API_KEY},
    )
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def post(server, path: str, body: dict) -> tuple[int, dict, float, int]:
    """(status, JSON body, seconds to the whole answer, body bytes) over one fresh connection."""
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.connect()
        t0 = time.perf_counter()
        conn.request("POST", path, body=data, headers=HEADERS)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw), time.perf_counter() - t0, len(raw)
    finally:
        conn.close()


def ids(n: int, start: int = 0) -> list[int]:
    return [4 + (start + 7 * i) % 2000 for i in range(n)]


def restarts(server) -> list[int]:
    return [c["restarts"] for c in server.status()["children"]]


def assert_over_budget(status: int, body: dict, param: str) -> None:
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert "--max-response-bytes" in body["error"]["message"] and "MiB" in body["error"]["message"], body


def test_the_repro_bodies_get_a_400_naming_the_parameter_at_once(server):
    post(server, "/v1/completions", {"model": "demo", "prompt": "warm", "max_tokens": 1})
    before = restarts(server)
    # 2,040 prompt ids, n 128: 529 MB of JSON in 20 s before the budget
    one = {"model": "demo", "prompt": ids(2040), "n": 128, **REPRO_FLAGS}
    # 256 prompts of ~1,000 ids: 460 MB
    many = {"model": "demo", "prompt": [ids(1000, k) for k in range(256)], **REPRO_FLAGS}
    # chat: prompt_logprobs and top_logprobs over n 128 and a long answer
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi " * 100}], "n": 128, "max_tokens": 1000,
            "logprobs": True, "top_logprobs": 20, "prompt_logprobs": 20}
    for path, body, param in (("/v1/completions", one, "prompt_logprobs"), ("/v1/completions", many, "prompt_logprobs"),
                              ("/v1/chat/completions", chat, "top_logprobs")):
        status, answer, seconds, _ = post(server, path, body)
        print(f"{path} {len(json.dumps(body))} B body: {status} in {seconds * 1000:.0f} ms")
        assert_over_budget(status, answer, param)
        assert seconds < 2.0, f"the 400 took {seconds:.2f} s"  # generous: 0.1 s is the target, measured in the log
    assert restarts(server) == before


def test_the_official_client_gets_the_400(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="demo", prompt=ids(2040), n=128, max_tokens=0, echo=True, logprobs=5,
                                      extra_body={"prompt_logprobs": 20})
    assert err.value.body["param"] == "prompt_logprobs" and "--max-response-bytes" in err.value.body["message"]


def test_under_the_budget_a_response_is_served_within_its_estimate_and_shares_prompt_logprobs(server):
    prompts = [ids(60, 1), ids(45, 2)]
    n, k, p, max_tokens = 3, 5, 3, 4
    status, body, _, size = post(server, "/v1/completions", {
        "model": "demo", "prompt": prompts, "n": n, "max_tokens": max_tokens, "echo": True, "logprobs": k,
        "prompt_logprobs": p, "temperature": 0})
    assert status == 200, body
    estimate = sum(sum(response_bytes(chat=False, stream=False, num_prompt=len(ids_), num_generated=max_tokens, num_top=k,
                                      prompt_logprobs=max(k, p), echo=True).values()) for ids_ in prompts for _ in range(n))
    assert size <= estimate, f"a {size} B response over its estimate of {estimate} B"
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 6
    for i, prompt in enumerate(prompts):
        group = choices[i * n:(i + 1) * n]
        assert all(len(c["prompt_logprobs"]) == len(prompt) for c in group)
        # the siblings show the first choice's prompt logprobs, and the same echoed logprobs
        assert all(c["prompt_logprobs"] == group[0]["prompt_logprobs"] for c in group)
        echoed = len(prompt)
        assert all(c["logprobs"]["top_logprobs"][:echoed] == group[0]["logprobs"]["top_logprobs"][:echoed] for c in group)
        assert group[0]["logprobs"]["top_logprobs"][0] is None and group[0]["logprobs"]["top_logprobs"][1]


def prefix_counters(server) -> tuple[float, float]:
    text = server.metrics()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("vllm:prefix_cache_queries"), total("vllm:prefix_cache_hits")


def test_chat_with_prompt_logprobs_and_n_computes_the_prompt_once(server):
    q0, h0 = prefix_counters(server)
    n = 8
    status, body, _, _ = post(server, "/v1/chat/completions", {
        "model": "demo", "messages": [{"role": "user", "content": "count the blocks " * 40}], "n": n, "max_tokens": 2,
        "prompt_logprobs": 5, "temperature": 0})
    assert status == 200, body
    num_prompt = body["usage"]["prompt_tokens"]
    assert len(body["prompt_logprobs"]) == num_prompt and len(body["choices"]) == n
    # Only the first choice scores the prompt (a prompt-logprobs request bypasses the cache);
    # the other seven look it up and find all but its last partial block cached.
    wait_until(lambda: prefix_counters(server)[0] - q0 >= (n - 1) * num_prompt, 15, what="the load report")
    queries, hits = (a - b for a, b in zip(prefix_counters(server), (q0, h0)))
    assert queries == (n - 1) * num_prompt
    assert hits >= (n - 1) * (num_prompt - 16), (queries, hits)


def test_a_list_of_lists_of_strings_is_named_as_such(server):
    status, body, _, _ = post(server, "/v1/completions", {"model": "demo", "prompt": [["a"]], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "list of lists of strings" in body["error"]["message"] and "not supported" not in body["error"]["message"]


def test_n16_of_a_1000_token_prompt_costs_at_most_1_3_prefills(server):
    """On DP 2: the 16 choices go to one rank, which computes the prompt once."""
    q0, h0 = prefix_counters(server)
    prompt = ids(1000, 5)
    status, body, _, _ = post(server, "/v1/completions", {"model": "demo", "prompt": prompt, "n": 16, "max_tokens": 2,
                                                          "temperature": 0})
    assert status == 200, body
    wait_until(lambda: prefix_counters(server)[0] - q0 >= 16 * 1000, 15, what="the load report")
    queries, hits = (a - b for a, b in zip(prefix_counters(server), (q0, h0)))
    assert queries == 16 * 1000
    computed = queries - hits
    print(f"n=16 x 1,000 prompt tokens: {computed:.0f} computed")
    assert computed <= 1.3 * 1000, (queries, hits)
    assert len({c["text"] for c in body["choices"]}) == 1  # greedy: the same answer 16 times


def test_streamed_siblings_show_the_first_choices_prompt_logprobs(server):
    prompt = ids(40, 3)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", headers=HEADERS, body=json.dumps({
            "model": "demo", "prompt": prompt, "n": 4, "max_tokens": 1, "prompt_logprobs": 2, "stream": True}).encode())
        resp = conn.getresponse()
        assert resp.status == 200
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    finally:
        conn.close()
    shown = {c["index"]: c["prompt_logprobs"] for e in events for c in e["choices"] if c.get("finish_reason")}
    assert sorted(shown) == [0, 1, 2, 3]
    assert len(shown[0]) == len(prompt) and shown[0][1] is not None
    assert all(v == shown[0] for v in shown.values())
