#!/usr/bin/env python3
"""Urgent requests' time to first token under a batch flood: --scheduling-policy priority against fcfs.

    python benchmarks/priority_bench.py [--model DIR] [--duration S] [--flood N] [--max-num-seqs N]
                                        [--probe-every S] [--drain S] [--json]

The model is `dpserve demo-model --size small` (engine_realistic.py's), served at
DP 1 with --max-num-seqs 4, once per policy. A closed loop of --flood streamed
clients (64-token prompts, 32 answer tokens, ignore_eos) keeps the rank
saturated, with about flood - max-num-seqs requests waiting; after a warm-up, an
urgent probe (32-token prompt, 8 tokens) arrives every --probe-every seconds.
Under `priority` the flood asks for priority 1 and the probes for -1; under
`fcfs` every request is priority 0 (fcfs refuses any other). Reported per
policy: the probes' TTFT p50 / p99 and the flood's TTFT p50 and output tok/s;
and the target's ratio, probe TTFT p99 priority / fcfs (the issue asks <= 0.5).
A probe still without its first token --drain seconds after the window counts
with the time it waited so far (`censored`: a lower bound, so an fcfs figure
can only be understated and the ratio overstated). Figures are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from benchmarks.common import begin, machine_info, parser  # noqa: E402
from benchmarks.engine_realistic import pct, small_model_dir, stream_one, token_prompt  # noqa: E402
from benchmarks.nodes import SERVED_MODEL, DpNode  # noqa: E402

# (flood, probe) priorities per policy
PRIORITIES = {"fcfs": (0, 0), "priority": (1, -1)}


async def _probe(session, url: str, prompt: list[int], priority: int, seen: dict) -> None:
    """One urgent streamed completion; `seen` gets its start and first-token times as they happen."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True, "priority": priority}
    seen["t0"] = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            seen["error"] = f"{resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if "first" not in seen and line.startswith("data: {"):
                if any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                    seen["first"] = time.monotonic()


async def _phase(url: str, policy: str, duration: float, warmup: float, flood: int, probe_every: float,
                 drain: float) -> dict:
    low, high = PRIORITIES[policy]
    stop = time.monotonic() + warmup + duration
    floods: list[dict] = []

    async def flooder(session, i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < stop:
            floods.append(await stream_one(session, url, token_prompt(rng, 64), 32, ignore_eos=True, priority=low))

    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        workers = [asyncio.create_task(flooder(session, i)) for i in range(flood)]
        await asyncio.sleep(warmup)
        window_t0 = time.monotonic()
        floods.clear()  # the window's flood only
        rng, probes, seen = random.Random(1000), [], []
        while time.monotonic() < stop:
            seen.append({})
            probes.append(asyncio.create_task(_probe(session, url, token_prompt(rng, 32), high, seen[-1])))
            await asyncio.sleep(probe_every)
        window = time.monotonic() - window_t0
        await asyncio.wait(probes, timeout=drain)
        cut = time.monotonic()
        for task in [*probes, *workers]:
            task.cancel()  # their streams close: the rank aborts them
        await asyncio.gather(*probes, *workers, return_exceptions=True)
    ttft = [s.get("first", cut) - s["t0"] for s in seen if "t0" in s and "error" not in s]
    floods = [r for r in floods if r.get("t1", cut) <= window_t0 + window]  # finished within the window
    flood_ttft = [r["ttft"] for r in floods if r.get("ttft") is not None]
    tokens = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in floods)
    return {
        "probes": len(seen),
        "probe_errors": sum(1 for s in seen if "error" in s),
        "censored": sum(1 for s in seen if "t0" in s and "first" not in s and "error" not in s),
        "flood_errors": sum(1 for r in floods if "error" in r),
        "probe_ttft_p50_ms": round(pct(ttft, 0.5) * 1000, 1) if ttft else None,
        "probe_ttft_p99_ms": round(pct(ttft, 0.99) * 1000, 1) if ttft else None,
        "flood_ttft_p50_ms": round(pct(flood_ttft, 0.5) * 1000, 1) if flood_ttft else None,
        "flood_done": len(floods),
        "flood_out_tok_s": round(tokens / window, 1),
    }


def preemptions(url: str) -> int:
    """The rank's preemptions so far (vllm:num_preemptions, as its load reports carry it)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_preemptions_total")))


def main(argv=None) -> None:
    ap = parser(__doc__, json=True)
    ap.add_argument("--model", default=None, help="model dir (default: the small demo model, built once)")
    ap.add_argument("--duration", type=float, default=30.0, help="probe window per policy, seconds")
    ap.add_argument("--warmup", type=float, default=6.0, help="flood alone before the probes, seconds")
    ap.add_argument("--flood", type=int, default=16, help="concurrent batch clients")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--probe-every", type=float, default=2.0, help="seconds between urgent probes")
    ap.add_argument("--drain", type=float, default=10.0, help="how long probes may finish after the window, seconds")
    args, run = begin(ap, argv)
    model = small_model_dir(args.model)
    results = {"machine": machine_info(), "date": run.date, "flood": args.flood, "max_num_seqs": args.max_num_seqs}
    for policy in ("fcfs", "priority"):
        node = DpNode(model, dp=1, api=1, extra=["--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs)])
        try:
            node.start(timeout=600)
            out = asyncio.run(_phase(node.url, policy, args.duration, args.warmup, args.flood, args.probe_every, args.drain))
            out["preemptions"] = preemptions(node.url)
        finally:
            node.stop()
        results[policy] = out
        run.log(f"{policy:9s} probe TTFT p50 {out['probe_ttft_p50_ms']} ms  p99 {out['probe_ttft_p99_ms']} ms "
                f"({out['probes']} probes, {out['censored']} censored, {out['probe_errors']} errors)  flood TTFT p50 {out['flood_ttft_p50_ms']} ms, "
                f"{out['flood_out_tok_s']} out tok/s, {out['flood_errors']} errors; {out['preemptions']} preemptions")
    fcfs, prio = results["fcfs"]["probe_ttft_p99_ms"], results["priority"]["probe_ttft_p99_ms"]
    if fcfs and prio is not None:
        results["probe_ttft_p99_priority_over_fcfs"] = round(prio / fcfs, 3)
        run.log(f"probe TTFT p99, priority / fcfs: {results['probe_ttft_p99_priority_over_fcfs']} (target <= 0.5)")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
