#!/usr/bin/env python3
"""Per-token cost of structured output (llguidance) in the engine, beside plain sampling.

    python benchmarks/guided_bench.py [--model-dir DIR] [--rows 8] [--tokens 48] [--repeats 3]

Runs --rows sampled requests through one EngineCore on CPU, once plain and once
each under a JSON-schema grammar, with ignore_eos so both produce the same
number of tokens (a grammar that completes ends its request early; those
steps are not counted), and prints the engine's wall time per generated token
and the sampler's share (mask fill + apply + consume). Best of --repeats.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 400}, "maxItems": 40}},
    "required": ["items"],
}


def run(engine, rows: int, tokens: int, grammar: str | None) -> tuple[float, float, int]:
    from dpserve.engine.common.protocol import AddRequest, SamplingParams

    sampler_s = 0.0
    real = engine.sampler

    def timed(logits, seqs):
        nonlocal sampler_s
        t = time.perf_counter()
        out = real(logits, seqs)
        sampler_s += time.perf_counter() - t
        return out

    engine.sampler = timed
    for i in range(rows):
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, guided_grammar=grammar)
        engine.add_request(AddRequest(f"r{i}-{time.monotonic_ns()}", [5 + i, 9, 11, 40], params, 0.0))
    made = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        made += len(engine.step())
    total = time.perf_counter() - start
    engine.sampler = real
    return total, sampler_s, made


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import llguidance
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.core import EngineCore
    from dpserve.engine.testing import demo_model

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="guided-bench-")
    if not args.model_dir:
        demo_model.create_demo_model(model_dir)
    engine = EngineCore(EngineConfig(model=model_dir, device="cpu", dtype="float32"))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    engine.grammars.submit(grammar).result()  # compiled once per engine (the tokenizer view too), not per request
    for label, g in (("plain", None), ("json schema", grammar)):
        best = None
        for _ in range(args.repeats):
            total, sampler_s, made = run(engine, args.rows, args.tokens, g)
            per = (total / made * 1e6, sampler_s / made * 1e6, made)
            best = per if best is None or per[0] < best[0] else best
        print(f"{label:12s} {best[0]:8.0f} us/token (engine step)  {best[1]:7.0f} us/token in the sampler  ({best[2]} tokens, {args.rows} rows)")


if __name__ == "__main__":
    main()
