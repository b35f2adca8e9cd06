#!/usr/bin/env python3
"""Hostile input against a real node: how fast each case is answered, and what it costs everyone else.

    .venv/bin/python benchmarks/hostile_bench.py [--window-s 4] [--case-timeout-s 15] [--budget-s 165] [--only NAME ...]

Starts one node (DP 2, 2 API servers, the demo model, loopback only) and runs the
cases of the hostile-input issue (grammars, n x grammar, broken constraints,
amplification, clients that never read, a ZeroMQ peer posing as rank 0, the small
request items). For each case it repeats the hostile request for --window-s
seconds (one at a time, each bounded by --case-timeout-s; a response body is read
and counted, never kept) while two clients send normal short completions, and
prints: the hostile request's status(es) and time to its first answer (the
headers), how many bytes it produced, normal requests' p50/p99 beside their
unloaded values, normal requests that failed, process restarts seen in /status,
the ranks' RSS change (psutil), and how long the ranks stay busy after the case
(up to --settle-s: work left for clients that are gone). It asserts nothing: the figures are the
result. --budget-s bounds the whole run (cases left over are listed as skipped),
so a default run takes about three minutes on two cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from benchmarks.common import begin, ensure_demo_model, fmt, parser, render  # noqa: E402
from benchmarks.nodes import SERVED_MODEL, DpNode  # noqa: E402

NORMAL = {"model": SERVED_MODEL, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
NORMAL_CLIENTS = 2
READ_CAP = 64 << 20  # bytes read of one hostile answer before the bench hangs up (counted as 'capped')


def _completion(**kw) -> dict:
    return {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 20, **kw}


def _choices(n: int) -> list[str]:
    return [f"choice number {i:06d}" for i in range(n)]


def _schema_props(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


SELF_REF = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                      "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
            "$ref": "#/$defs/a"}
AMPLIFY = dict(max_tokens=0, echo=True, logprobs=20, prompt_logprobs=20, n=128)


@dataclass
class Case:
    name: str
    item: str
    path: str = "/v1/completions"
    body: dict | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    raw: Callable[[DpNode, float], Awaitable[None]] | None = None  # cases that are not one HTTP request


def cases() -> list[Case]:
    return [
        Case("choice 300k (2.9 MB)", "1", body=_completion(guided_choice=_choices(300_000))),
        Case("json_schema 5,000 props", "1", body=_completion(guided_json=_schema_props(5000))),
        Case("n=128 x choice 10k", "2", body=_completion(n=128, guided_choice=_choices(10_000))),
        Case("choice 3,000", "3", body=_completion(guided_choice=_choices(3000))),
        Case("choice 10,000", "3", body=_completion(guided_choice=_choices(10_000))),
        Case("regex a{100000}", "3", body=_completion(guided_regex="a{100000}")),
        Case("regex a{1000000}", "3", body=_completion(guided_regex="a{1000000}")),
        Case("regex ((a{100}){100}){100}", "3", body=_completion(guided_regex="((a{100}){100}){100}")),
        Case("json_schema $ref a->b->a", "3", body=_completion(guided_json=SELF_REF)),
        Case("echo+logprobs n=128, 2,040 ids", "4", body=_completion(prompt=[(i * 7) % 500 + 3 for i in range(2040)], **AMPLIFY)),
        Case("same, 256 prompts x 1,000 ids", "4",
             body=_completion(prompt=[[(i * 7 + j) % 500 + 3 for i in range(1000)] for j in range(256)], **AMPLIFY)),
        Case("chat prompt_logprobs 20, n=128", "4", "/v1/chat/completions",
             body={"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                   "prompt_logprobs": 20, "n": 128}),
        Case("Expect: 200-ok", "7", body=NORMAL, headers=[("Expect", "200-ok")]),
        Case("prompt [[\"a\"]]", "7", body=_completion(prompt=[["a"]])),
        Case("two X-data-parallel-rank", "7", body=NORMAL, headers=[("X-data-parallel-rank", "0"), ("X-data-parallel-rank", "x")]),
        Case("guided_choice []", "7", body=_completion(guided_choice=[])),
        Case("top_logprobs w/o logprobs", "7", "/v1/chat/completions",
             body={"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 5}),
        Case("ZeroMQ peer as rank 0", "6", raw=rank_zero_impostor),
        Case("32 never-reading streams", "5", raw=never_reading_streams),  # last: its engines may run on
    ]


# ----------------------------------------------------------------- clients


async def normal_load(session, url: str, until: float, lat: list[float], failed: list[str]) -> None:
    """One client in a closed loop of normal completions until `until` (monotonic)."""
    import aiohttp

    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            async with session.post(url + "/v1/completions", json=NORMAL, timeout=aiohttp.ClientTimeout(total=60)) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, resp = False, exc
        if ok:
            lat.append(time.monotonic() - t0)
        else:
            failed.append(str(getattr(resp, "status", type(resp).__name__)))


async def hostile_once(url: str, case: Case, data: bytes, timeout: float) -> tuple[str, float | None, int]:
    """(status, seconds to the headers, bytes read) of one request over a fresh connection."""
    import aiohttp

    headers = [("Content-Type", "application/json"), *case.headers]
    t0 = time.monotonic()
    first, size = None, 0
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.post(url + case.path, data=data, headers=headers) as resp:
                first = time.monotonic() - t0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > READ_CAP:
                        return f"{resp.status} capped", first, size
                return str(resp.status), first, size
    except asyncio.TimeoutError:
        return "timeout", first, size
    except aiohttp.ClientError as exc:
        return type(exc).__name__, first, size


async def never_reading_streams(node: DpNode, hold: float) -> None:
    """32 streams of n=4, max_tokens 2000, logprobs 20 whose clients never read a byte."""
    body = json.dumps(_completion(n=4, max_tokens=2000, logprobs=20, stream=True, prompt="Once")).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    writers = []
    try:
        for _ in range(32):
            _, writer = await asyncio.open_connection("127.0.0.1", node.port)
            writer.transport.pause_reading()  # the kernel's receive queue fills; nothing is read
            writer.write(head + body)
            writers.append(writer)
        await asyncio.sleep(hold)
    finally:
        for writer in writers:
            writer.transport.abort()


async def rank_zero_impostor(node: DpNode, hold: float) -> None:
    """A local DEALER on API server 0's engine socket with rank 0's old identity, then
    requests pinned to rank 0 through the normal port (their answers are in the row)."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"0")
        sock.connect(f"ipc://{node.tmp}/run/api-0.engines")
        await sock.send(b"\x00garbage")
        await asyncio.sleep(hold)
    finally:
        ctx.destroy(linger=0)


# ----------------------------------------------------------------- measuring


def engine_pids(node: DpNode) -> list[int]:
    return [c["pid"] for c in node.status()["children"] if c["kind"] == "engine" and c["pid"]]


def rss_mb(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            pass
    return total


def restarts(node: DpNode) -> int:
    return sum(c.get("restarts", 0) for c in node.status()["children"])


def busy_for(node: DpNode, limit: float) -> float | None:
    """Seconds until no rank runs or queues a request (the coordinator's table, in
    /status); None if still busy after `limit` (the work a case left behind)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        ranks = node.status()["cluster"]["ranks"]
        if all(r["running"] == 0 and r["waiting"] == 0 for r in ranks):
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def measure_normal(url: str, seconds: float) -> tuple[list[float], list[str]]:
    import aiohttp

    lat: list[float] = []
    failed: list[str] = []
    until = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(normal_load(session, url, until, lat, failed) for _ in range(NORMAL_CLIENTS)))
    return lat, failed


async def run_case(node: DpNode, case: Case, window: float, timeout: float, settle: float) -> dict:
    """The hostile request repeated for `window` s beside the normal clients."""
    import aiohttp

    url = node.url
    restarts_before, pids = restarts(node), engine_pids(node)
    rss_before = rss_mb(pids)
    lat: list[float] = []
    failed: list[str] = []
    answers: list[tuple[str, float | None, int]] = []
    until = time.monotonic() + window

    async def hostile() -> None:
        if case.raw is not None:
            await case.raw(node, window)
            answers.append(("sent", None, 0))
            return
        data = json.dumps(case.body).encode()
        while True:
            answers.append(await hostile_once(url, case, data, timeout))
            if time.monotonic() >= until:
                return

    async def pinned() -> None:  # the impostor case: what rank 0's own clients get
        if case.raw is rank_zero_impostor:
            await asyncio.sleep(1.0)
            pin = Case("pinned", "6", body=NORMAL, headers=[("X-data-parallel-rank", "0")])
            while time.monotonic() < until:
                answers.append(await hostile_once(url, pin, json.dumps(NORMAL).encode(), timeout))

    async with aiohttp.ClientSession() as session:
        normals = [normal_load(session, url, until, lat, failed) for _ in range(NORMAL_CLIENTS)]
        await asyncio.gather(hostile(), pinned(), *normals)
    await asyncio.sleep(0.5)  # a rank the case killed shows in /status by now
    busy = busy_for(node, settle)
    statuses = sorted({a[0] for a in answers})
    firsts = [a[1] for a in answers if a[1] is not None]
    return {
        "case": case.name, "item": case.item, "statuses": statuses, "sent": len(answers),
        "first_s": firsts[0] if firsts else None, "max_s": max(firsts) if firsts else None,
        "mb": max((a[2] for a in answers), default=0) / 2**20, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
        "normal_ok": len(lat), "normal_failed": len(failed), "restarts": restarts(node) - restarts_before,
        "rss_delta": rss_mb(engine_pids(node)) - rss_before, "busy": busy, "settle": settle,
    }


def table(rows: list[dict], base_p50: float | None, base_p99: float | None) -> str:
    header = ["case", "item", "status", "sent", "1st answer s", "max s", "MB", "p50 ms", "p99 ms",
              "p99/unloaded", "normal ok/failed", "restarts", "rank RSS d MB", "ranks busy after s"]
    body = [["unloaded (normal only)", "-", "200", "-", "-", "-", "-", fmt(base_p50, 0), fmt(base_p99, 0), "1.0", "-", "-", "-", "-"]]
    for r in rows:
        if "skipped" in r:
            body.append([r["case"], r["item"], r["skipped"], *["-"] * 11])
            continue
        rel = r["p99"] / base_p99 if r["p99"] is not None and base_p99 else None
        body.append([r["case"], r["item"], ",".join(r["statuses"]), str(r["sent"]), fmt(r["first_s"], 2), fmt(r["max_s"], 2),
                     fmt(r["mb"], 1), fmt(r["p50"], 0), fmt(r["p99"], 0), fmt(rel, 1),
                     f"{r['normal_ok']}/{r['normal_failed']}", str(r["restarts"]), fmt(r["rss_delta"], 0),
                     fmt(r["busy"], 1) if r["busy"] is not None else f">{r['settle']:g}"])
    return render(header, body)


async def bench(args, run) -> None:
    model = ensure_demo_model(args.model_dir)
    t_start = time.monotonic()
    node = DpNode(model, dp=2, api=2)
    try:
        node.start(timeout=180)
        run.log(f"node ready in {node.ready_s:.1f} s (DP 2, 2 API servers, demo model, {os.cpu_count()} CPUs)")
        await measure_normal(node.url, 1.0)  # warm-up
        lat, _ = await measure_normal(node.url, args.window_s)
        base_p50, base_p99 = pct(lat, 0.5), pct(lat, 0.99)
        rss_start = rss_mb(engine_pids(node))
        rows = []
        for case in cases():
            if args.only and not any(word.lower() in case.name.lower() for word in args.only):
                continue
            left = args.budget_s - (time.monotonic() - t_start)
            if left < args.window_s + 5:
                rows.append({"case": case.name, "item": case.item, "skipped": "skipped (budget)"})
                continue
            row = await run_case(node, case, args.window_s, min(args.case_timeout_s, left - args.window_s), args.settle_s)
            run.log(f"  {case.name}: {','.join(row['statuses'])} first answer {fmt(row['first_s'], 2)} s, "
                    f"normal p99 {fmt(row['p99'], 0)} ms, restarts {row['restarts']}")
            rows.append(row)
        rss_end = rss_mb(engine_pids(node))
        print(table(rows, base_p50, base_p99))
        print(f"\nranks' RSS: {rss_start:,.0f} MB before the cases, {rss_end:,.0f} MB after "
              f"({rss_end - rss_start:+,.0f} MB); total restarts {restarts(node)}; run {time.monotonic() - t_start:.0f} s")
    finally:
        node.stop()


def main(argv=None) -> None:
    p = parser(__doc__, model_dir=True, prog="benchmarks/hostile_bench.py")
    p.add_argument("--window-s", type=float, default=4.0, help="seconds each case repeats beside the normal clients")
    p.add_argument("--case-timeout-s", type=float, default=15.0, help="the longest one hostile request may take")
    p.add_argument("--settle-s", type=float, default=5.0, help="after a case, how long to wait for the ranks to go idle")
    p.add_argument("--budget-s", type=float, default=165.0, help="the whole run's bound; later cases are skipped")
    p.add_argument("--only", nargs="*", default=[], help="run only the cases whose name holds one of these words")
    args, run = begin(p, argv)
    asyncio.run(bench(args, run))


if __name__ == "__main__":
    main()
