#!/usr/bin/env python3
"""Cost of a cache-aware routing decision (issue 16), against cluster size and prompt length.

    python benchmarks/prefix_routing_bench.py [--ranks 8,64,256] [--prompt-tokens 256,1024,4096] [--json]

The project's own Router in this process, all ranks routable, an index warmed
with 2,000 conversations (a shared 1,024-token system prompt, then a
conversation of its own) spread over the ranks, the way one API server sees
multi-turn chat. Per request: `chain_keys` (the block keys of the prompt,
computed once per request) and then `pick()` + `on_send()` + `on_finish()`
for a later turn of a known conversation (the index matches it). Also the
tokens policy's pick for comparison, and (issue 29) cache-aware on KV events
("exact"): the index warmed by each rank's KV events (routing keys) for its
conversations (16-token engine blocks, each stored once per rank), the
decision binary searches over the 64-token blocks' holders plus the note of
the send. Each turn is a fresh copy of its ids (as just decoded: new ints, in
cache); "reading the ids" is sum() over them, the floor for any hashing in
Python. The keys come from the C extension where it was built (prefix_index.KEYS_IMPL,
printed). Median of --repeats of the mean per request, and for exact also the median
request (preempted requests on a loaded machine do not move it), microseconds; printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.api.prefix_index import KEYS_IMPL, chain_keys  # noqa: E402
from dpserve.daemons.api.router import Router  # noqa: E402
from dpserve.engine.common.protocol import LoadTable, RankLoad  # noqa: E402
from dpserve.engine.kv_events import KVEventLog  # noqa: E402
from dpserve.engine.testing.sim_cache import chain_hashes  # noqa: E402


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def live(n: int, policy: str, rng: random.Random) -> Router:
    router = Router(n, "cache-aware" if policy == "exact" else policy, kv_events=policy == "exact")
    router.update_table(LoadTable(1, n, [RankLoad(r, f"i{r}", True, rng.randrange(8), rng.randrange(4), rng.randrange(4096), rng.randrange(4096))
                                         for r in range(n)]))
    for r in range(n):
        router.engine_hello(r, f"i{r}")
    return router


def measure(n: int, prompt_tokens: int, repeats: int, count: int = 2000) -> dict:
    rng = random.Random(n * 7 + prompt_tokens)
    system = ids(rng, 1024)
    convs = [system + ids(rng, max(0, prompt_tokens - 1024)) for _ in range(2000)] if prompt_tokens > 1024 else \
        [ids(rng, prompt_tokens) for _ in range(2000)]
    out = {"ranks": n, "prompt_tokens": prompt_tokens}
    for policy in ("tokens", "cache-aware", "exact"):
        router = live(n, policy, rng)
        if policy == "exact":  # warm the index: each conversation's blocks stored by one rank (each block once)
            logs, held = [KVEventLog(16) for _ in range(n)], [set() for _ in range(n)]
            for i, conv in enumerate(convs):
                hashes = chain_hashes(conv, 16)
                for k, h in enumerate(hashes):
                    if h not in held[i % n]:  # an engine stores a block it already holds no second time
                        held[i % n].add(h)
                        logs[i % n].stored(h, hashes[k - 1] if k else None, conv[k * 16 : (k + 1) * 16])
                router.kv.apply(logs[i % n].take_batch(i % n, f"i{i % n}"))
        for conv in convs if policy != "exact" else ():  # warm the index: each conversation's first turn routed once
            rank = router.pick(None, conv)
            router.on_send(rank, len(conv))
            router.on_finish(rank, len(conv))
        turns = [conv + [1, 2, 3] for conv in rng.choices(convs, k=count)]
        read_us, keys_us, pick_us, each = [], [], [], []
        for _ in range(repeats):
            read = hashing = total = 0.0
            for turn in turns:
                fresh = array("I", turn).tolist()  # as just decoded from the request: its ints new, and in cache
                t0 = time.perf_counter()
                sum(fresh)  # the floor: reading every id once
                t1 = time.perf_counter()
                chain_keys(fresh)  # (the exact index's block is the same 64 tokens)
                t2 = time.perf_counter()
                rank = router.pick(None, fresh)
                router.on_send(rank, 64)
                router.on_finish(rank, 64)
                t3 = time.perf_counter()
                read, hashing, total = read + t1 - t0, hashing + t2 - t1, total + t3 - t2
                each.append(t3 - t2)
            read_us.append(read / count * 1e6)
            keys_us.append(hashing / count * 1e6)
            pick_us.append(total / count * 1e6)
        hashing = statistics.median(keys_us) if policy != "tokens" else 0.0
        # pick() hashes the prompt itself under cache-aware: the decision alone is the difference
        out[policy] = {"read_us": round(statistics.median(read_us), 1), "keys_us": round(hashing, 1),
                       "pick_total_us": round(statistics.median(pick_us), 1),
                       "decision_us": round(statistics.median(pick_us) - hashing, 1),
                       # the median request: a request the OS preempted (a loaded machine) does not move it
                       "pick_total_p50_us": round(statistics.median(each) * 1e6, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,64,256")
    ap.add_argument("--prompt-tokens", default="256,1024,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [measure(int(n), int(p), args.repeats) for n in args.ranks.split(",") for p in args.prompt_tokens.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"block keys computed by: {KEYS_IMPL} (prefix_index.KEYS_IMPL); load average {open('/proc/loadavg').read().split()[:3]}\n")
    print("| ranks | prompt tokens | tokens: pick+send+finish | reading the ids (sum) | block keys | approximate: decision |"
          " exact (events): decision | exact: keys + decision | exact: keys + decision, median request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, c, e = r["tokens"], r["cache-aware"], r["exact"]
        print(f"| {r['ranks']} | {r['prompt_tokens']:,} | {t['pick_total_us']} us | {c['read_us']} us | {c['keys_us']} us | {c['decision_us']} us | "
              f"{e['decision_us']} us | {e['pick_total_us']} us | {e['pick_total_p50_us']} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
