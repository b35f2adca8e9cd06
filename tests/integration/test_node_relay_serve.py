"""Real ranks report through their supervisor's load relay (issue 30): with a 1.5 s
silence limit, a node whose rank sends no report of its own to the coordinator
keeps it routable for two limits, and a finished request's count reaches the
API server's routing table through the relay (one NodeLoad), as it did directly."""

from __future__ import annotations

import time

import pytest

from tests.server import DpServer, stream_request, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROBE_S = 0.5  # x 3 failures: a 1.5 s silence limit


def test_a_rank_behind_the_load_relay_stays_routable_and_its_load_reaches_routing(demo_model_dir):
    with DpServer(
        demo_model_dir, "--data-parallel-size", "1", "--api-server-count", "1", "--max-model-len", "128",
        "--dp-supervisor-probe-interval-s", str(PROBE_S), "--dp-supervisor-probe-timeout-s", "2",
    ) as srv:
        ranks = srv.status()["cluster"]["ranks"]
        assert [r["state"] for r in ranks] == ["ready"], ranks
        before = srv.rank_finished()
        for _ in range(2):
            stream_request(srv.port, 4, {})
        # the count comes from the ranks' load rows: through the relay, to the coordinator, to the API server
        wait_until(lambda: sum(srv.rank_finished().values()) >= sum(before.values()) + 2, 10, what="finished counts")
        time.sleep(2 * PROBE_S * 3)  # two silence limits: a relay that dropped the heartbeats would lose the rank
        ranks = srv.status()["cluster"]["ranks"]
        assert [r["state"] for r in ranks] == ["ready"], ranks
        assert "no load report" not in srv.log()


def test_ranks_reach_the_api_servers_through_their_node_s_hops(demo_model_dir):
    """--rank-links node: each API server sees one connection from the node (its hop), the
    ranks behind it serve pinned requests, a SIGKILLed rank's streams end with an error
    (its messages are dropped at the hop, its death comes from the supervisor's pidfd) and
    it comes back through the hop, and a restarted API server is greeted again (no
    monitor sees its return behind the hop: the ranks' pleas bring the hellos)."""
    import asyncio
    import os
    import signal

    import aiohttp

    from tests.integration.test_faults import burst, completion, fully_ready, until

    with DpServer(
        demo_model_dir, "--data-parallel-size", "2", "--api-server-count", "2", "--max-model-len", "128",
        "--rank-links", "node", "--dp-supervisor-probe-interval-s", str(PROBE_S), "--dp-supervisor-probe-timeout-s", "0.5",
        "--kill-grace-s", "1",
    ) as srv:
        wait_until(lambda: fully_ready(srv), 60, 0.1, "both API servers to route to both ranks")
        log = srv.log()
        assert log.count("node hop opened") == 2, log[-3000:]
        assert log.count("via=node-0-") >= 4, log[-3000:]  # 2 ranks x 2 API servers, through the hops

        async def pinned(n: int) -> list[int]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                return [r[0] for r in await asyncio.gather(*(completion(session, srv.url, 4, pin=i % 2) for i in range(n)))]


        assert asyncio.run(pinned(8)) == [200] * 8

        victim = srv.child("engine-dp1")

        async def kill_under_load():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                streaming: list = []
                inflight = [asyncio.create_task(completion(session, srv.url, 100, pin=1, stream=True, streaming=streaming)) for _ in range(4)]
                await until(lambda: len(streaming) == 4, 30, "4 streams on rank 1")
                killed_at = time.monotonic()
                os.kill(victim["pid"], signal.SIGKILL)
                results = await asyncio.gather(*inflight)
                return results, time.monotonic() - killed_at

        results, ended = asyncio.run(kill_under_load())
        assert [r[0] for r in results] == [599] * 4, results
        assert ended < 5.0, f"streams of the killed rank took {ended:.2f} s to end"
        wait_until(lambda: fully_ready(srv), 60, 0.1, "rank 1 to return through the hop")
        assert asyncio.run(pinned(8)) == [200] * 8

        api = srv.child("api-0")
        os.kill(api["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: srv.child("api-0")["pid"] not in (None, api["pid"]) and fully_ready(srv), 60, 0.1, "api-0 to return")
        assert "api server restarted; its ranks greet it" in srv.log()  # the coordinator asked, no plea was needed
        print(f"\nthrough the hops: a killed rank's streams ended in {ended:.2f} s; a killed API server routed both ranks again after {time.monotonic() - t0:.1f} s")
        assert [r[0] for r in asyncio.run(burst(srv.url, 40, concurrency=8))] == [200] * 40
        assert asyncio.run(pinned(8)) == [200] * 8
