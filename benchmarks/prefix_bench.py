#!/usr/bin/env python3
"""Multi-turn chat with a shared system prompt: cache-aware routing against tokens (issue 16).

    python benchmarks/prefix_bench.py [--model DIR] [--conversations 32] [--turns 6]
        [--system-tokens 1000] [--vllm-venv DIR] [--quick] [--json]

Servers, one at a time, on the same model (default: the 135M-class random-weight
model, `dpserve demo-model --size small`): dpserve DP 2 / 2 API servers with
`--lb-policy cache-aware` and with `--lb-policy tokens` (both with the engine's
prefix cache, on by default); with --vllm-venv also `vllm serve` (one engine,
prefix caching on, its CPU settings) and dpserve `--engine vllm` DP 2 under
both policies.

Workloads (token-id prompts through /v1/completions, streamed, ignore_eos):
(a) chat: --conversations conversations of --turns turns, all opening with
    the same --system-tokens system prompt; each turn's prompt is the previous
    turn's prompt + a 32-token answer + a 48-token user message, sent once the
    previous answer is complete (as a chat client does); the clients share one
    keep-alive connection pool, so a conversation's turns reach either API
    server;
(b) no shared prefixes: the same number of requests and prompt lengths, every
    prompt random.
(c) with --tenants T (issue 29): T tenants, each with a --tenant-prefix-tokens
    prefix, a sliding window of T/6 of them asking 64-token questions at
    --rate req/s (Poisson), the window passing over every tenant twice; size
    T so that T x prefix is 2-4x the ranks' KV caches (--kv-cache-memory-bytes
    in the servers' extra args). The simulated 64-rank version, with an
    oracle, is benchmarks/prefix_sim.py.
Per run: TTFT p50/p90, output tok/s (usage), prompt tokens served from cache
(usage.prompt_tokens_details.cached_tokens), wall time. Printed, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from benchmarks.common import DEFAULT_VLLM_VENV, begin, load_average, parser, vllm_python  # noqa: E402
from benchmarks.nodes import SERVED_MODEL, DpNode, VllmNode  # noqa: E402

ANSWER_TOKENS = 32
USER_TOKENS = 48
VOCAB = (4, 2_000)  # within both demo models' vocabularies


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


async def one_turn(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = {}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"http {resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and any(c.get("text") for c in event.get("choices", [])):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    return {"ttft": ttft, "tokens": usage.get("completion_tokens", 0), "prompt": usage.get("prompt_tokens", len(prompt)),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def run_chat(url: str, model: str, conversations: int, turns: int, system_tokens: int, shared: bool, seed: int) -> dict:
    """Workload (a) when shared, else (b): the same request count and prompt lengths, every prompt random."""
    rng = random.Random(seed)
    system = ids(rng, system_tokens)
    results: list[dict] = []

    async def conversation(c: int, session: aiohttp.ClientSession) -> None:
        crng = random.Random(seed * 1000 + c)
        history = (system if shared else ids(crng, system_tokens)) + ids(crng, USER_TOKENS)
        for _ in range(turns):
            prompt = history if shared else ids(crng, len(history))
            results.append(await one_turn(session, url, model, prompt))
            history = history + ids(crng, ANSWER_TOKENS) + ids(crng, USER_TOKENS)

    connector = aiohttp.TCPConnector(limit=conversations)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, session) for c in range(conversations)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    prompt_tokens = sum(r["prompt"] for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "wall_s": round(wall, 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000) if ttfts else None,
        "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000) if ttfts else None,
        "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "cached_share": round(sum(r["cached"] for r in ok) / prompt_tokens, 3) if prompt_tokens else 0.0,
    }


async def run_tenants(url: str, model: str, args, seed: int) -> dict:
    """Workload (c): every request on its own, at its Poisson arrival time."""
    rng = random.Random(seed)
    prefixes = [ids(rng, args.tenant_prefix_tokens) for _ in range(args.tenants)]
    active, n = max(1, args.tenants // 6), args.tenant_requests
    results: list[dict] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600), trust_env=False) as session:
        t0, at, tasks = time.perf_counter(), 0.0, []
        for i in range(n):
            at += rng.expovariate(args.rate)
            tenant = (int(i / n * 2 * args.tenants) + rng.randrange(active)) % args.tenants
            prompt = prefixes[tenant] + ids(rng, USER_TOKENS + 16)
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one_turn(session, url, model, prompt)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    prompt_tokens = sum(r["prompt"] for r in ok)
    return {"requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000) if ttfts else None,
            "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000) if ttfts else None,
            "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "cached_share": round(sum(r["cached"] for r in ok) / prompt_tokens, 3) if prompt_tokens else 0.0}


def servers(args, model_dir: str) -> list[tuple[str, object]]:
    context = 2048 if args.quick else 4096
    common = ["--max-model-len", str(context)]
    common += list(args.server_arg)
    # "approximate": cache-aware on what was sent (--no-kv-events); "cache-aware": on the ranks' KV events
    lb = {"approximate": ["--lb-policy", "cache-aware", "--no-kv-events"]}
    out = [(f"dpserve {policy}", lambda policy=policy: DpNode(model_dir, dp=2, api=2, extra=[*common, *lb.get(policy, ["--lb-policy", policy])]))
           for policy in args.policies.split(",")]
    venv = args.vllm_venv
    if venv and vllm_python(venv):
        vllm = ["--engine", "vllm", "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(1 << 30), *common]
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
        for policy in ("cache-aware", "tokens"):
            out.append((f"dpserve --engine vllm {policy}",
                        lambda policy=policy: DpNode(model_dir, dp=2, api=2, extra=[*vllm, "--lb-policy", policy], env=env, python=vllm_python(venv))))
        out.append(("vllm serve (1 engine, prefix caching)",
                    lambda: VllmNode(venv, model_dir, api=2, max_model_len=context, env={"VLLM_CPU_KVCACHE_SPACE": "1"})))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", help="model directory (default: the 135M-class random-weight model, built once)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--vllm-venv", default=None, help=f"also vLLM's rows (e.g. {DEFAULT_VLLM_VENV})")
    ap.add_argument("--quick", action="store_true", help="8 conversations x 3 turns, 300-token system prompt, the demo model")
    ap.add_argument("--tenants", type=int, default=0, help="run workload (c) with this many tenants instead of (a) and (b)")
    ap.add_argument("--tenant-prefix-tokens", type=int, default=1024)
    ap.add_argument("--tenant-requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=1.0, help="workload (c): requests per second")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra dpserve argument (repeat), e.g. --kv-cache-memory-bytes=...")
    ap.add_argument("--policies", default="cache-aware,round-robin,tokens",
                    help="dpserve's --lb-policy values to run, and `approximate` (cache-aware with --no-kv-events)")
    ap.add_argument("--json", action="store_true")
    args, _ = begin(ap, argv)
    if args.quick:
        args.conversations, args.turns, args.system_tokens = 8, 3, 300
    model_dir = args.model
    if not model_dir:
        from dpserve.engine.testing.demo_model import create_demo_model

        size = "tiny" if args.quick else "small"
        model_dir = str(Path("/tmp") / f"dpserve-prefix-bench-{size}" / "model")
        if not Path(model_dir, "config.json").exists():
            create_demo_model(model_dir, size)
    rows = []
    for label, make in servers(args, model_dir):
        server = make()
        try:
            server.start(timeout=900)
            if args.tenants:
                r = asyncio.run(run_tenants(server.url, SERVED_MODEL, args, seed=7))
                rows.append({"server": label, "workload": f"{args.tenants} tenants", **r})
                print(f"{label:42s} {json.dumps(r)}", file=sys.stderr, flush=True)
            for workload, shared in () if args.tenants else (("chat, shared system prompt", True), ("no shared prefixes", False)):
                r = asyncio.run(run_chat(server.url, SERVED_MODEL, args.conversations, args.turns, args.system_tokens, shared, seed=7))
                rows.append({"server": label, "workload": workload, **r})
                print(f"{label:42s} {workload:28s} {json.dumps(r)}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    if args.json:
        print(json.dumps({"load": load_average(), "rows": rows}, indent=2))
        return 0
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.system_tokens}-token system prompt, "
          f"{USER_TOKENS}-token user turns, {ANSWER_TOKENS}-token answers; load {load_average()}\n")
    print("| server | workload | TTFT p50 | TTFT p90 | output tok/s | prompt tokens from cache | wall | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['workload']} | {r['ttft_p50_ms']} ms | {r['ttft_p90_ms']} ms | {r['output_tok_s']} | "
              f"{r['cached_share']:.0%} | {r['wall_s']} s | {r['errors']} |")
    base = {r["workload"]: r for r in rows if r["server"] == "dpserve tokens"}
    for r in rows:
        if r["server"] == "dpserve cache-aware" and r["workload"] in base:
            b = base[r["workload"]]
            if r["ttft_p50_ms"] and b["ttft_p50_ms"] and r["output_tok_s"] and b["output_tok_s"]:
                print(f"\ncache-aware / tokens, {r['workload']}: TTFT p50 {b['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x lower, "
                      f"output tok/s {r['output_tok_s'] / b['output_tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
