#!/usr/bin/env python3
"""dpserve's benchmark suite: one command, one table.

    python benchmarks/suite.py            # full run (about 6 minutes on 2 cores)
    python benchmarks/suite.py --quick    # about 1.5 minutes
    python benchmarks/suite.py --json     # one JSON object instead of the tables

For each configuration (DP size / API-server count; default dp1/api1,
dp1/api2, dp2/api2) it starts `dpserve serve` on the demo model (built with
`dpserve demo-model` into a cache dir), drives it with benchmarks/load.py
(8-word prompts, ignore_eos, closed loop) and measures:

- req/s at max_tokens=1, concurrency 32 and 128;
- streaming output tok/s, TTFT p50/p99 and ITL p99 at max_tokens=16 and 64;
- API-server CPU per request: psutil CPU time of the api-* children (pids
  from the supervisor's /status) over the measured window, per request;
- API-server RSS (the largest api-* process);
- time from start to ready (supervisor /readyz 200) for api-server-count
  1, 2, 4 and 8 at DP=1.

The bare aiohttp baseline (benchmarks/baseline_aiohttp.py) runs the
max_tokens=1 workloads too, as the practical ceiling for CPU per request.
Measure as ratios within one run: the machine is shared and noisy.
Figures are printed, never asserted.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import begin, ensure_demo_model, fmt, load_average, parser, ratio, render  # noqa: E402
from benchmarks.load import LoadConfig  # noqa: E402
from benchmarks.nodes import BaselineNode, DpNode, Measured, measure_sync  # noqa: E402


@dataclass(frozen=True)
class Workload:
    key: str
    max_tokens: int
    stream: bool
    concurrency: int

    @property
    def title(self) -> str:
        return f"{'stream ' if self.stream else ''}max_tokens={self.max_tokens}, c={self.concurrency}"


def workloads(stream_concurrency: list[int]) -> list[Workload]:
    out = [Workload("mt1_c32", 1, False, 32), Workload("mt1_c128", 1, False, 128)]
    for c in stream_concurrency:
        out += [Workload(f"s16_c{c}", 16, True, c), Workload(f"s64_c{c}", 64, True, c)]
    return out


def load_config(url: str, w: Workload, args) -> LoadConfig:
    return LoadConfig(url=url, concurrency=w.concurrency, max_tokens=w.max_tokens, stream=w.stream,
                      duration=args.duration, warmup=args.warmup, prompt_words=args.prompt_words,
                      ignore_eos=True, timeout=120.0)


def node_env(args) -> dict:
    return {} if args.omp_threads == "default" else {"OMP_NUM_THREADS": args.omp_threads}


def parse_configs(spec: str) -> list[tuple[int, int]]:
    out = []
    for item in spec.split(","):
        item = item.strip().lower().replace("dp", "").replace("api", "")
        dp, api = item.split("/")
        out.append((int(dp), int(api)))
    return out


def run_config(model: str, dp: int, api: int, wls: list[Workload], args, log) -> dict:
    node = DpNode(model, dp, api, extra=args.serve_arg, env=node_env(args))
    entry: dict = {"dp": dp, "api": api, "label": node.label, "workloads": {}}
    try:
        node.start(timeout=args.ready_timeout)
        entry["ready_s"] = node.ready_s
        log(f"{node.label}: ready in {node.ready_s:.2f} s (load {load_average()})")
        for w in wls:
            m = measure_sync(node, load_config(node.url, w, args), node.label)
            entry["workloads"][w.key] = m
            r = m.result
            log(f"  {w.title}: {r.req_per_s:,.0f} req/s, {r.output_tok_per_s:,.0f} tok/s, "
                f"API CPU {fmt(m.api_cpu_us_per_req, 0)} us/req, errors {r.error_count}, load {m.loadavg}")
    except Exception as exc:  # one failed configuration must not lose the others
        entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"{node.label}: FAILED: {entry['error'][:500]}")
    finally:
        node.stop()
    return entry


def run_baseline(wls: list[Workload], args, log) -> dict:
    node = BaselineNode()
    entry: dict = {"label": node.label, "workloads": {}}
    try:
        node.start(timeout=60)
        for w in wls:
            if w.stream:
                continue  # a fixed instant answer says nothing about streaming
            m = measure_sync(node, load_config(node.url, w, args), node.label)
            entry["workloads"][w.key] = m
            log(f"  bare aiohttp {w.title}: {m.result.req_per_s:,.0f} req/s, "
                f"CPU {fmt(m.api_cpu_us_per_req, 0)} us/req")
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"bare aiohttp: FAILED: {entry['error'][:500]}")
    finally:
        node.stop()
    return entry


def ready_times(model: str, counts: list[int], repeats: int, args, log) -> dict[str, list[float]]:
    """Start-to-ready seconds for DP=1 and each api-server count (and launch mode),
    alternating the order per repeat. Keys: "8", or "8 exec" when several modes run."""
    modes = args.ready_launch.split(",")
    runs = [(n, mode) for n in counts for mode in modes]
    label = {(n, m): f"{n} {m}" if len(modes) > 1 else str(n) for n, m in runs}
    out: dict[str, list[float]] = {label[r]: [] for r in runs}
    for rep in range(repeats):
        for n, mode in (runs if rep % 2 == 0 else list(reversed(runs))):
            extra = [*args.serve_arg, "--api-server-launch", mode]
            node = DpNode(model, 1, n, extra=extra, env=node_env(args))
            try:
                node.start(timeout=args.ready_timeout)
                out[label[n, mode]].append(node.ready_s)
                log(f"  api-server-count {label[n, mode]}: ready in {node.ready_s:.2f} s (load {load_average()})")
            except Exception as exc:
                log(f"  api-server-count {label[n, mode]}: FAILED: {exc}"[:500])
            finally:
                node.stop()
    return out


# ----------------------------------------------------------------- output


def _w(entry: dict, key: str) -> Measured | None:
    return entry.get("workloads", {}).get(key)


def main_table(entries: list[dict], baseline: dict | None, wls: list[Workload]) -> str:
    cols = entries + ([baseline] if baseline else [])
    rows: list[list[str]] = []

    def row(name: str, fn) -> None:
        rows.append([name] + [fn(e) for e in cols])

    def metric(key: str, fn, nd: int = 1):
        def get(e: dict) -> str:
            m = _w(e, key)
            return fmt(fn(m), nd) if m is not None else "-"
        return get

    for w in wls:
        if w.stream:
            continue
        row(f"req/s, {w.title}", metric(w.key, lambda m: m.result.req_per_s, 0))
    for w in wls:
        if w.stream:
            continue
        row(f"API CPU us/req, {w.title}", metric(w.key, lambda m: m.api_cpu_us_per_req, 0))
    for w in wls:
        if not w.stream:
            continue
        row(f"out tok/s, {w.title}", metric(w.key, lambda m: m.result.output_tok_per_s, 0))
        row("  TTFT p50 / p99 ms", lambda e, k=w.key: (
            f"{fmt(_w(e, k).result.ttft_ms.get('p50'))} / {fmt(_w(e, k).result.ttft_ms.get('p99'))}"
            if _w(e, k) else "-"))
        row("  ITL p99 ms", metric(w.key, lambda m: m.result.itl_ms.get("p99"), 2))
        row("  API CPU us/req", metric(w.key, lambda m: m.api_cpu_us_per_req, 0))
    row("API RSS MB (largest api process)", lambda e: fmt(max(
        (max(m.api_rss_mb) for m in e.get("workloads", {}).values() if m.api_rss_mb), default=None), 1))
    row("errors (all workloads)", lambda e: str(sum(m.result.error_count for m in e.get("workloads", {}).values()))
        if e.get("workloads") else ("FAILED" if e.get("error") else "-"))
    row("start to ready s", lambda e: fmt(e.get("ready_s"), 2))
    if baseline:
        for w in wls:
            if w.stream:
                continue
            row(f"API CPU / bare aiohttp, {w.title}", lambda e, k=w.key: fmt(ratio(
                _w(e, k).api_cpu_us_per_req if _w(e, k) else None,
                _w(baseline, k).api_cpu_us_per_req if _w(baseline, k) else None), 2) if e is not baseline else "1.00")
    return render([""] + [e["label"] for e in cols], rows)


def ready_table(times: dict[str, list[float]]) -> str:
    """Each row against the smallest api-server count of the same launch mode."""
    def count(key: str) -> int:
        return int(key.split()[0])

    def mode(key: str) -> str:
        return key.split(" ", 1)[1] if " " in key else ""

    rows = []
    for key, ts in times.items():
        first = min((k for k in times if mode(k) == mode(key)), key=count)
        base = statistics.median(times[first]) if times[first] else None
        med = statistics.median(ts) if ts else None
        rows.append([key, fmt(med, 2), " ".join(f"{t:.2f}" for t in ts) or "-", fmt(ratio(med, base), 2)])
    return render(["api-server-count (dp1)", "ready s (median)", "runs", "vs fewest"], rows)


def to_json(info: dict, entries: list[dict], baseline: dict | None, times: dict) -> dict:
    def conv(e: dict | None):
        if e is None:
            return None
        d = {k: v for k, v in e.items() if k != "workloads"}
        d["workloads"] = {k: m.to_dict() for k, m in e.get("workloads", {}).items()}
        return d
    return {**info, "configs": [conv(e) for e in entries], "baseline": conv(baseline),
            "ready_times_s": times}


def main(argv=None) -> int:
    p = parser(__doc__, model_dir=True)
    p.add_argument("--quick", action="store_true",
                   help="short windows (1 s warm-up + 3 s), dp1/api1 and dp1/api2, ready times for 1 and 8")
    p.add_argument("--configs", default=None, help="DP/API pairs, e.g. 1/1,1/2,2/2 (the default)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per workload (default 10; quick 3)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per workload (default 2; quick 1)")
    p.add_argument("--stream-concurrency", default="32", help="concurrency list for the streaming workloads")
    p.add_argument("--prompt-words", type=int, default=8)
    p.add_argument("--ready-counts", default=None, help="api-server counts to time (default 1,2,4,8; quick 1,8)")
    p.add_argument("--ready-repeats", type=int, default=None, help="starts per count (default 2; quick 1)")
    p.add_argument("--no-ready", action="store_true", help="skip the start-to-ready timings")
    p.add_argument("--ready-launch", default="prefork", help="--api-server-launch mode(s) to time, e.g. exec,prefork")
    p.add_argument("--no-baseline", action="store_true", help="skip the bare aiohttp ceiling")
    p.add_argument("--omp-threads", default="1",
                   help="OMP_NUM_THREADS for dpserve's children (default 1, as vLLM's best CPU config; "
                        "'default' keeps the supervisor's own choice)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `dpserve serve` argument (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args, run = begin(p, argv)
    quick = args.quick
    args.duration = args.duration or (3.0 if quick else 10.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if quick else 2.0)
    configs = parse_configs(args.configs or ("1/1,1/2" if quick else "1/1,1/2,2/2"))
    counts = [int(x) for x in (args.ready_counts or ("1,8" if quick else "1,2,4,8")).split(",")]
    repeats = args.ready_repeats or (1 if quick else 2)
    wls = workloads([int(x) for x in args.stream_concurrency.split(",")])

    log = run.log

    model = ensure_demo_model(args.model_dir)
    info = {**run.info(), "model_dir": model,
            "omp_threads": args.omp_threads, "duration_s": args.duration, "warmup_s": args.warmup,
            "prompt_words": args.prompt_words}
    log(f"dpserve suite {info['date']}: {info['machine']['nproc']} CPUs ({info['machine']['cpu_model']}), "
        f"load {load_average()}, OMP_NUM_THREADS={args.omp_threads}, "
        f"{args.warmup:g} s warm-up + {args.duration:g} s per workload")
    t0 = time.monotonic()
    entries = [run_config(model, dp, api, wls, args, log) for dp, api in configs]
    baseline = None if args.no_baseline else run_baseline(wls, args, log)
    times: dict[int, list[float]] = {}
    if not args.no_ready:
        log("start-to-ready times:")
        times = ready_times(model, counts, repeats, args, log)
    info["elapsed_s"] = round(time.monotonic() - t0, 1)
    info["loadavg_end"] = load_average()

    if args.json:
        print(json.dumps(to_json(info, entries, baseline, times), sort_keys=True))
        return 0
    print()
    print(f"dpserve suite: {args.prompt_words}-word prompts, ignore_eos, {args.warmup:g} s warm-up + "
          f"{args.duration:g} s per workload; OMP_NUM_THREADS={args.omp_threads}; "
          f"load average at the end {info['loadavg_end']}; {info['elapsed_s']:.0f} s in all")
    print(main_table(entries, baseline, wls))
    if times:
        print()
        print(ready_table(times))
    for e in entries:
        if e.get("error"):
            print(f"\n{e['label']} failed: {e['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
