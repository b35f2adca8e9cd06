"""The sampler's cost a row by what a request asks (plain, top-k, top-p, both), and the full sort
of the vocabulary that top-k / top-p once paid, in one run (ratios are what to compare).

    .venv/bin/python benchmarks/sampler_bench.py [--vocab 49152] [--rows 1 16 64] [--threads 2]

Logits are random with a realistic spread (a chat model's nucleus at top_p 0.9 is a few dozen to a
few hundred tokens: "peaked"), wider ("wide": a few thousand), or flat (a random-weight model: the
nucleus is most of the vocabulary, so top-p sorts the whole row).
"""

from __future__ import annotations

import argparse
import time

import torch
from dpserve.engine.common.protocol import SamplingParams
from dpserve.engine.sampler import Sampler
from dpserve.engine.sequence import Sequence

# standard deviation of the logits: the nucleus at top_p 0.9 is ~30 tokens (peaked), ~2,500 (wide),
# ~44,000 (flat)
SPREAD = {"peaked": 5.0, "wide": 3.0, "flat": 0.05}
CASES = {
    "plain (T=1)": {},
    "top_k=50": dict(top_k=50),
    "top_p=0.9 peaked": dict(top_p=0.9),
    "top_k=50 top_p=0.9": dict(top_k=50, top_p=0.9),
    "top_p=0.9 wide": dict(top_p=0.9),
    "top_p=0.9 flat": dict(top_p=0.9),
}


def per_row_us(fn, rows: int, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat / rows * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(frozenset(), torch.Generator().manual_seed(1))
    print(f"us a row, vocabulary {a.vocab}, {a.threads} threads")
    print(f"| case | {' | '.join(f'{r} rows' for r in a.rows)} |")
    print(f"|---|{'---|' * len(a.rows)}")
    for name, extra in CASES.items():
        cells = []
        for rows in a.rows:
            spread = SPREAD[name.rsplit(" ", 1)[-1]] if name.endswith(tuple(SPREAD)) else 5.0
            logits = torch.randn(rows, a.vocab, generator=gen) * spread
            seqs = [Sequence(f"r{i}", [1], SamplingParams(max_tokens=8, temperature=1.0, **extra)) for i in range(rows)]
            cells.append(per_row_us(lambda x=logits, s=seqs: sampler(x, s), rows, a.repeat))
        print(f"| {name} | {' | '.join(f'{c:,.0f}' for c in cells)} |")
    cells = []
    for rows in a.rows:
        logits = torch.randn(rows, a.vocab, generator=gen)
        cells.append(per_row_us(lambda x=logits: x.sort(dim=-1, descending=True, stable=True), rows, a.repeat))
    print(f"| (a full stable sort alone) | {' | '.join(f'{c:,.0f}' for c in cells)} |")


if __name__ == "__main__":
    main()
