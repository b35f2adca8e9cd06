#!/usr/bin/env python3
"""Request migration under a rank's SIGKILL (issue 25): simulated ranks, real control plane.

    python benchmarks/migration_bench.py [--ranks 8] [--streams 300] [--max-tokens 200]
                                         [--stale-after-s 0.3] [--json]

A SimCluster (benchmarks/simcluster.py: the real coordinator and API servers, ranks
of dpserve.engine.testing.sim, whose answers are a deterministic function of the
prompt and the position) serves STREAMS concurrent streamed completions twice:
once undisturbed (the reference) and once with the last rank SIGKILLed while they
run. Printed:

- streams that finished without a client-visible error, and how many had started
  on the killed rank;
- streams whose text differs from the reference (duplicated or lost tokens show
  here) and whose usage differs;
- detection: from the kill until the killed rank left the API servers' routing
  (its silence, judged by the coordinator's stale limit: a SIGKILLed process says
  nothing; on a real node the supervisor sees the exit at once);
- the added stall of each moved stream: its longest gap between events minus the
  longest gap of the same stream in the reference; p50 / p99 / max.

Everything runs on loopback / ipc; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.simcluster import SimCluster, probe_json  # noqa: E402


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> dict:
    payload = {"model": "sim", "prompt": f"stream {i} " + "x" * (i % 7), "max_tokens": max_tokens,
               "stream": True, "stream_options": {"include_usage": True}}
    t_prev = time.monotonic()
    gaps: list[tuple[float, float]] = []  # (arrival, gap)
    text: list[str] = []
    usage, error = None, None
    try:
        async with session.post(f"{url}/completions", json=payload) as resp:
            rank = int(resp.headers.get("X-data-parallel-rank", -1))
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}", "rank": rank}
            async for line in resp.content:
                now = time.monotonic()
                gaps.append((now, now - t_prev))
                t_prev = now
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                for choice in event.get("choices", ()):
                    text.append(choice["text"])
                usage = event.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"error": repr(exc), "rank": -1}
    return {"text": "".join(text), "usage": usage, "error": error, "rank": rank, "gaps": gaps}


async def run_streams(url: str, n: int, max_tokens: int, on_started=None) -> list[dict]:
    conn = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(one_stream(session, url, i, max_tokens)) for i in range(n)]
        if on_started is not None:
            await on_started()
        return await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--api-servers", type=int, default=2)
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--decode-step-ms", type=float, default=10.0)
    ap.add_argument("--report-interval-s", type=float, default=0.1)
    ap.add_argument("--stale-after-s", type=float, default=0.3)
    ap.add_argument("--kill-after-s", type=float, default=1.0, help="seconds into the streams")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    victim = args.ranks - 1
    cluster = SimCluster(args.ranks, num_api_servers=args.api_servers, ranks_per_process=args.ranks, num_alone=1,
                         report_interval_s=args.report_interval_s, stale_after_s=args.stale_after_s,
                         decode_step_ms=args.decode_step_ms)
    with cluster:
        cluster.wait_routable(args.ranks, timeout=60)
        want = asyncio.run(run_streams(cluster.url, args.streams, args.max_tokens))
        marks: dict[str, float] = {}

        async def kill_then_watch():
            await asyncio.sleep(args.kill_after_s)
            marks["kill"] = time.monotonic()
            cluster.kill(f"sim-{victim}-{victim}")
            while True:  # until no API server routes to the victim
                routable = [probe_json(cluster.probe_path(i)).get("routable_ranks", []) for i in range(args.api_servers)]
                if all(victim not in r for r in routable):
                    marks["out"] = time.monotonic()
                    return
                await asyncio.sleep(0.01)

        got = asyncio.run(run_streams(cluster.url, args.streams, args.max_tokens, kill_then_watch))

    ok = [g for g in got if g.get("error") is None]
    moved = [i for i, g in enumerate(got) if g.get("rank") == victim]
    differ = [i for i, (g, w) in enumerate(zip(got, want)) if g.get("text") != w.get("text")]
    usage_differs = [i for i, (g, w) in enumerate(zip(got, want)) if g.get("usage") != w.get("usage")]
    stalls = []
    for i in moved:
        if got[i].get("gaps") and want[i].get("gaps"):
            after_kill = [gap for at, gap in got[i]["gaps"] if at >= marks["kill"]]
            stalls.append(max(after_kill or [0.0]) - max(gap for _, gap in want[i]["gaps"][1:] or [(0, 0.0)]))
    result = {
        "streams": args.streams,
        "ranks": args.ranks,
        "finished_without_error": len(ok),
        "finished_pct": 100.0 * len(ok) / args.streams,
        "started_on_killed_rank": len(moved),
        "text_differs": len(differ),
        "usage_differs": len(usage_differs),
        "detection_s": marks.get("out", float("nan")) - marks["kill"],
        "stall_p50_s": pct(stalls, 0.5),
        "stall_p99_s": pct(stalls, 0.99),
        "stall_max_s": max(stalls or [0.0]),
        "errors": sorted({g.get("error") for g in got if g.get("error")})[:3],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.streams} streams x {args.max_tokens} tokens on {args.ranks} simulated ranks; rank {victim} SIGKILLed "
          f"{args.kill_after_s:g} s in (coordinator stale limit {args.stale_after_s:g} s, reports every {args.report_interval_s:g} s)")
    print(f"  finished without error: {len(ok)}/{args.streams} ({result['finished_pct']:.2f}%)")
    print(f"  started on the killed rank: {len(moved)} (moved)")
    print(f"  text differs from the reference: {len(differ)}; usage differs: {len(usage_differs)}")
    print(f"  detection (kill -> out of every API server's routing): {result['detection_s']:.3f} s")
    if stalls:
        print(f"  added stall of moved streams: p50 {result['stall_p50_s']:.3f} s, p99 {result['stall_p99_s']:.3f} s, "
              f"max {result['stall_max_s']:.3f} s (mean {statistics.fmean(stalls):.3f} s)")
    if result["errors"]:
        print(f"  errors: {result['errors']}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
