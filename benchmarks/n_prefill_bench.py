#!/usr/bin/env python3
"""n choices of one prompt on one native engine: prompt tokens computed and wall time.

    python benchmarks/n_prefill_bench.py [--model-dir DIR] [--prompt-len 1000] [--n 1,4,16] [--max-tokens 4]

Each n sends n greedy copies of one random --prompt-len prompt (what an API
server sends for a request with that n) to an EngineCore on CPU in float32,
with prefix caching on (the default) and off. Per run: the prompt tokens the
engine computed (the scheduler's plans, counted), their ratio to n=1's, and
wall time. Printed, never asserted.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import begin, ensure_demo_model, parser  # noqa: E402


def run(loaded, prompt: list[int], n: int, max_tokens: int, caching: bool) -> tuple[int, float]:
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.common.protocol import AddRequest, SamplingParams
    from dpserve.engine.core import EngineCore

    config = EngineConfig(model=loaded.model_dir, device="cpu", dtype="float32", enable_prefix_caching=caching)
    engine = EngineCore.from_loaded(config, loaded)
    schedule, computed = engine.scheduler.schedule, 0

    def counting():
        nonlocal computed
        plan = schedule()
        computed += sum(min(k, max(0, s.num_prompt_tokens - s.num_computed_tokens)) for s, k in plan)
        return plan

    engine.scheduler.schedule = counting
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for j in range(n):
        assert engine.add_request(AddRequest(f"c{j}", list(prompt), params, time.time())) is None
    while engine.has_unfinished():
        engine.step()
    return computed, time.perf_counter() - t0


def main(argv=None) -> None:
    p = parser(__doc__, model_dir=True)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--n", default="1,4,16", help="comma-separated n values")
    p.add_argument("--max-tokens", type=int, default=4)
    args, _ = begin(p, argv)
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.loader import load_model

    model_dir = ensure_demo_model(args.model_dir)
    loaded = load_model(EngineConfig(model=model_dir, device="cpu", dtype="float32"))
    prompt = [random.Random(0).randrange(4, 2000) for _ in range(args.prompt_len)]
    print(f"{'prefix cache':>12} {'n':>4} {'prompt tokens computed':>23} {'x n=1':>6} {'wall s':>7}")
    for caching in (True, False):
        base = None
        for n in (int(v) for v in args.n.split(",")):
            computed, wall = run(loaded, prompt, n, args.max_tokens, caching)
            base = base or computed
            print(f"{'on' if caching else 'off':>12} {n:>4} {computed:>23,} {computed / base:>6.2f} {wall:>7.2f}")


if __name__ == "__main__":
    main()
