#!/usr/bin/env python3
"""Router cost against cluster size: one routing decision and one load-table apply.

    python benchmarks/router_bench.py [--ranks 8,64,256,1024] [--router FILE] [--json]

`--router FILE` measures another version of daemons/router.py (for example
`git show c6e2c37:daemons/router.py > /tmp/old_router.py`, the linear scan
before issue 19) in the same run conditions.

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
import heapq
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.api.router import Router  # noqa: E402
from dpserve.engine.common.protocol import LoadTable, RankLoad  # noqa: E402


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


def reference_pick(router: Router, start: int) -> int:
    """The linear scan the router used before issue 19 (from the rotation point,
    the first strictly lowest score among routable ranks under the limit)."""
    eligible = router.eligible
    best, best_score = -1, 0
    for i in range(len(eligible)):
        rank = eligible[(start + i) % len(eligible)]
        if not router.routable(rank) or router.loads[rank].num_waiting + router.sent[rank] >= router.max_waiting_per_rank:
            continue
        s = 0 if router.policy == "round-robin" else router.score(rank)
        if best < 0 or s < best_score:
            best, best_score = rank, s
    return best


def skewed_load(n: int, num_requests: int, policy: str = "tokens", seed: int = 1) -> dict:
    """A skewed simulated load through the index and, on the same state, the exact
    scan: how often they differ, and the latency tail the index's choices give.

    Ranks process 2,000 tokens/s each; requests arrive at 85% of the cluster's
    capacity with 90% short (50 tokens) and 10% long (2,000 tokens) work; the
    coordinator's table (each rank's backlog) arrives every 10 ms.
    """
    rng = random.Random(seed)
    router = Router(n, policy)
    router.update_table(LoadTable(1, n, [RankLoad(r, "i", True) for r in range(n)]))
    for r in range(n):
        router.engine_hello(r, "i")
    rate = 2000.0
    mean = 0.9 * 50 + 0.1 * 2000
    gap = mean / (rate * n * 0.85)
    free_at = [0.0] * n  # when each rank's backlog ends
    done: list[tuple[float, int, int]] = []  # (finish time, rank, tokens) of requests in flight
    latencies, differ, seq, now, next_table = [], 0, 1, 0.0, 0.01
    for _ in range(num_requests):
        now += rng.expovariate(1 / gap)
        while done and done[0][0] <= now:
            _, rank, tokens = heapq.heappop(done)
            router.on_finish(rank, tokens)
        if now >= next_table:
            seq += 1
            next_table = now + 0.01
            router.update_table(LoadTable(seq, n, [
                RankLoad(r, "i", True, 0, 0, int(max(0.0, free_at[r] - now) * rate), 0) for r in range(n)
            ]))
        expected = reference_pick(router, router._rotate)
        rank = router.pick()
        differ += rank != expected
        tokens = 50 if rng.random() < 0.9 else 2000
        router.on_send(rank, tokens)
        finish = max(now, free_at[rank]) + tokens / rate
        free_at[rank] = finish
        heapq.heappush(done, (finish, rank, tokens))
        latencies.append(finish - now)
    latencies.sort()
    pct = lambda q: 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {"ranks": n, "requests": num_requests, "differ": differ, "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def load_router(path: str) -> type:
    """Router from another copy of router.py (its relative imports made absolute)."""
    import importlib.util
    import tempfile

    text = Path(path).read_text().replace("from .", "from dpserve.daemons.")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("router_under_test", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Router


def main(argv: list[str] | None = None) -> int:
    global Router
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,256,1024")
    ap.add_argument("--policies", default="tokens,queue,round-robin")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--delta-ranks", type=int, default=8, help="ranks named in one delta table")
    ap.add_argument("--skew-requests", type=int, default=20_000, help="requests in the skewed-load check (0: skip)")
    ap.add_argument("--router", help="a router.py to measure instead of the installed one")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.router:
        Router = load_router(args.router)
    skew = [skewed_load(int(n), args.skew_requests) for n in args.ranks.split(",")] if args.skew_requests else []
    rows = [
        measure(int(n), policy, args.repeats, args.delta_ranks)
        for policy in args.policies.split(",")
        for n in args.ranks.split(",")
    ]
    if args.json:
        print(json.dumps({"cost": rows, "skew": skew}, indent=1))
        return 0
    print("| policy | ranks | pick + on_send | on_finish | full table apply | delta apply (ranks) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['ranks']:,} | {r['pick_us']:.1f} us | {r['finish_us']:.1f} us "
            f"| {r['full_table_us']:.1f} us | {r['delta_table_us']:.1f} us ({r['delta_ranks']}) |"
        )
    if skew:
        print("\nSkewed load (tokens policy): the index against the exact scan on the same state")
        print("| ranks | requests | picks that differ | latency p50 | latency p99 |\n|---|---|---|---|---|")
        for k in skew:
            print(f"| {k['ranks']:,} | {k['requests']:,} | {k['differ']} | {k['p50_ms']:.1f} ms | {k['p99_ms']:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
