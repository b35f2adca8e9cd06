"""A request outlives its rank: SIGKILL a rank mid-answer and its streams finish elsewhere.

One DP=2 node (demo model, float32, greedy answers are deterministic), the official
openai client. Each scenario first runs its requests on the healthy node for the
reference answers, then runs them again and kills rank 1 while they are in flight:
every request that was on rank 1 must end as the reference did, with no error,
no duplicated or missing text, the same usage and finish_reason.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from tests.integration.test_faults import fully_ready
from tests.server import DpServer, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node(demo_model_dir):
    srv = DpServer(
        demo_model_dir,
        "--data-parallel-size", "2",
        "--api-server-count", "1",
        "--dtype", "float32",
        "--dp-supervisor-probe-interval-s", "0.5",
        "--dp-supervisor-probe-timeout-s", "0.5",
        "--kill-grace-s", "1",
    )
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def client(node: DpServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)


async def stream_completion(api: openai.AsyncOpenAI, prompt: str, started: list, **kw) -> dict:
    """The whole streamed answer: text, finish, usage, the rank that answered first, logprob tokens."""
    raw = await api.completions.with_raw_response.create(
        model="demo", prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw)
    rank = int(raw.headers["X-data-parallel-rank"])
    text, finish, usage, tokens = [], None, None, []
    async for chunk in raw.parse():
        if not started or started[-1] is not chunk:
            started.append(rank)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
    return {"text": "".join(text), "finish": finish, "usage": usage, "rank": rank, "tokens": tokens}


async def stream_chat(api: openai.AsyncOpenAI, content: str, started: list, **kw) -> dict:
    raw = await api.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": content}], stream=True,
        stream_options={"include_usage": True}, **kw)
    rank = int(raw.headers["X-data-parallel-rank"])
    texts: dict[int, list[str]] = {}
    finishes: dict[int, str] = {}
    usage = None
    async for chunk in raw.parse():
        started.append(rank)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return {"text": {i: "".join(t) for i, t in texts.items()}, "finish": finishes, "usage": usage, "rank": rank}


def kill_rank_1_mid_answer(node: DpServer, requests, min_started: int) -> tuple[list[dict], float]:
    """Run the request coroutines; SIGKILL rank 1 once `min_started` events arrived. (results, kill time)."""
    victim = node.child("engine-dp1")

    async def main():
        started: list = []
        tasks = [asyncio.create_task(make(started)) for make in requests]
        deadline = time.monotonic() + 60
        while len(started) < min_started and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        os.kill(victim["pid"], signal.SIGKILL)
        return await asyncio.gather(*tasks), time.monotonic()

    results, killed_at = asyncio.run(main())
    return results, killed_at


def recover(node: DpServer) -> None:
    wait_until(lambda: fully_ready(node), 120, 0.1, "rank 1 to return")


@pytest.fixture(autouse=True)
def rank_1_back(node):
    """After every test, failed ones too, rank 1 is back and routed before the next one starts
    (called inside a test, a failed assertion skipped it, and every later test then failed)."""
    yield
    recover(node)


PROMPTS = [f"migration test {i}: the quick brown fox" for i in range(8)]


def test_greedy_streams_continue_across_a_kill_with_exact_text_usage_and_logprobs(node):
    def requests(api):
        return [lambda started, p=p: stream_completion(api, p, started, max_tokens=160, temperature=0,
                                                       extra_body={"ignore_eos": True}, logprobs=2) for p in PROMPTS]

    async def reference():
        api = client(node)
        return await asyncio.gather(*(make([]) for make in requests(api)))

    want = asyncio.run(reference())
    results, _ = kill_rank_1_mid_answer(node, requests(client(node)), min_started=8 * 20)
    moved = [i for i, r in enumerate(results) if r["rank"] == 1]
    assert moved, "no stream started on rank 1"
    for got, ref in zip(results, want):
        assert got["text"] == ref["text"]
        assert got["tokens"] == ref["tokens"]
        assert got["finish"] == ref["finish"] == "length"
        assert got["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] == 160
        assert got["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    wait_until(lambda: "moved_requests" in node.log(), 10, 0.1, "the API server's log line of the moved requests")


def test_seeded_chat_with_n_and_stop_strings_continues_as_if_nothing_happened(node):
    kw = dict(max_tokens=120, temperature=1.0, seed=77, n=2, stop=["zz"])

    def requests(api):
        return [lambda started, p=p: stream_chat(api, p, started, **kw) for p in PROMPTS[:6]]

    async def reference():
        return await asyncio.gather(*(make([]) for make in requests(client(node))))

    want = asyncio.run(reference())
    results, _ = kill_rank_1_mid_answer(node, requests(client(node)), min_started=6 * 10)
    assert any(r["rank"] == 1 for r in results)
    for got, ref in zip(results, want):
        assert got["text"] == ref["text"]
        assert got["finish"] == ref["finish"]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # (cached_tokens: the reference warmed the cache)
            assert got["usage"][key] == ref["usage"][key]


def test_a_whole_answer_waits_out_the_kill(node):
    async def one(api, p):
        resp = await api.completions.with_raw_response.create(model="demo", prompt=p, max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
        return resp.parse().choices[0].text, resp.parse().usage.completion_tokens

    async def run_all():
        api = client(node)
        return await asyncio.gather(*(one(api, p) for p in PROMPTS))

    want = asyncio.run(run_all())
    victim = node.child("engine-dp1")

    async def with_kill():
        api = client(node)
        tasks = [asyncio.create_task(one(api, p)) for p in PROMPTS]
        await asyncio.sleep(0.3)
        os.kill(victim["pid"], signal.SIGKILL)
        return await asyncio.gather(*tasks)

    assert asyncio.run(with_kill()) == want


def test_a_sigtermed_rank_hands_its_streams_on_at_once(node):
    """A stop that was asked for (SIGTERM: the rank stops stepping and announces it) moves
    its streams at once: none waits for the rank's longest answer, none fails."""
    victim = node.child("engine-dp1")

    def requests(api):
        return [lambda started, p=p: stream_completion(api, p, started, max_tokens=300, temperature=0,
                                                       extra_body={"ignore_eos": True}) for p in PROMPTS]

    async def reference():
        return await asyncio.gather(*(make([]) for make in requests(client(node))))

    want = asyncio.run(reference())

    async def main():
        started: list = []
        tasks = [asyncio.create_task(make(started)) for make in requests(client(node))]
        while len(started) < 8 * 10:
            await asyncio.sleep(0.005)
        os.kill(victim["pid"], signal.SIGTERM)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert any(r["rank"] == 1 for r in results)
    assert [r["text"] for r in results] == [r["text"] for r in want]
    metrics = node.metrics()
    moved = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("dpserve_api_requests_migrated_total{"))
    assert moved >= 1, [line for line in metrics.splitlines() if "migrat" in line]
    # The streams may all end before the supervisor reaps the stopping rank (its teardown
    # takes a while on a slow machine): wait for the victim's own exit, then read how it ended.
    wait_until(lambda: node.child("engine-dp1")["pid"] != victim["pid"], 60, 0.1, "the stopped rank to be reaped")
    assert node.child("engine-dp1")["last_exit"] == "exit code 0 (clean exit)"


def test_a_pinned_stream_still_fails_with_its_rank(node):
    victim = node.child("engine-dp1")

    async def main():
        api = openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60,
                                 default_headers={"X-data-parallel-rank": "1"})
        stream = await api.completions.create(model="demo", prompt="pinned", max_tokens=400, temperature=0, extra_body={"ignore_eos": True},
                                              stream=True)
        n = 0
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                n += 1
                if n == 5:
                    os.kill(victim["pid"], signal.SIGKILL)
        return info.value

    err = asyncio.run(main())
    assert "pinned" in str(err.message if hasattr(err, "message") else err)


def stream_killing_its_rank(node: DpServer, payload: dict, after_events: int) -> tuple[str, str, int, int]:
    """POST a streamed completion; after `after_events` text events SIGKILL the rank that
    answers it. (text, finish_reason, completion tokens, the killed rank). Used by the
    realistic-model and vLLM-engine tests too."""
    import http.client
    import json as _json

    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=300)
    conn.request("POST", "/v1/completions", _json.dumps({**payload, "stream": True, "stream_options": {"include_usage": True}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    rank = int(resp.getheader("X-data-parallel-rank"))
    text, finish, tokens, events = [], None, 0, 0
    try:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            event = _json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
                events += 1
                if events == after_events:
                    os.kill(node.child(f"engine-dp{rank}")["pid"], signal.SIGKILL)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    finally:
        conn.close()
    assert events > after_events, "the answer ended before the kill"
    return "".join(text), finish, tokens, rank
