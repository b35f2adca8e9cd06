"""Admission held at the frontend, end to end on a simulated rank: requests beyond a full
rank wait at the API server, a held request whose client leaves is gone at once (never
reaching the rank), the tenant's bound answers 429 naming it, and held requests are
released when the rank has room. One rank of 2 sequences, 1 waiting: a small cluster."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import SimCluster, _UnixHTTP  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def metric(cluster: SimCluster, line_prefix: str, missing: float | None = 0.0) -> float | None:
    conn = _UnixHTTP(cluster.probe_path(0))
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_prefix)), missing)


def wait_for(check, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


HELD = 'dpserve_api_admission_held_requests{api_server="0",tenant="default"}'
ABANDONED = 'dpserve_api_admission_abandoned_total{api_server="0",tenant="default"}'
RANK_FINISHED = 'dpserve_rank_requests_finished_total{rank="0"}'
IN_FLIGHT = 'dpserve_api_in_flight{'


def test_held_requests_wait_leave_when_abandoned_and_a_full_queue_gets_429():
    options = {"hold_waiting_per_rank": 1, "max_held_per_tenant": 3}
    with SimCluster(1, num_api_servers=1, ranks_per_process=1, report_interval_s=0.2, max_num_seqs=2,
                    api_options=options) as cluster:
        cluster.wait_routable(1, timeout=60)
        asyncio.run(scenario(cluster))


async def scenario(cluster: SimCluster) -> None:
    url = cluster.url + "/completions"
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:

        async def stream() -> aiohttp.ClientResponse:  # a long answer: it holds a place until closed
            resp = await http.post(url, json={"model": "sim", "prompt": "x", "max_tokens": 2000, "stream": True})
            assert resp.status == 200
            await resp.content.readline()  # its first token: it runs
            return resp

        async def short() -> tuple[int, dict]:
            async with http.post(url, json={"model": "sim", "prompt": "x", "max_tokens": 3}) as resp:
                return resp.status, await resp.json()

        running = [await stream(), await stream()]  # the rank's two sequences
        waiting = asyncio.create_task(short())  # waits on the rank (its one waiting place)
        await asyncio.sleep(0.3)  # (the table shows it waiting)
        held = [asyncio.create_task(short()) for _ in range(3)]  # every rank full: held here
        await loop.run_in_executor(None, wait_for, lambda: metric(cluster, HELD) == 3, "3 held")
        finished_before = metric(cluster, RANK_FINISHED)

        async with http.post(url, json={"model": "sim", "prompt": "x", "max_tokens": 3}) as resp:
            body = await resp.json()
            assert resp.status == 429, body
            assert 1 <= int(resp.headers["Retry-After"]) <= 60
            assert body["error"]["code"] == "max_held_per_tenant" and "--max-held-per-tenant" in body["error"]["message"]

        held[1].cancel()  # its client goes away: it leaves the queue at once
        await loop.run_in_executor(None, wait_for, lambda: metric(cluster, HELD) == 2, "the abandoned one left", 2.0)
        assert metric(cluster, ABANDONED) == 1

        for resp in running:  # the long answers end: the rank takes the waiting one, then the held ones
            resp.close()
        results = await asyncio.wait_for(asyncio.gather(waiting, held[0], held[2]), 20)
        assert [status for status, _ in results] == [200, 200, 200], results
        assert all(body["usage"]["completion_tokens"] == 3 for _, body in results), json.dumps(results)
        assert metric(cluster, HELD) == 0
        # the rank finished exactly those three: the abandoned request never reached it
        await loop.run_in_executor(None, wait_for, lambda: metric(cluster, RANK_FINISHED) >= finished_before + 3, "finished")
        await asyncio.sleep(0.3)
        assert metric(cluster, RANK_FINISHED) == finished_before + 3
        # nothing is left counted in flight (the router's room for held requests rests on that count)
        assert metric(cluster, IN_FLIGHT, None) is not None  # (the gauge is there)
        await loop.run_in_executor(None, wait_for, lambda: metric(cluster, IN_FLIGHT) == 0, "in flight back to 0")


def test_a_quiet_tenants_reserved_place_stays_free_of_a_flood_until_it_goes_idle(tmp_path):
    """One rank of 4 places, nothing waiting there. The quiet tenant runs one answer (it
    reserves min(its half, 1 + 2) = 2 places); the flood may run 4 - 2 while the
    quiet one is active: its further requests are held with a place free, and the quiet
    tenant's next request starts at once. Idle past the window, the quiet reservation
    lapses and the flood takes every place (work-conserving)."""
    keys = {"quiet": "sk-quiet-test-key", "flood": "sk-flood-test-key"}
    path = tmp_path / "tenants.toml"
    path.write_text("".join(f'[tenants.{name}]\nkey = "{key}"\n' for name, key in keys.items()))
    options = {"hold_waiting_per_rank": 0, "tenants_file": str(path), "reserve_window_s": 0.5}
    with SimCluster(1, num_api_servers=1, ranks_per_process=1, report_interval_s=0.2, max_num_seqs=4,
                    api_options=options) as cluster:
        cluster.wait_routable(1, timeout=60)
        asyncio.run(reserved_scenario(cluster, keys))


async def reserved_scenario(cluster: SimCluster, keys: dict[str, str]) -> None:
    url = cluster.url + "/completions"
    loop = asyncio.get_running_loop()
    held = 'dpserve_api_admission_held_requests{api_server="0",tenant="flood"}'
    async with aiohttp.ClientSession() as http:
        def auth(name: str) -> dict:
            return {"Authorization": f"Bearer {keys[name]}"}

        async def stream(name: str) -> aiohttp.ClientResponse:
            resp = await http.post(url, json={"model": "sim", "prompt": "x", "max_tokens": 2000, "stream": True}, headers=auth(name))
            assert resp.status == 200
            await resp.content.readline()
            return resp

        quiet = await stream("quiet")  # 1 in flight: it reserves min(4 / 2, 1 + 2) = 2
        flood = [asyncio.create_task(stream("flood")) for _ in range(3)]
        await loop.run_in_executor(None, wait_for, lambda: metric(cluster, held) == 1, "the flood held at its cap (4 - 2)")
        t0 = time.monotonic()
        async with http.post(url, json={"model": "sim", "prompt": "x", "max_tokens": 3}, headers=auth("quiet")) as resp:
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
        assert time.monotonic() - t0 < 2.0  # a place was free for it: no flood answer had to end
        assert metric(cluster, held) == 1
        quiet.close()  # idle: its reservation lapses after the window, and the held one goes
        await loop.run_in_executor(None, wait_for, lambda: metric(cluster, held) == 0, "work-conserving", 5.0)
        for resp in await asyncio.wait_for(asyncio.gather(*flood), 10):
            resp.close()
