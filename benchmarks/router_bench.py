#!/usr/bin/env python3
"""Router cost against cluster size: one routing decision and one load-table apply.

    python benchmarks/router_bench.py [--ranks 8,64,256,1024] [--json]

Uses the project's own `Router` in this process, all ranks routable, the
way one API server uses it: per request one `pick()` + `on_send()` (and
later one `on_finish()`, timed apart); per load table one `update_table()`,
either a full table (every rank) or a delta naming the ranks that changed
(`--delta-ranks`, the common case under load: a few ranks reported in the
last publish interval). Loads are random, so scores differ between ranks
and from one table to the next. Figures are the median of `--repeats`
runs, in microseconds per call; printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.router import Router  # noqa: E402
from dpserve.engine.protocol import LoadTable, RankLoad  # noqa: E402


def random_load(rng: random.Random, rank: int) -> RankLoad:
    waiting = rng.randrange(0, 8)
    running = rng.randrange(0, 64)
    return RankLoad(rank, f"i{rank}", True, running, waiting, waiting * rng.randrange(20, 2000), running * rng.randrange(1, 256))


def make_router(n: int, policy: str, rng: random.Random) -> Router:
    router = Router(n, policy)
    router.update_table(LoadTable(1, n, [random_load(rng, r) for r in range(n)]))
    for r in range(n):
        router.engine_hello(r, f"i{r}")
    return router


def time_picks(router: Router, count: int) -> tuple[float, float]:
    """(us per pick + on_send, us per on_finish)."""
    picked = [0] * count
    t0 = time.perf_counter()
    for i in range(count):
        rank = router.pick()
        router.on_send(rank, 100)
        picked[i] = rank
    t1 = time.perf_counter()
    for rank in picked:
        router.on_finish(rank, 100)
    t2 = time.perf_counter()
    return (t1 - t0) / count * 1e6, (t2 - t1) / count * 1e6


def time_tables(router: Router, tables: list[LoadTable]) -> float:
    t0 = time.perf_counter()
    for table in tables:
        router.update_table(table)
    return (time.perf_counter() - t0) / len(tables) * 1e6


def measure(n: int, policy: str, repeats: int, delta_ranks: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    router = make_router(n, policy, rng)
    count = max(200, 20_000 // max(1, n // 8))
    num_tables = max(20, 2_000 // max(1, n // 8))
    seq = [router.table_seq]

    def tables(full: bool) -> list[LoadTable]:
        out = []
        for _ in range(num_tables):
            seq[0] += 1
            ranks = range(n) if full else sorted(rng.sample(range(n), min(delta_ranks, n)))
            out.append(LoadTable(seq[0], n, [random_load(rng, r) for r in ranks]))
        return out

    picks, finishes, fulls, deltas = [], [], [], []
    for _ in range(repeats):
        p, f = time_picks(router, count)
        picks.append(p)
        finishes.append(f)
        fulls.append(time_tables(router, tables(True)))
        deltas.append(time_tables(router, tables(False)))
    return {
        "ranks": n,
        "policy": policy,
        "pick_us": statistics.median(picks),
        "finish_us": statistics.median(finishes),
        "full_table_us": statistics.median(fulls),
        "delta_table_us": statistics.median(deltas),
        "delta_ranks": min(delta_ranks, n),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,256,1024")
    ap.add_argument("--policies", default="tokens,queue,round-robin")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--delta-ranks", type=int, default=8, help="ranks named in one delta table")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [
        measure(int(n), policy, args.repeats, args.delta_ranks)
        for policy in args.policies.split(",")
        for n in args.ranks.split(",")
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| policy | ranks | pick + on_send | on_finish | full table apply | delta apply (ranks) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['ranks']:,} | {r['pick_us']:.1f} us | {r['finish_us']:.1f} us "
            f"| {r['full_table_us']:.1f} us | {r['delta_table_us']:.1f} us ({r['delta_ranks']}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
