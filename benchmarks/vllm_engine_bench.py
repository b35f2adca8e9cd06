#!/usr/bin/env python3
"""dpserve `--engine vllm` (vLLM's engine in each rank) against vLLM's own `vllm serve`.

    python benchmarks/vllm_engine_bench.py [--quick] [--models tiny,small] [--dps 1,2]
                                           [--rounds N] [--duration S] [--warmup S]
                                           [--client load|vllm-bench] [--num-prompts N]
                                           [--vllm-venv DIR] [--keep-logs] [--json]

Issue 15's benchmark: the same engine (vLLM's) behind dpserve's node (N API
servers, router, coordinator, supervisor) and behind vLLM's server, so the
difference is the frontend and the data parallelism around the engine.

Models: the tiny demo model (`dpserve demo-model`) and the 135M-class random-weight
model (`dpserve demo-model --size small`), each built once under the cache dir.
Per model and per DP size (1 and 2), one pair of servers runs side by side:

- dpserve `serve --engine vllm` at DP N, --api-server-count N, launched with the
  vLLM venv's python (dpserve is installed there editable);
- `vllm serve` with --api-server-count N.

Like with like, both get the same engine settings: --max-model-len 512,
--dtype bfloat16, the uni executor, OMP_NUM_THREADS=1,
VLLM_ENABLE_V1_MULTIPROCESSING=0, and explicit --max-num-seqs 128
--max-num-batched-tokens 2048 (vllm serve's CPU defaults; dpserve would
otherwise pass its own 256 and leave the token budget to LLMEngine's default).
KV cache: VLLM_CPU_KVCACHE_SPACE=1 (GiB) for vllm serve, --kv-cache-memory-bytes
1073741824 per rank for dpserve (so at DP 2 dpserve holds twice the KV; neither
comes near filling it here). vllm serve's engine threads are bound as vLLM
decides (VLLM_CPU_OMP_THREADS_BIND unset); dpserve binds rank r to core r.
So at DP 2 dpserve runs two engines (two cores) where vllm serve runs one
engine core process beside its API servers: the data parallelism is the point.

Workloads: streamed completions, ignore_eos, 32-word prompts, 16 answer tokens on
the tiny model and 64 on the small one, at 16 and 128 closed-loop clients;
output tokens counted from the final usage chunk. The client (--client) is the
same for both servers: `vllm-bench` (the default) is vLLM's own `vllm bench
serve` (benchmarks/vllm_bench.py: random prompts of --input-len token ids,
--num-prompts requests after one wave of warm-up requests, bystander CPU over
the whole run, no API-process CPU); `load` is benchmarks/load.py (a --duration
window after --warmup, API-process CPU sampled over the window). Every workload runs on one
server and then the other, the order flipping each time (as compare_vllm.py), so
machine noise lands on both; the idle server's CPU meanwhile is recorded as
"bystander" CPU. At most one vLLM server and one dpserve node run at a time; all
are stopped by process group, also on failure, Ctrl-C or SIGTERM.

vLLM compiles the model on its first start on a machine (about a minute on 2
cores; cached in ~/.cache/vllm afterwards), dpserve's vLLM ranks likewise, so
ready timeouts are long. A request counts when it completes inside the window:
on the small model at 128 clients one wave of answers takes tens of seconds on
2 cores, so keep --duration well above that. Figures and the ratios
dpserve / vLLM are printed (issue 15's target: >= 1.2x at DP 2, never below
1.0x), never asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# ruff: noqa: E402 (the imports below need the path set first)
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import begin, ensure_demo_model, fmt, load_average, parser, ratio, render, vllm_venv_or_say_why
from benchmarks.load import LoadConfig
from benchmarks.nodes import DpNode, Measured, Server, VllmNode, _cpu_seconds, _rss_mb, measure_sync
from benchmarks.vllm_bench import available as vllm_bench_available
from benchmarks.vllm_bench import run_vllm_bench

MAX_MODEL_LEN = 512
DTYPE = "bfloat16"
KV_BYTES_PER_RANK = 1 << 30  # = VLLM_CPU_KVCACHE_SPACE=1
# vllm serve's own CPU defaults (vllm/engine/arg_utils.py), given to both explicitly.
SCHED_ARGS = ["--max-num-seqs", "128", "--max-num-batched-tokens", "2048"]
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
CONCURRENCY = (16, 128)


@dataclass
class ModelSpec:
    key: str
    max_tokens: int
    warmup: float  # default seconds, full run
    duration: float

    def path(self, args) -> str:
        if self.key == "tiny":
            return ensure_demo_model(args.tiny_model)
        if args.small_model:
            return args.small_model
        from dpserve.engine.testing.demo_model import create_demo_model, default_demo_model_dir

        return create_demo_model(os.path.join(os.path.dirname(default_demo_model_dir()), "demo-model-small-v1"), "small")


MODELS = {"tiny": ModelSpec("tiny", 16, 3.0, 20.0), "small": ModelSpec("small", 64, 30.0, 90.0)}


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# Log lines worth a look after a run (both servers), beyond the figures; read
# before the servers are stopped, so shutdown noise is not among them. Both
# logs carry a dozen benign vLLM WARNINGs at start (no Triton, no tcmalloc /
# libiomp in LD_PRELOAD, the global seed): counted, not shown.
_COUNTED = ("Traceback", "ERROR", "WARNING", "restart", "preempt", "heartbeat")
_SHOWN = ("Traceback", "ERROR", "restart", "preempt", "heartbeat")


def log_findings(server: Server, limit: int = 12) -> dict:
    """Counts of notable lines in a server's log and the first few serious ones."""
    try:
        lines = Path(server.log_path).read_text(errors="replace").splitlines()
    except OSError:
        return {}
    counts = {k: sum(1 for line in lines if k in line) for k in _COUNTED}
    first = [line[:300] for line in lines if any(k in line for k in _SHOWN)][:limit]
    return {"lines": len(lines), "counts": {k: v for k, v in counts.items() if v}, "first": first}


def bench_measure(node: Server, other: Server, model: str, conc: int, max_tokens: int, venv: str, args) -> Measured:
    """One `vllm bench serve` run against `node`, with `other`'s CPU over the whole run as bystander CPU."""
    others = other.all_processes()
    o0, t0 = _cpu_seconds(others), time.perf_counter()
    num = args.num_prompts or conc * (2 if args.quick else 4)
    res = run_vllm_bench(node.url, "demo", model, input_len=args.input_len or args.prompt_words * 3 // 2,
                         output_len=max_tokens, concurrency=conc, num_prompts=num,
                         num_warmups=min(conc, 8) if args.quick else conc, venv=venv, timeout=args.bench_timeout)
    o1, t1 = _cpu_seconds(others), time.perf_counter()
    return Measured(node.label, res, api_rss_mb=[round(x, 1) for x in _rss_mb(node.api_processes())],
                    loadavg=load_average(), bystander_cpu_s_per_s=(o1 - o0) / (t1 - t0) if others else None,
                    extra={"client": "vllm-bench"})


def run_pair(spec: ModelSpec, model: str, dp: int, venv: str, args, log) -> dict:
    """One dpserve node and one vllm serve, both ready, every workload on each, alternating."""
    common = ["--max-model-len", str(MAX_MODEL_LEN), "--dtype", DTYPE, *SCHED_ARGS]
    # The same cores for the engines on both sides: vllm serve's one engine is bound to
    # every core; each of dpserve's dp ranks gets its share (engine/backends/vllm/args.py binds
    # rank r to cores r*k .. r*k+k-1 from OMP_NUM_THREADS=k). With OMP_NUM_THREADS=1
    # on both, vllm serve's auto binding still took every core while a DP 1 rank got one.
    cores = sorted(os.sched_getaffinity(0))
    dp_env = {**ENGINE_ENV, "OMP_NUM_THREADS": str(max(1, len(cores) // dp))}
    vllm_env = {**ENGINE_ENV, "OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
    dpn = DpNode(model, dp, dp, python=os.path.join(venv, "bin", "python"), env=dp_env,
                 extra=["--engine", "vllm", *common, "--kv-cache-memory-bytes", str(KV_BYTES_PER_RANK),
                        # vLLM's first steps can be slow on 2 busy cores: lenient probes, as the integration test
                        "--dp-supervisor-probe-interval-s", "2", "--dp-supervisor-probe-failure-threshold", "5"])
    dpn.label = f"dpserve vllm dp{dp}/api{dp}"
    vln = VllmNode(venv, model, api=dp, max_model_len=MAX_MODEL_LEN, dtype=DTYPE, env=vllm_env,
                   extra=[*SCHED_ARGS, "--seed", "0"])
    for node in (dpn, vln):
        node.keep_logs = node.keep_logs or args.keep_logs
    warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else spec.warmup)
    duration = args.duration if args.duration is not None else (4.0 if args.quick else spec.duration)
    pair: dict = {"model": spec.key, "dp": dp, "labels": {"dpserve": dpn.label, "vllm": vln.label},
                  "warmup_s": warmup, "duration_s": duration, "max_tokens": spec.max_tokens,
                  "runs": {"dpserve": {c: [] for c in CONCURRENCY}, "vllm": {c: [] for c in CONCURRENCY}}}
    try:
        # vLLM first: its start takes the longest, and nothing else runs meanwhile.
        for node in (vln, dpn):
            log(f"[{spec.key} dp{dp}] starting {node.label} (log {node.log_path})")
            node.start(timeout=args.ready_timeout)
            log(f"[{spec.key} dp{dp}] {node.label}: ready in {node.ready_s:.1f} s (load {load_average()})")
        pair["ready_s"] = {"dpserve": dpn.ready_s, "vllm": vln.ready_s}
        pair["vllm_engine_separate"] = vln.engine_separate
        pair["dpserve_engines"] = [{k: c.get(k) for k in ("name", "state", "restarts", "pid")}
                                   for c in dpn.status()["children"] if c["kind"] == "engine"]
        flip = False
        for rnd in range(args.rounds):
            for conc in CONCURRENCY:
                order = [("vllm", vln, dpn), ("dpserve", dpn, vln)]
                if flip:
                    order.reverse()
                flip = not flip
                for name, node, other in order:
                    time.sleep(args.settle)  # the other server's cancelled requests drain
                    if args.client == "vllm-bench":
                        m = bench_measure(node, other, model, conc, spec.max_tokens, venv, args)
                        pair["runs"][name][conc].append(m)
                        r = m.result
                        log(f"[{spec.key} dp{dp}] round {rnd + 1} c={conc} {node.label} (vllm bench serve): "
                            f"{r.output_tok_per_s:,.1f} tok/s, {r.req_per_s:,.2f} req/s, ok {r.ok}, failed "
                            f"{r.error_count}, TTFT p50 {fmt(r.ttft_ms.get('p50'), 0)} ms, "
                            f"bystander CPU {fmt(m.bystander_cpu_s_per_s, 3)}, load {m.loadavg}")
                        continue
                    cfg = LoadConfig(url=node.url, model="demo", concurrency=conc, max_tokens=spec.max_tokens,
                                     stream=True, ignore_eos=True, prompt_words=args.prompt_words,
                                     warmup=warmup, duration=duration, timeout=600.0,
                                     max_time=warmup + duration + 120.0)
                    m = measure_sync(node, cfg, node.label, bystanders=[other])
                    pair["runs"][name][conc].append(m)
                    r = m.result
                    log(f"[{spec.key} dp{dp}] round {rnd + 1} c={conc} {node.label}: {r.output_tok_per_s:,.1f} tok/s, "
                        f"{r.req_per_s:,.2f} req/s, ok {r.ok}, errors {r.error_count}"
                        f"{' ' + str(r.errors) if r.errors else ''}, TTFT p50 {fmt(r.ttft_ms.get('p50'), 0)} ms, "
                        f"bystander CPU {fmt(m.bystander_cpu_s_per_s, 3)}, load {m.loadavg}")
        pair["dpserve_engines_after"] = [{k: c.get(k) for k in ("name", "state", "restarts", "pid")}
                                         for c in dpn.status()["children"] if c["kind"] == "engine"]
    except Exception as exc:
        pair["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        log(f"[{spec.key} dp{dp}] FAILED: {pair['error'][:1500]}")
    finally:
        try:
            pair["logs"] = {"dpserve": log_findings(dpn), "vllm": log_findings(vln)}
            if args.keep_logs:
                pair["log_paths"] = {"dpserve": dpn.log_path, "vllm": vln.log_path}
        finally:
            dpn.stop()
            vln.stop()
    return pair


def _med(pair: dict, name: str, conc: int, fn) -> float | None:
    return _median([fn(m) for m in pair["runs"][name][conc]])


def results_table(pairs: list[dict]) -> str:
    rows = []
    for pair in pairs:
        for conc in CONCURRENCY:
            tok = [_med(pair, n, conc, lambda m: m.result.output_tok_per_s) for n in ("dpserve", "vllm")]
            req = [_med(pair, n, conc, lambda m: m.result.req_per_s) for n in ("dpserve", "vllm")]
            ttft = [_med(pair, n, conc, lambda m: m.result.ttft_ms.get("p50")) for n in ("dpserve", "vllm")]
            ok = [sum(m.result.ok for m in pair["runs"][n][conc]) for n in ("dpserve", "vllm")]
            err = [sum(m.result.error_count for m in pair["runs"][n][conc]) for n in ("dpserve", "vllm")]
            rows.append([pair["model"], f"{pair['dp']}", f"{conc}",
                         fmt(tok[0], 1), fmt(tok[1], 1), fmt(ratio(*tok), 2),
                         fmt(req[0], 2), fmt(req[1], 2), fmt(ratio(*req), 2),
                         fmt(ttft[0], 0), fmt(ttft[1], 0), f"{ok[0]}/{ok[1]}", f"{err[0]}/{err[1]}"])
    return render(["model", "DP", "clients", "dpserve tok/s", "vLLM tok/s", "ratio", "dpserve req/s", "vLLM req/s",
                   "ratio", "TTFT p50 dp", "TTFT p50 vllm", "ok dp/vllm", "errors dp/vllm"], rows)


def to_json(info: dict, pairs: list[dict]) -> dict:
    out = []
    for pair in pairs:
        d = {k: v for k, v in pair.items() if k != "runs"}
        d["runs"] = {name: {str(c): [m.to_dict() for m in ms] for c, ms in per.items()}
                     for name, per in pair["runs"].items()}
        d["median"] = {name: {str(c): {"output_tok_per_s": _med(pair, name, c, lambda m: m.result.output_tok_per_s),
                                       "req_per_s": _med(pair, name, c, lambda m: m.result.req_per_s)}
                              for c in CONCURRENCY} for name in ("dpserve", "vllm")}
        d["ratio"] = {str(c): {k: ratio(d["median"]["dpserve"][str(c)][k], d["median"]["vllm"][str(c)][k])
                               for k in ("output_tok_per_s", "req_per_s")} for c in CONCURRENCY}
        out.append(d)
    return {**info, "pairs": out}


def main(argv=None) -> int:
    p = parser(__doc__, json=True, vllm_venv=True)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model only, 1 s warm-up + 4 s windows")
    p.add_argument("--models", default=None, help="tiny,small (default both; --quick: tiny)")
    p.add_argument("--dps", default="1,2", help="DP sizes (api-server-count equal) (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="passes over the workloads (medians are reported)")
    p.add_argument("--duration", type=float, default=None,
                   help="measured seconds per run (default: tiny 20, small 90; quick 4)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per run (default: tiny 3, small 30; quick 1)")
    p.add_argument("--settle", type=float, default=1.0, help="pause before each run (s)")
    p.add_argument("--prompt-words", type=int, default=32, help="prompt length, --client load")
    p.add_argument("--client", choices=("load", "vllm-bench"), default=None,
                   help="the client for both servers (default: vllm-bench when the vLLM venv has bin/vllm, else load)")
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens, --client vllm-bench (default: 1.5 x --prompt-words)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run, --client vllm-bench (default: 4 x clients; quick: 2 x)")
    p.add_argument("--bench-timeout", type=float, default=1800.0, help="per vllm bench serve run (s)")
    p.add_argument("--tiny-model", default=None, help="tiny demo model dir (default: a cache dir; built if missing)")
    p.add_argument("--small-model", default=None, help="135M-class model dir (default: a cache dir; built if missing)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="per server start (s); vLLM compiles on first start")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (paths printed)")
    args, run = begin(p, argv)

    venv = vllm_venv_or_say_why(args.vllm_venv)
    if venv is None:
        return 0
    if args.client is None:
        args.client = "vllm-bench" if vllm_bench_available(venv) else "load"
    elif args.client == "vllm-bench" and not vllm_bench_available(venv):
        p.error(f"--client vllm-bench: no bin/vllm in {venv}")
    keys = (args.models or ("tiny" if args.quick else "tiny,small")).split(",")
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (tiny, small)")
    dps = [int(x) for x in args.dps.split(",")]

    log = run.log

    info = {**run.info(), "vllm_venv": venv, "client": args.client, "rounds": args.rounds, "prompt_words": args.prompt_words,
            "settings": {"max_model_len": MAX_MODEL_LEN, "dtype": DTYPE, "sched": SCHED_ARGS, "env": ENGINE_ENV,
                         "dpserve_kv_cache_memory_bytes_per_rank": KV_BYTES_PER_RANK}}
    log(f"dpserve --engine vllm vs vllm serve, {info['date']}: {info['machine']['nproc']} CPUs "
        f"({info['machine']['cpu_model']}), load {load_average()}, venv {venv}, models {keys}, DP {dps}, "
        f"client {args.client}")
    pairs = []
    for key in keys:
        spec = MODELS[key]
        model = spec.path(args)
        info.setdefault("model_dirs", {})[key] = model
        for dp in dps:
            pairs.append(run_pair(spec, model, dp, venv, args, log))
    info["loadavg_end"] = load_average()
    if args.json:
        print(json.dumps(to_json(info, pairs), sort_keys=True))
        return 0
    print()
    prompts = (f"{args.input_len or args.prompt_words * 3 // 2}-token random prompts (vllm bench serve)"
               if args.client == "vllm-bench" else f"{args.prompt_words}-word prompts (load.py)")
    print(f"dpserve --engine vllm vs vllm serve: streamed, ignore_eos, {prompts}, "
          f"answers of {', '.join(f'{k} {MODELS[k].max_tokens}' for k in keys)} tokens; medians of {args.rounds} "
          f"round(s); ratio = dpserve / vLLM (issue 15's target: >= 1.2 at DP 2, never < 1.0); "
          f"load average at the end {info['loadavg_end']}")
    print(results_table(pairs))
    print()
    for pair in pairs:
        ready = pair.get("ready_s", {})
        head = f"{pair['model']} dp{pair['dp']}: ready dpserve {fmt(ready.get('dpserve'), 1)} s, vLLM {fmt(ready.get('vllm'), 1)} s"
        engines = pair.get("dpserve_engines_after") or pair.get("dpserve_engines") or []
        if engines:
            head += "; dpserve ranks " + ", ".join(f"{e['name']} {e['state']} restarts {e['restarts']}" for e in engines)
        print(head)
        if pair.get("error"):
            print(f"  FAILED: {pair['error'][:800]}")
        for name, found in pair.get("logs", {}).items():
            if found.get("counts") or found.get("first"):
                print(f"  {name} log ({found['lines']} lines): {found.get('counts')}")
                for line in found["first"][:6]:
                    print(f"    {line[:200]}")
        for name, path in pair.get("log_paths", {}).items():
            print(f"  {name} log kept: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
