"""64 simulated ranks behind the real coordinator and API servers.

The ranks are dpserve.engine.testing.sim processes (32 ranks each, no model): they
speak the real protocol, so these tests exercise registration, load tables,
routing and rank loss at a cluster size the real engine cannot reach on two
cores. Requests go through the official openai client over loopback.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import SimCluster, _UnixHTTP  # noqa: E402

pytestmark = pytest.mark.timeout(180)

NUM_RANKS = 64


@pytest.fixture(scope="module", params=["direct", "node"])
def cluster(request):
    # ranks 0-31 and 32-62 share two processes; rank 63 runs alone, so it can be lost alone.
    # "node": each simulated node's ranks reach an API server through its hop (--rank-links node).
    c = SimCluster(NUM_RANKS, num_api_servers=2, ranks_per_process=32, num_alone=1, report_interval_s=0.2, stale_after_s=1.0,
                   rank_links=request.param)
    try:
        c.start()
        c.wait_routable(NUM_RANKS, timeout=90)
        yield c
    finally:
        c.stop()


def test_every_api_server_routes_to_all_64_ranks(cluster):
    assert cluster.routable_counts() == [NUM_RANKS, NUM_RANKS]
    assert {"coordinator", "api-0", "api-1"} <= cluster.collect_ready()


def test_a_burst_spreads_over_the_ranks(cluster):
    async def burst() -> list[str]:
        async with openai.AsyncOpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60) as client:
            async def one(i: int) -> str:
                raw = await client.completions.with_raw_response.create(model="sim", prompt=f"request {i}", max_tokens=4)
                body = raw.parse()
                assert body.choices[0].finish_reason == "length" and body.usage.completion_tokens == 4
                return raw.headers["X-data-parallel-rank"]

            return await asyncio.gather(*(one(i) for i in range(128)))

    ranks = asyncio.run(burst())
    assert len(ranks) == 128
    # idle ranks score 0 and our own sends count at once: a burst must not pile up
    assert len(set(ranks)) >= NUM_RANKS // 2, sorted(set(ranks), key=int)


def test_streaming_and_pins_reach_the_pinned_rank(cluster):
    with openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
            extra_headers={"X-data-parallel-rank": "17"},
        )
        assert raw.headers["X-data-parallel-rank"] == "17"
        chunks = list(raw.parse())
        assert chunks[-1].choices[0].finish_reason == "length"


def rank_metric(cluster: SimCluster, api: int, name: str, rank: int) -> float | None:
    conn = _UnixHTTP(cluster.probe_path(api))
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    prefix = f'{name}{{rank="{rank}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), None)


def test_a_client_that_leaves_aborts_its_request_on_the_rank(cluster):
    before = rank_metric(cluster, 0, "dpserve_rank_requests_aborted_total", 5) or 0.0
    with openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60) as client:
        stream = client.completions.create(model="sim", prompt="x", max_tokens=500, stream=True,
                                           extra_headers={"X-data-parallel-rank": "5"})
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()  # 500 tokens at 10 ms a step: the rank is still decoding it
    deadline = time.monotonic() + 10
    # the rank counts the abort in its load report; every API server sees it in the table
    while not all(rank_metric(cluster, i, "dpserve_rank_requests_aborted_total", 5) == before + 1 for i in (0, 1)):
        assert time.monotonic() < deadline, [rank_metric(cluster, i, "dpserve_rank_requests_aborted_total", 5) for i in (0, 1)]
        time.sleep(0.05)
    assert all(rank_metric(cluster, i, "dpserve_api_in_flight", 5) == 0 for i in (0, 1))
    assert all(rank_metric(cluster, i, "dpserve_rank_running", 5) == 0 for i in (0, 1))


def test_a_lost_rank_leaves_every_api_servers_routing_within_the_stale_limit(cluster):
    cluster.kill("sim-63-63", signal.SIGKILL)  # no death announcement: only silence tells
    t0 = time.monotonic()
    deadline = t0 + cluster.stale_after_s + 5.0  # the coordinator's limit, plus scheduling slack on 2 busy cores
    while cluster.routable_counts() != [NUM_RANKS - 1, NUM_RANKS - 1]:
        assert time.monotonic() < deadline, cluster.routable_counts()
        time.sleep(0.05)
    with openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="sim", prompt="x", max_tokens=1, extra_headers={"X-data-parallel-rank": "63"})
        assert err.value.status_code == 503
        assert err.value.body["code"] == "rank_unavailable"
        # the rest still serve
        assert client.completions.create(model="sim", prompt="x", max_tokens=2).usage.completion_tokens == 2
