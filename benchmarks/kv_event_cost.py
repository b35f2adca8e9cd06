#!/usr/bin/env python3
"""What KV events cost per request, on each side of the channel (issue 29: the plain path's API CPU).

    python benchmarks/kv_event_cost.py [--prompt-tokens 304] [--requests 3000] [--cache-blocks 2048]
    python benchmarks/kv_event_cost.py --code /tmp/before    # another source tree's engine/ and daemons/

The native engine's real BlockManager (blake2b block hashes, 16-token blocks,
LRU eviction tail first) serves --requests prompts of --prompt-tokens fresh
tokens each (no shared prefixes: what the events add to the plain path is pure
cost), with and without its KVEventLog; every step's batch is encoded as the
rank sends it, decoded as the API server's codec does, and filed in an API
server's KVIndex. Per request: the rank's added time (serving with the log
minus without), the bytes on the wire, and the API server's decode and apply.
With --code the same run loads another tree first (benchmarks/nodes.py's
shim), so two designs compare in one command each. CPU time (process_time),
median of --repeats; printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))


def serve_all(prompts: list[list[int]], cache_blocks: int, log) -> tuple[float, list]:
    """Admit, compute, register and release each prompt in turn; the batch after each (None: no log)."""
    from dpserve.engine.kv_cache import BlockManager

    bs = 16
    b = BlockManager(cache_blocks, bs, enable_caching=True, events=log)
    batches = []
    t0 = time.process_time()
    for prompt in prompts:
        hashes: list[bytes] = []
        b.extend_hashes(hashes, prompt, len(prompt))
        hits = b.match(hashes, prompt, (len(prompt) - 1) // bs)
        table: list[int] = []
        b.attach(table, hits)
        b.grow(table, len(prompt))
        for i in range(len(prompt) // bs):
            b.register(table[i], hashes[i], prompt[i * bs : (i + 1) * bs], hashes[i - 1] if i else None)
        b.release(table)
        if log is not None:
            batches.append(log.take_batch(0, "i0"))
    return time.process_time() - t0, batches


def measure(args) -> dict:
    from dpserve.daemons.api.kv_index import KVIndex
    from dpserve.engine.common.codec import Codec
    from dpserve.engine.common.protocol import EngineToApi
    from dpserve.engine.kv_events import KVEventLog

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 50_000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    codec = Codec(EngineToApi)
    n = args.requests
    rows: dict[str, list[float]] = {"rank_us": [], "encode_us": [], "decode_us": [], "apply_us": []}
    size = 0
    for _ in range(args.repeats):
        bare, _ = serve_all(prompts, args.cache_blocks, None)
        logged, batches = serve_all(prompts, args.cache_blocks, KVEventLog(16))
        batches = [batch for batch in batches if batch is not None]
        t0 = time.process_time()
        wire = [codec.encode(batch) for batch in batches]
        t1 = time.process_time()
        msgs = [codec.decode(data) for data in wire]
        t2 = time.process_time()
        index = KVIndex(1)
        for msg in msgs:
            index.apply(msg)
        t3 = time.process_time()
        size = sum(map(len, wire))
        for key, seconds in (("rank_us", logged - bare), ("encode_us", t1 - t0), ("decode_us", t2 - t1), ("apply_us", t3 - t2)):
            rows[key].append(1e6 * seconds / n)
    out = {key: round(statistics.median(v), 2) for key, v in rows.items()}
    out["bytes"] = round(size / n)
    out["batches"] = len(batches)
    out["api_us"] = round(out["decode_us"] + out["apply_us"], 2)
    out["index_bytes_per_key"] = index_memory(args.index_ranks, args.index_keys)
    return out


def index_memory(ranks: int, keys_per_rank: int) -> int:
    """An API server's index memory per (rank, routing block held), every rank holding distinct
    prefixes (the worst case: a key many ranks hold is filed once): what cache-aware costs in RSS,
    x ranks x the blocks of 64 tokens each rank caches."""
    import tracemalloc

    from dpserve.daemons.api.kv_index import KVIndex
    from dpserve.engine.kv_events import KeysStored, KVEventBatch

    rng = random.Random(1)
    batches = [KVEventBatch(r, "i0", 1, [KeysStored([rng.getrandbits(63) for _ in range(keys_per_rank)], 64)])
               for r in range(ranks)]
    tracemalloc.start()
    index = KVIndex(ranks)
    for batch in batches:
        index.apply(batch)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return round(used / (ranks * keys_per_rank))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=304)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--cache-blocks", type=int, default=2048, help="the rank's cache, in 16-token blocks")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--index-ranks", type=int, default=64, help="the index-memory figure's ranks")
    ap.add_argument("--index-keys", type=int, default=2000, help="... and routing blocks each holds")
    ap.add_argument("--code", default=None, help="a dpserve source tree to measure instead of this one")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.code and not os.environ.get("KV_EVENT_COST_CHILD"):
        from benchmarks.nodes import code_tree_env

        env = {**os.environ, **code_tree_env(args.code), "KV_EVENT_COST_CHILD": "1"}
        argv = [a for a in sys.argv[1:] if a != "--json"] + ["--json"]
        res = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True, check=True)
        result = json.loads(res.stdout.strip().splitlines()[-1])
    else:
        result = measure(args)
    from dpserve.daemons.api import prefix_index

    result["tree"] = args.code or str(ROOT)
    result["keys_impl"] = prefix_index.KEYS_IMPL
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.requests} requests of {args.prompt_tokens} fresh tokens, cache {args.cache_blocks} x 16 tokens; "
          f"tree {result['tree']}; per request, CPU time, median of {args.repeats}:")
    print("| rank: filing (log) | rank: encode | bytes | API: decode | API: apply | API: total |")
    print("|---|---|---|---|---|---|")
    print(f"| {result['rank_us']} us | {result['encode_us']} us | {result['bytes']} | {result['decode_us']} us | "
          f"{result['apply_us']} us | **{result['api_us']} us** |")
    if "index_bytes_per_key" in result:  # (trees before it did not measure it)
        print(f"API server's index: {result['index_bytes_per_key']} bytes per (rank, routing block held), "
              f"{args.index_ranks} ranks x {args.index_keys} distinct blocks each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
