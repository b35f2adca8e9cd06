#!/usr/bin/env python3
"""A rolling restart of a node's ranks under load (issue 25): how long, and what fails.

    python benchmarks/rolling_bench.py [--ranks 4] [--streams 8] [--max-tokens 512] [--json]

A DP=RANKS node (the demo model, float32) serves STREAMS closed-loop clients, each
sending streamed completions of MAX_TOKENS tokens (ignore_eos) one after another.
First one rank is restarted alone (drain, then undrain, until routable again), idle
and under the load: its restart time (the target uses the one under load). Then
`POST /rolling-restart {"ranks": true}` on the health port (what `dpserve
rolling-restart --ranks` sends) restarts every rank in turn, each stopped
at once with its requests moved. Printed: the rolling restart's time against the
target ranks x (restart time + 2 s), requests finished and failed during it (a
failure is any non-200 or an error event), and how many moved.

Everything runs on loopback; the node is stopped at the end, also on failure.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import begin, ensure_demo_model, parser  # noqa: E402
from benchmarks.nodes import DpNode  # noqa: E402


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def rank_ready(node: DpNode, rank: int) -> bool:
    return any(c["name"] == f"engine-dp{rank}" and c["state"] == "ready" for c in node.status()["children"]) and \
        rank in json.loads(urllib.request.urlopen(node.url + "/readyz", timeout=5).read()).get("routable_ranks", [])


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def moved(node: DpNode) -> float:
    text = urllib.request.urlopen(node.url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("dpserve_api_requests_migrated_total"))


async def client_loop(url: str, i: int, max_tokens: int, stop: asyncio.Event, log: list) -> None:
    payload = {"model": "demo", "prompt": f"rolling {i}", "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        while not stop.is_set():
            t0 = time.monotonic()
            ok = False
            try:
                async with session.post(url + "/v1/completions", json=payload) as resp:
                    body = await resp.read()
                    ok = resp.status == 200 and b'"error"' not in body and body.rstrip().endswith(b"[DONE]")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            log.append((t0, time.monotonic(), ok))


def restart_one(node: DpNode, health: str) -> float:
    """Seconds for rank 0 to be drained, undrained and routable again."""
    t0 = time.monotonic()
    assert post(health + "/drain", {"rank": 0})[0] in (200, 202)
    wait(lambda: any(c["name"] == "engine-dp0" and c["state"] == "drained" for c in node.status()["children"]), 60, "rank 0 drained")
    assert post(health + "/undrain", {"rank": 0})[0] in (200, 202)
    wait(lambda: rank_ready(node, 0), 300, "rank 0 back")
    return time.monotonic() - t0


def main(argv=None) -> None:
    p = parser(__doc__, model_dir=True, json=True)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    args, run = begin(p, argv)
    model_dir = args.model_dir or ensure_demo_model()
    node = DpNode(model_dir, dp=args.ranks, api=1, extra=["--dtype", "float32"])
    with node:
        health = f"http://127.0.0.1:{node.supervisor_port}"
        idle_restart_s = restart_one(node, health)
        log: list = []

        async def load_and_roll() -> tuple[float, float, float, float]:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(client_loop(node.url, i, args.max_tokens, stop, log)) for i in range(args.streams)]
            await asyncio.sleep(3)  # under way
            loaded_restart_s = await asyncio.to_thread(restart_one, node, health)
            before = moved(node)
            began = time.monotonic()
            code, body = post(health + "/rolling-restart", {"ranks": True})
            assert code == 202, body
            while "rolling restart done" not in node.log_tail(200_000):
                await asyncio.sleep(0.1)
            ended = time.monotonic()
            stop.set()
            await asyncio.gather(*tasks)
            return began, ended, moved(node) - before, loaded_restart_s

        began, ended, num_moved, restart_s = asyncio.run(load_and_roll())
    took = ended - began
    during = [r for r in log if r[1] >= began and r[0] <= ended]
    failed = [r for r in log if not r[2]]
    target = args.ranks * (restart_s + 2.0)
    result = {"ranks": args.ranks, "streams": args.streams, "max_tokens": args.max_tokens, "rank_restart_s": restart_s,
              "rank_restart_idle_s": idle_restart_s,
              "rolling_restart_s": took, "target_s": target, "requests_during": len(during), "failed": len(failed),
              "moved": num_moved}
    if args.json:
        print(json.dumps(result))
        return
    print(json.dumps(run.info()))
    print(f"one rank's restart (drain -> undrain -> routable): {idle_restart_s:.1f} s idle, {restart_s:.1f} s under the load")
    print(f"rolling restart of {args.ranks} ranks under {args.streams} streams of {args.max_tokens} tokens: {took:.1f} s "
          f"(target <= ranks x (restart + 2 s) = {target:.1f} s)")
    print(f"requests finished or running during it: {len(during)}; failed (whole run): {len(failed)}; moved: {num_moved:g}")


if __name__ == "__main__":
    main()
