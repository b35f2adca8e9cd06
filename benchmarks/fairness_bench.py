#!/usr/bin/env python3
"""Fair shares when the cluster is saturated: admission held at the frontend (issue 28).

    python benchmarks/fairness_bench.py [--engine sim|native|vllm] [--only noisy jain priority]
                                        [--phase-s S] [--hold N] [--ranks N] [--json]

Tenants come from a TOML key file (--api-key-file); each scenario runs on one
cluster, phases back to back. Figures are printed, never asserted.

- noisy: 4 tenants of equal weight. Alone: one quiet tenant sends at half its
  share (open loop, Poisson), or, with --alone-group, the three quiet tenants
  do, without the noisy one; then the same three quiet tenants and a fourth
  sending 10x its share. The quiet tenants' TTFT p99 against the alone p99
  (the issue asks <= 1.2x), and the noisy one's 429s. t1 by itself never meets
  another request of its class; the three together meet each other's, as
  they do beside the noisy one: --alone-group measures the neighbour alone.
- jain: 4 tenants of equal weight, each backlogged (closed loop, more clients
  than its share of batch places), asking 4 / 8 / 16 / 32 answer tokens: Jain's
  index of the tokens each is delivered (prompt + answer) in 10 s windows
  (the issue asks >= 0.95: fair by tokens, not by requests).
- priority: an interactive tenant (priority 0) at a low rate, alone, then
  while a bulk tenant (priority 1) floods: its TTFT p99 against unloaded (the
  issue asks <= 1.1x).

--engine sim: simulated ranks (engine/testing/sim.py) at the realistic model's
measured speeds on this CPU (benchmarks/prefix_sim.py: prefill 245 tokens/s, a
decode step of 215 ms + 5.3 ms a sequence, taken at --max-num-seqs). native / vllm:
the realistic model (`dpserve demo-model --size small`) on one node, DP 1,
--scheduling-policy priority (vllm: vLLM's engine in the rank, which sees
`priority`); the scenarios' rates are shares of the capacity measured first (requests/s
finished with every place taken; --capacity sets it). --hold N: --hold-waiting-per-rank; --hold -1 turns the frontend's
hold off (--no-admission-hold: every request straight to a rank's FIFO), for the comparison.
--reserve S [S ...]: --reserve-window-s (0: no places reserved by recent demand); with several,
one cluster each, in turn, --rounds times (e.g. `--reserve 5 0 --rounds 3`: the throughput
cost of reservations measured back to back on one machine, with the mean tokens/s of each).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from benchmarks.common import begin, fmt, load_average, parser, render, vllm_python  # noqa: E402

PREFILL_TOKENS_PER_S = 245.0  # the realistic model, eager, 1 thread (benchmarks/prefix_sim.py)
DECODE_BASE_MS, DECODE_PER_SEQ_MS = 215.0, 5.3
WINDOW_S = 10.0
_PHASES = itertools.count()
PROMPT = [1000 + i for i in range(8)]  # 8 token ids: the answers' sizes, not the prompt, set a request's cost


@dataclass
class Result:
    tenant: str
    t0: float
    status: int = 0
    t_first: float = 0.0
    t_end: float = 0.0
    tokens: int = 0  # prompt + completion (usage)

    @property
    def ttft(self) -> float:
        return self.t_first - self.t0


@dataclass
class Tenants:
    """name -> (key, weight, priority); written as the TOML key file."""

    spec: dict[str, tuple[float, int]]
    keys: dict[str, str] = field(default_factory=dict)

    def write(self, directory: str) -> str:
        lines = []
        for name, (weight, priority) in self.spec.items():
            self.keys[name] = f"sk-bench-{name}-{os.urandom(6).hex()}"
            lines += [f"[tenants.{name}]", f'key = "{self.keys[name]}"', f"weight = {weight}", f"priority = {priority}", ""]
        path = os.path.join(directory, "tenants.toml")
        Path(path).write_text("\n".join(lines))
        return path


TENANTS = Tenants({"t0": (1, 0), "t1": (1, 0), "t2": (1, 0), "t3": (1, 0), "interactive": (1, 0), "bulk": (1, 1)})


# ----------------------------------------------------------------- load


async def request(http: aiohttp.ClientSession, url: str, model: str, tenant: str, max_tokens: int, out: list[Result]) -> None:
    res = Result(tenant, time.monotonic())
    out.append(res)
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {TENANTS.keys[tenant]}"}
    try:
        async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
            res.status = resp.status
            if resp.status != 200:
                await resp.read()
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not res.t_first and any(c.get("text") for c in chunk.get("choices", ())):
                    res.t_first = time.monotonic()
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["total_tokens"]
            res.t_end = time.monotonic()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        res.status = -1


async def open_loop(http, url, model, tenant: str, rate: float, max_tokens: int, until: float, out: list, tasks: list) -> None:
    rng = random.Random(f"{tenant}/{next(_PHASES)}")  # (each phase its own arrivals: --pairs pools independent ones)
    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.monotonic() >= until:
            return
        size = rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2)  # varied: batch places free at varied steps
        tasks.append(asyncio.create_task(request(http, url, model, tenant, size, out)))


async def closed_loop(http, url, model, tenant: str, clients: int, max_tokens: int, until: float, out: list) -> None:
    rng = random.Random(f"{tenant}/closed/{next(_PHASES)}")

    async def client():
        while time.monotonic() < until:
            await request(http, url, model, tenant, rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2), out)
    await asyncio.gather(*(client() for _ in range(clients)))


async def phase(url: str, model: str, seconds: float, drain_s: float, open_loops=(), closed_loops=()) -> list[Result]:
    """Run the loads for `seconds`; requests still open `drain_s` later are cancelled (their clients leave)."""
    out: list[Result] = []
    tasks: list[asyncio.Task] = []
    until = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        loops = [asyncio.create_task(open_loop(http, url, model, *spec, until, out, tasks)) for spec in open_loops]
        loops += [asyncio.create_task(closed_loop(http, url, model, *spec, until, out)) for spec in closed_loops]
        await asyncio.gather(*loops)
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return out


# ----------------------------------------------------------------- figures


def p99(values: list[float]) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))] if values else None


def ttfts(results: list[Result], tenant: str) -> list[float]:
    return [r.ttft for r in results if r.tenant == tenant and r.status == 200 and r.t_first]


def delivered(results: list[Result], seconds: float) -> float:
    """Tokens (prompt + completion) delivered per second of a phase's load, within it (spread evenly
    from a request's first token to its end: the drain after the load stops is left out)."""
    start = min((r.t0 for r in results), default=0.0)
    return sum(r.tokens * overlap(r, start, start + seconds) for r in results if r.status == 200 and r.t_end) / seconds


def overlap(r: Result, start: float, end: float) -> float:
    """The part of `r`'s tokens delivered between start and end."""
    span = max(r.t_end - r.t_first, 1e-6)
    return max(0.0, min(r.t_end, end) - max(r.t_first, start)) / span


def jain(xs: list[float]) -> float | None:
    return (sum(xs) ** 2) / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else None


def window_tokens(results: list[Result], tenants: list[str], start: float, end: float) -> list[dict[str, float]]:
    """The tokens delivered to each tenant in each 10 s window (a request's spread as delivered)."""
    out = []
    t = start
    while t + WINDOW_S <= end:
        got = dict.fromkeys(tenants, 0.0)
        for r in results:
            if r.status != 200 or not r.t_end or r.t_end <= t or r.t_first >= t + WINDOW_S:
                continue
            got[r.tenant] += r.tokens * overlap(r, t, t + WINDOW_S)
        out.append(got)
        t += WINDOW_S
    return out


def log_ttfts(args, scenario: str, phases: dict[str, list[Result]], *tenants: str) -> None:
    """With --ttft-log: a line a request of `tenants` (scenario, phase, tenant, monotonic start, TTFT, status)."""
    if not args.ttft_log:
        return
    with open(args.ttft_log, "a") as f:
        for name, results in phases.items():
            for r in results:
                if r.tenant in tenants:
                    f.write(f"{scenario} {name} {r.tenant} {r.t0:.4f} {r.ttft if r.t_first else -1:.4f} {r.status}\n")


# ----------------------------------------------------------------- scenarios


async def noisy(url, model, args, capacity: float) -> dict:
    share = capacity / 4
    rate, drain = share / 2, args.phase_s
    quiet = ("t1", "t2", "t3")
    solo = quiet if args.alone_group else ("t1",)  # alone: the quiet tenants without the noisy one, or t1 by itself
    alone, loaded, pairs = [], [], []
    flood = [("t0", 10 * share, args.max_tokens)] + [(t, rate, args.max_tokens) for t in quiet]
    if args.warmup_s:  # a loaded phase first, not counted: the rank's first preemptions and urgent steps
        await phase(url, model, args.warmup_s, drain, open_loops=flood)
    for _ in range(args.pairs):  # alone and loaded alternate: a drift in the machine's load hits both
        a = await phase(url, model, args.alone_s or args.phase_s, drain, open_loops=[(t, rate, args.max_tokens) for t in solo])
        b = await phase(url, model, args.phase_s, drain, open_loops=flood)
        alone += a
        loaded += b
        pairs.append(([x for t in solo for x in ttfts(a, t)], [x for t in quiet for x in ttfts(b, t)], delivered(b, args.phase_s)))
    log_ttfts(args, "noisy", {"alone": alone, "loaded": loaded}, *quiet)
    alone_pooled = [x for t in solo for x in ttfts(alone, t)]
    base = p99(alone_pooled)
    rows = {t: p99(ttfts(loaded, t)) for t in quiet}
    pooled = [x for t in quiet for x in ttfts(loaded, t)]
    return {"share_req_s": share, "quiet_rate": rate, "alone": "t1-t3" if args.alone_group else "t1", "alone_p99_s": base,
            "loaded_p99_s": rows, "worst_ratio": max(v / base for v in rows.values()) if base and all(rows.values()) else None,
            **spread(alone_pooled, pooled, pairs),
            "loaded_tok_s": sum(p[2] for p in pairs) / len(pairs),
            "noisy_sent": sum(r.tenant == "t0" for r in loaded), "noisy_429": sum(r.tenant == "t0" and r.status == 429 for r in loaded),
            "quiet_not_200": sum(r.tenant != "t0" and r.status != 200 for r in loaded)}


def spread(base: list[float], under: list[float], pairs: list[tuple[list[float], list[float], float]]) -> dict:
    """The pooled ratio of p99s, sample counts, each side's p50 / p90, each pair's ratio, a bootstrap 90% interval."""
    if not base or not under:
        return {"pooled_ratio": None}
    rng = random.Random(28)
    boots = sorted(p99(rng.choices(under, k=len(under))) / p99(rng.choices(base, k=len(base))) for _ in range(500))
    q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))]  # noqa: E731
    return {"pooled_ratio": p99(under) / p99(base), "n_base": len(base), "n_under": len(under),
            "base_p50_p90_p99": [q(base, 0.5), q(base, 0.9), p99(base)], "under_p50_p90_p99": [q(under, 0.5), q(under, 0.9), p99(under)],
            "pair_ratios": [p99(u) / p99(b) if b and u else None for b, u, _ in pairs], "pair_tok_s": [t for _, _, t in pairs],
            "ratio_ci90": [boots[25], boots[474]]}


async def fair_tokens(url, model, args, slots: int) -> dict:
    names, sizes = ["t0", "t1", "t2", "t3"], [4, 8, 16, 32]
    clients = slots  # each tenant alone could fill every place: all four stay backlogged
    t0 = time.monotonic()
    res = await phase(url, model, args.jain_s, 0.0, closed_loops=[(n, clients, s) for n, s in zip(names, sizes)])
    by_window = window_tokens(res, names, t0 + WINDOW_S / 2, t0 + args.jain_s)  # (the first half window fills the ranks)
    idx = [jain(list(got.values())) for got in by_window]
    tokens = {n: sum(r.tokens for r in res if r.tenant == n and r.status == 200) for n in names}
    return {"windows": idx, "min": min((i for i in idx if i is not None), default=None), "tokens": tokens,
            "window_tokens": [[round(got[n]) for n in names] for got in by_window],
            "requests": {n: sum(r.tenant == n and r.status == 200 for r in res) for n in names}}


async def measure_capacity(url, model, args, slots: int, warm_s: float = 5.0, seconds: float = 15.0) -> float:
    """Requests/s finished with every place taken (t0 alone, twice the places in clients, closed loop)."""
    t0 = time.monotonic()
    res = await phase(url, model, warm_s + seconds, 0.0, closed_loops=[("t0", 2 * slots, args.max_tokens)])
    return sum(r.status == 200 and t0 + warm_s <= r.t_end < t0 + warm_s + seconds for r in res) / seconds


async def priority(url, model, args, slots: int, capacity: float) -> dict:
    rate = capacity / 8
    alone, loaded, pairs = [], [], []
    for _ in range(args.pairs):  # alone and loaded alternate: a drift in the machine's load hits both
        a = await phase(url, model, args.alone_s or args.phase_s, args.phase_s, open_loops=[("interactive", rate, args.max_tokens)])
        b = await phase(url, model, args.phase_s, args.phase_s, open_loops=[("interactive", rate, args.max_tokens)],
                        closed_loops=[("bulk", 3 * slots, args.max_tokens)])
        alone += a
        loaded += b
        pairs.append((ttfts(a, "interactive"), ttfts(b, "interactive"), delivered(b, args.phase_s)))
    base, under = p99(ttfts(alone, "interactive")), p99(ttfts(loaded, "interactive"))
    log_ttfts(args, "priority", {"alone": alone, "loaded": loaded}, "interactive")
    return {"rate": rate, "unloaded_p99_s": base, "flooded_p99_s": under, "ratio": under / base if base and under else None,
            **spread(ttfts(alone, "interactive"), ttfts(loaded, "interactive"), pairs),
            "bulk_served": sum(r.tenant == "bulk" and r.status == 200 for r in loaded), "loaded_tok_s": sum(p[2] for p in pairs) / len(pairs)}


# ----------------------------------------------------------------- clusters


def env_of(spec: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in spec.split(",") if "=" in kv)


def start_cluster(args, tenants_file: str, reserve: float, env: dict[str, str]):
    """(base url, model name, stop) of the cluster --engine asks for."""
    if args.engine == "sim":
        from benchmarks.simcluster import SimCluster

        step_ms = DECODE_BASE_MS + DECODE_PER_SEQ_MS * args.max_num_seqs
        c = SimCluster(args.ranks, num_api_servers=args.api_servers, ranks_per_process=args.ranks, report_interval_s=0.2,
                       decode_step_ms=step_ms, prefill_tokens_per_s=PREFILL_TOKENS_PER_S, max_num_seqs=args.max_num_seqs,
                       api_options={"tenants_file": tenants_file, "admission_hold": args.hold >= 0, "api_server_count": args.api_servers,
                                    "hold_waiting_per_rank": max(0, args.hold), "reserve_window_s": reserve})
        saved = dict(os.environ)
        os.environ.update(env)  # its processes inherit the environment: --env reaches them
        try:
            c.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        c.wait_routable(args.ranks, timeout=60)
        return c.url.removesuffix("/v1"), "sim", c.stop, step_ms / 1000
    from benchmarks.engine_realistic import small_model_dir
    from benchmarks.nodes import SERVED_MODEL, DpNode

    python = vllm_python(None) if args.engine == "vllm" else None
    hold = ["--no-admission-hold"] if args.hold < 0 else ["--hold-waiting-per-rank", str(args.hold), "--reserve-window-s", str(reserve)]
    extra = ["--api-key-file", tenants_file, *hold, "--scheduling-policy", "priority",
             "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048"] + (["--engine", "vllm"] if args.engine == "vllm" else [])
    extra += shlex.split(args.serve_args)
    node = DpNode(small_model_dir(args.model), dp=args.ranks, api=args.api_servers, extra=extra, python=python,
                  env={**({"DPSERVE_ENFORCE_EAGER": "1"} if args.engine == "native" else {}), **env})
    node.spawn()
    node.wait_ready(600)
    return node.url, SERVED_MODEL, node.stop, (DECODE_BASE_MS + DECODE_PER_SEQ_MS * args.max_num_seqs) / 1000


def main(argv=None) -> None:
    p = parser(__doc__, json=True)
    p.add_argument("--engine", choices=("sim", "native", "vllm"), default="sim")
    p.add_argument("--only", nargs="+", choices=("noisy", "jain", "priority"), default=["noisy", "jain", "priority"])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--api-servers", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=12, help="answer tokens of the noisy and priority scenarios")
    p.add_argument("--hold", type=int, default=1, help="--hold-waiting-per-rank (-1: --no-admission-hold)")
    p.add_argument("--reserve", type=float, nargs="+", default=[5.0], help="--reserve-window-s (0: no reserved places); several: one cluster each, in turn")
    p.add_argument("--rounds", type=int, default=1, help="run the --reserve values in turn this many times")
    p.add_argument("--env", nargs="+", default=["-"], help="environments for the node's processes, one cluster each, in turn "
                   "(\"K=V,K=V\"; \"-\": none), e.g. the levers' switches for an A/B within one run")
    p.add_argument("--capacity", type=float, default=0.0, help="requests/s the cluster finishes when full (default: sim: "
                   "from its step model; native / vllm: measured first, t0 alone filling every place)")
    p.add_argument("--warmup-s", type=float, default=0.0, help="noisy: a loaded phase this long before the pairs, not counted")
    p.add_argument("--phase-s", type=float, default=15.0)
    p.add_argument("--jain-s", type=float, default=30.0)
    p.add_argument("--pairs", type=int, default=1, help="noisy / priority: alone and loaded phases, alternated, this many times (pooled)")
    p.add_argument("--alone-s", type=float, default=0.0, help="an alone phase's length (default --phase-s)")
    p.add_argument("--alone-group", action="store_true", help="noisy: the alone phases run the three quiet tenants "
                   "together (their TTFT without the noisy neighbour), not t1 by itself")
    p.add_argument("--model", default=None, help="a real engine's model directory (default: the realistic demo model, "
                   "built once)")
    p.add_argument("--serve-args", default="", help="more `dpserve serve` arguments for a real engine's node, e.g. "
                   "\"--dtype float32\" (with --env OMP_NUM_THREADS=1: the step times of a slower CPU on a faster one)")
    p.add_argument("--ttft-log", default=None, help="append each quiet / interactive request's TTFT to this file")
    args, run = begin(p, argv)
    runs = [run_once(args, run, reserve, env) for _ in range(args.rounds) for reserve in args.reserve for env in args.env]
    if args.json:
        print(json.dumps(run.info(runs=runs), indent=1))
        return
    for out in runs:
        report(out)
    if len(runs) > 1:
        compare(runs)


def run_once(args, run, reserve: float, env: str) -> dict:
    """--only's scenarios on one cluster (--reserve-window-s `reserve`, environment `env`), on the same arrivals."""
    global _PHASES
    _PHASES = itertools.count()
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        url, model, stop, step_s = start_cluster(args, TENANTS.write(tmp), reserve, env_of(env))
        try:
            slots = args.ranks * args.max_num_seqs
            # requests/s the batch places finish: the simulated engine's by its step model
            capacity = args.capacity or (slots / ((args.max_tokens + 1) * step_s) if args.engine == "sim" else 0.0)
            if not capacity:  # a real engine's: measured, once a run (every cluster gets one load), on seeds of its own
                run.log("measuring the cluster's capacity ...")
                capacity = args.capacity = asyncio.run(measure_capacity(url, model, args, slots))
                _PHASES = itertools.count()  # (they made the first cluster's arrivals other than the next ones')
            out = {"engine": args.engine, "hold": args.hold, "reserve": reserve, "env": env, "ranks": args.ranks, "slots": slots, "capacity_req_s": capacity}
            for name in args.only:
                run.log(f"{name} (reserve {reserve:g} s) ...")
                fn = {"noisy": lambda: noisy(url, model, args, capacity), "jain": lambda: fair_tokens(url, model, args, slots),
                      "priority": lambda: priority(url, model, args, slots, capacity)}[name]
                out[name] = asyncio.run(fn())
                out[name]["loadavg"] = load_average()
        finally:
            stop()
    return out


def compare(runs: list[dict]) -> None:
    """Several runs: each scenario's loaded tokens/s and ratio, mean by reserve window."""
    rows = []
    for name, key in (("noisy", "worst_ratio"), ("priority", "ratio")):
        by: dict[float, list[dict]] = {}
        for out in runs:
            if name in out:
                by.setdefault((out["reserve"], out.get("env", "-")), []).append(out[name])
        for (reserve, env), got in by.items():
            tok = [g["loaded_tok_s"] for g in got]
            ratios = [g[key] for g in got if g[key] is not None]
            pooled = [g["pooled_ratio"] for g in got if g.get("pooled_ratio") is not None]
            rows.append([name, f"{reserve:g}", env, str(len(got)), f"{sum(tok) / len(tok):.0f}", " ".join(f"{t:.0f}" for t in tok),
                         " ".join(fmt(r, 2) for r in ratios), " ".join(fmt(r, 2) for r in pooled)])
    print("by reserve window and environment (runs in turn):")
    print(render(["scenario", "reserve s", "env", "runs", "tok/s mean", "tok/s each", "TTFT ratio each", "pooled each"], rows))


def pooled_row(name: str, x: dict, asked: str) -> list[str]:
    if x.get("pooled_ratio") is None:
        return [name, "-", asked, "no samples"]
    ci = x["ratio_ci90"]
    return [name, fmt(x["pooled_ratio"], 2), asked,
            f"n {x['n_base']} / {x['n_under']}; p50/p90/p99 {' '.join(fmt(v, 3) for v in x['base_p50_p90_p99'])} s vs "
            f"{' '.join(fmt(v, 3) for v in x['under_p50_p90_p99'])} s; 90% CI {fmt(ci[0], 2)}-{fmt(ci[1], 2)}; "
            f"pairs {' '.join(fmt(r, 2) for r in x['pair_ratios'])}; tok/s {' '.join(f'{t:.0f}' for t in x['pair_tok_s'])}"]


def report(out: dict) -> None:
    rows = []
    if "noisy" in out:
        n = out["noisy"]
        rows.append(["noisy: quiet TTFT p99 / alone", fmt(n["worst_ratio"], 2), "<= 1.2",
                     f"alone ({n['alone']}) {fmt(n['alone_p99_s'], 3)} s, loaded {', '.join(fmt(v, 3) for v in n['loaded_p99_s'].values())}; "
                     f"noisy 429 {n['noisy_429']}/{n['noisy_sent']}, quiet errors {n['quiet_not_200']}; {n['loaded_tok_s']:.0f} tok/s"])
        rows.append(pooled_row("noisy: pooled quiet p99 / alone p99", n, "<= 1.2"))
    if "jain" in out:
        j = out["jain"]
        rows.append(["jain: min over 10 s windows", fmt(j["min"], 3), ">= 0.95",
                     f"windows {', '.join(fmt(w, 3) for w in j['windows'])}; tokens {j['tokens']}; "
                     f"by window {' '.join('/'.join(map(str, w)) for w in j['window_tokens'])}"])
    if "priority" in out:
        q = out["priority"]
        rows.append(["priority: interactive TTFT p99 / unloaded", fmt(q["ratio"], 2), "<= 1.1",
                     f"unloaded {fmt(q['unloaded_p99_s'], 3)} s, flooded {fmt(q['flooded_p99_s'], 3)} s; bulk served {q['bulk_served']}; {q['loaded_tok_s']:.0f} tok/s"])
        rows.append(pooled_row("priority: pooled, spread", q, "<= 1.1"))
    print(f"engine {out['engine']}, hold {out['hold']}, reserve {out['reserve']:g} s, env {out.get('env') or '-'}, {out['ranks']} ranks, {out['slots']} places, "
          f"capacity ~{out['capacity_req_s']:.1f} req/s; load {load_average()}")
    print(render(["target", "figure", "asked", "detail"], rows))


if __name__ == "__main__":
    main()
