#!/usr/bin/env python3
"""Engine cost of mixing long and short prompts: prefill and decode-step time.

    python benchmarks/mixed_lengths_bench.py [--model-dir DIR] [--long 1788] [--steps 30]

For each mix (short rows x ~20 tokens, long rows x --long tokens) it admits
the prompts through the engine's own scheduler grouping (one prefill forward
per length group), lets the model runner regroup its buckets as the engine
does after a step, and times decode steps. Then, for comparison, the same
rows in one left-padded batch (what the engine did before it grouped
prompts: every short row padded to the long one's length, one bucket; the
KV cache is today's in either case, so the per-token cache copies the
engine no longer makes are not in this comparison). Figures are printed, never asserted. Single-threaded torch (OMP 1), as the
engines run in the benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from dpserve.engine.config import EngineConfig  # noqa: E402
from dpserve.engine.loader import load_model  # noqa: E402
from dpserve.engine.model_runner import ModelRunner  # noqa: E402
from dpserve.engine.protocol import SamplingParams  # noqa: E402
from dpserve.engine.scheduler import group_for_prefill  # noqa: E402
from dpserve.engine.sequence import Sequence  # noqa: E402

from benchmarks.nodes import ensure_demo_model, render  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run_mix(runner: ModelRunner, shorts: int, longs: int, long_len: int, steps: int, grouped: bool) -> tuple[float, float, int]:
    """(prefill s, decode s per step, buckets) for one mix."""
    prompts = [[5 + i % 7] * 20 for i in range(shorts)] + [[9] * long_len for _ in range(longs)]
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=steps + 8), 0.0, "cpu") for i, p in enumerate(prompts)]
    groups = group_for_prefill(seqs) if grouped else [seqs]

    def prefill():
        runner.buckets = []
        runner.append(*(runner.prefill([s.prompt_token_ids for s in g])[1] for g in groups))
        if grouped:
            runner.consolidate()

    t_prefill = timed(prefill, 3)
    rows = runner.num_rows
    for _ in range(3):
        runner.decode([3] * rows)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.decode([3] * rows)
    return t_prefill, (time.perf_counter() - t0) / steps, len(runner.buckets)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--long", type=int, default=1788, help="tokens of a long prompt")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per mix")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = ensure_demo_model(args.model_dir)
    runner = ModelRunner(load_model(EngineConfig(model=model)))
    mixes = [(16, 0), (3, 1), (15, 1), (31, 1), (30, 2)]
    rows = []
    for shorts, longs in mixes:
        g = run_mix(runner, shorts, longs, args.long, args.steps, grouped=True)
        one = run_mix(runner, shorts, longs, args.long, args.steps, grouped=False)
        rows.append([f"{shorts} x 20 + {longs} x {args.long}",
                     f"{g[0] * 1000:,.1f}", f"{one[0] * 1000:,.1f}",
                     f"{g[1] * 1000:.2f}", f"{one[1] * 1000:.2f}", str(g[2])])
        print(f"  {rows[-1][0]}: done", flush=True)
    print(f"\nmixed lengths, demo model, OMP 1, decode: mean of {args.steps} steps")
    print(render(["rows (tokens)", "prefill ms grouped", "prefill ms one batch", "decode step ms buckets",
                  "decode step ms one batch", "buckets"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
