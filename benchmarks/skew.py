#!/usr/bin/env python3
"""Load skew: --lb-policy queue vs tokens vs round-robin on mixed prompt lengths, DP=2.

    python benchmarks/skew.py [--quick] [--rounds 2] [--json]

A rank that holds one very long prompt looks *less* loaded to `queue`
(4 x waiting + running) than a rank with two short ones, so long prompts pile
up unevenly and everything queued behind them waits (vLLM #40795; llm-d's
token-load scorer). `tokens` scores outstanding work in tokens instead.

Workload: DP=2 (api-server-count 2, the default), closed loop, streaming
max_tokens=16 with ignore_eos; prompts are a mix of short (~20 tokens) and
long (~1,800 tokens: the demo model has 2,048 positions, so 2,000-token
prompts plus the answer would not fit) prompts, by default 90% / 10% by count,
so long prompts carry most of the prefill work. Word counts are calibrated
with the model's own tokenizer. Each policy gets a fresh node; rounds
alternate the order of the policies. A policy given as POLICY@TREE runs
with the dpserve source tree TREE (see profile_api.py), to try a router
change against the installed code in one run. Reported: E2E latency p50/p90/p99, TTFT
p99, throughput, requests per rank, and the ratio of each policy's p99 to
queue's. Figures are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import begin, ensure_demo_model, fmt, load_average, parser, ratio, render  # noqa: E402
from benchmarks.load import LoadConfig, make_prompts  # noqa: E402
from benchmarks.nodes import DpNode, Measured, code_tree_env, measure_sync  # noqa: E402

POLICIES = ("queue", "tokens", "round-robin")


def words_for_tokens(model_dir: str, target: int, limit: int) -> tuple[int, int, int]:
    """Words per prompt so that prompts average ~target tokens and none exceeds limit.
    Returns (words, mean tokens, max tokens) over the prompt pool load.py will build."""
    from dpserve.daemons.api.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(model_dir)
    sample = make_prompts([(200, 1.0)], 32, 1)
    per_word = sum(len(tok.encode(p)) for p in sample) / (200 * len(sample))
    words = max(1, round(target / per_word))
    while True:
        lens = [len(tok.encode(p)) for p in make_prompts([(words, 1.0)], 64, 0)]
        if max(lens) <= limit or words == 1:
            return words, round(sum(lens) / len(lens)), max(lens)
        words -= max(1, words // 100)


def by_class(result, cut: int) -> dict:
    """p99 latency of short and of long prompts apart (prompt tokens from each answer's usage)."""
    out = {}
    for name, keep in (("short", lambda n: n < cut), ("long", lambda n: n >= cut)):
        xs = sorted(lat for lat, n in zip(result.latencies, result.latency_prompt_tokens) if keep(n))
        out[f"{name}_n"] = len(xs)
        out[f"{name}_p99_ms"] = xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000 if xs else None
    return out


def main(argv=None) -> int:
    p = parser(__doc__, model_dir=True, json=True)
    p.add_argument("--quick", action="store_true", help="1 round, 2 s warm-up + 10 s per policy")
    p.add_argument("--rounds", type=int, default=None, help="passes over the policies (default 2; quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run (default 30; quick 10)")
    p.add_argument("--warmup", type=float, default=None, help="default 5; quick 2")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma list; POLICY@TREE runs POLICY from source tree TREE")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--api", type=int, default=None, help="api-server count (default: the DP size)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--short-tokens", type=int, default=20)
    p.add_argument("--long-tokens", type=int, default=1800)
    p.add_argument("--long-fraction", type=float, default=0.1, help="share of long prompts by count")
    p.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS for the node ('default': supervisor's choice)")
    args, run = begin(p, argv)
    rounds = args.rounds or (1 if args.quick else 2)
    duration = args.duration or (10.0 if args.quick else 30.0)
    warmup = args.warmup if args.warmup is not None else (2.0 if args.quick else 5.0)
    policies = [x for x in args.policies.split(",") if x]

    log = run.log

    model = ensure_demo_model(args.model_dir)
    max_len = json.loads(Path(model, "config.json").read_text())["max_position_embeddings"]
    long_words, long_mean, long_max = words_for_tokens(model, args.long_tokens, max_len - args.max_tokens)
    short_words, short_mean, short_max = words_for_tokens(model, args.short_tokens, max_len)
    mix = f"{short_words}:{1 - args.long_fraction},{long_words}:{args.long_fraction}"
    env = {} if args.omp_threads == "default" else {"OMP_NUM_THREADS": args.omp_threads}
    info = {**run.info(), "model_dir": model, "prompt_mix_words": mix,
            "short_tokens": {"mean": short_mean, "max": short_max},
            "long_tokens": {"mean": long_mean, "max": long_max}, "max_model_len": max_len,
            "dp": args.dp, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "duration_s": duration, "warmup_s": warmup, "rounds": rounds}
    log(f"skew benchmark {info['date']}: DP={args.dp}, c={args.concurrency}, stream max_tokens={args.max_tokens}, "
        f"{1 - args.long_fraction:.0%} short ({short_words} words, ~{short_mean} tokens) / "
        f"{args.long_fraction:.0%} long ({long_words} words, ~{long_mean} tokens, max {long_max}); "
        f"max_model_len {max_len}; load {load_average()}")

    scratch = tempfile.mkdtemp(prefix="skew-code-")
    tree_envs = {tree: code_tree_env(tree, os.path.join(scratch, str(i)))
                 for i, tree in enumerate(sorted({p.partition("@")[2] for p in policies} - {""}))}
    runs: dict[str, list[Measured]] = {pol: [] for pol in policies}
    errors: dict[str, str] = {}
    for rnd in range(rounds):
        order = policies if rnd % 2 == 0 else list(reversed(policies))
        for pol in order:
            policy, _, tree = pol.partition("@")
            extra = ["--lb-policy", policy, "--max-model-len", str(max_len)]
            node_env = {**env, **tree_envs.get(tree, {})}
            node = DpNode(model, args.dp, args.api or args.dp, extra=extra, env=node_env)
            try:
                node.start()
                cfg = LoadConfig(url=node.url, concurrency=args.concurrency, max_tokens=args.max_tokens,
                                 stream=True, ignore_eos=True, prompt_mix=mix, num_prompts=200,
                                 duration=duration, warmup=warmup, seed=rnd, timeout=300.0)
                m = measure_sync(node, cfg, pol)
                runs[pol].append(m)
                r = m.result
                m.extra["by_class"] = by_class(r, (short_max + long_mean) // 2)
                log(f"  round {rnd + 1} {pol}: {r.req_per_s:.1f} req/s, p50 {fmt(r.latency_ms.get('p50'))} ms, "
                    f"p99 {fmt(r.latency_ms.get('p99'))} ms, TTFT p99 {fmt(r.ttft_ms.get('p99'))} ms, "
                    f"short p99 {fmt(m.extra['by_class']['short_p99_ms'])} ms, long p99 {fmt(m.extra['by_class']['long_p99_ms'])} ms, "
                    f"per rank {r.per_rank}, errors {r.error_count}, load {m.loadavg}")
            except Exception as exc:
                errors[pol] = f"{type(exc).__name__}: {exc}"[:1500]
                log(f"  round {rnd + 1} {pol}: FAILED: {errors[pol][:500]}")
            finally:
                node.stop()

    shutil.rmtree(scratch, ignore_errors=True)

    def med(pol: str, fn) -> float | None:
        xs = [fn(m) for m in runs[pol]]
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    p99 = {pol: med(pol, lambda m: m.result.latency_ms.get("p99")) for pol in policies}
    info["loadavg_end"] = load_average()
    if args.json:
        print(json.dumps({**info, "runs": {pol: [m.to_dict() for m in ms] for pol, ms in runs.items()},
                          "p99_ms": p99, "errors": errors}, sort_keys=True))
        return 0
    rows = []
    for pol in policies:
        ranks = [m.result.per_rank for m in runs[pol]]
        rows.append([
            pol,
            fmt(med(pol, lambda m: m.result.req_per_s), 1),
            fmt(med(pol, lambda m: m.result.latency_ms.get("p50")), 0),
            fmt(med(pol, lambda m: m.result.latency_ms.get("p90")), 0),
            fmt(p99[pol], 0),
            fmt(med(pol, lambda m: m.result.ttft_ms.get("p99")), 0),
            fmt(med(pol, lambda m: m.extra["by_class"]["short_p99_ms"]), 0),
            fmt(med(pol, lambda m: m.extra["by_class"]["long_p99_ms"]), 0),
            " | ".join(" ".join(f"{k}:{v}" for k, v in r.items()) for r in ranks) or "-",
            str(sum(m.result.error_count for m in runs[pol])),
            fmt(ratio(p99[pol], p99.get("queue")), 2),
        ])
    print()
    print(f"skew: DP={args.dp}, stream max_tokens={args.max_tokens}, c={args.concurrency}, "
          f"{1 - args.long_fraction:.0%} ~{short_mean}-token / {args.long_fraction:.0%} ~{long_mean}-token prompts; "
          f"median of {rounds} round(s) x {duration:g} s; load average at the end {info['loadavg_end']}")
    print(render(["policy", "req/s", "p50 ms", "p90 ms", "p99 ms", "TTFT p99 ms", "short p99", "long p99", "requests per rank",
                  "errors", "p99 / queue"], rows))
    if p99.get("tokens") and p99.get("queue"):
        print(f"tokens / queue p99 = {p99['tokens'] / p99['queue']:.2f} (target: <= 0.70)")
    for pol, err in errors.items():
        print(f"{pol}: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
