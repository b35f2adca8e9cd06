#!/usr/bin/env python3
"""Multi-tenant prefix routing at cluster scale, simulated (issue 29): policies against an oracle.

    python benchmarks/prefix_sim.py [--ranks 64] [--api-servers 1] [--tenants 384] [--prefix-tokens 2048]
        [--cache-tokens 8192] [--rate 60] [--requests 4000] [--policies ...] [--json]

In the style of llm-d's precise-prefix benchmark, scaled: T tenants, each with a
long shared prefix (--prefix-tokens) and many short questions (--question-tokens,
--output-tokens), Poisson arrivals at --rate req/s, tenants drawn uniformly; the
working set of prefixes (T x prefix) against what the ranks' caches hold
(ranks x --cache-tokens) is printed as the pressure. The ranks are
engine/testing/sim_cache.py's: the real block manager's caching rules (16-token
blocks, LRU, tail first), KV events, steps timed from the realistic model's
measured speeds (--prefill-tokens-per-s, --decode-*-ms). The routers are the
project's Router objects, one per API server, fed as the API servers are:
load tables every --table-interval-s, their own sends and progress, and under
`exact` every rank's KV events (after --event-delay-s); under `approximate`
what the other API servers routed, after a table interval. Policies:
round-robin, tokens, approximate (cache-aware, no events), exact
(cache-aware on KV events), oracle (the same cost model on the caches' true
contents at each decision). Reports: prompt-token hit rate, TTFT p50/p90,
output tok/s, the exact policy's event traffic and the routers' decision cost.
Simulated time, so results do not depend on this machine's load (wall time does).
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

import msgspec  # noqa: E402
from dpserve.daemons.api.router import CACHE_WEIGHT, Router  # noqa: E402
from dpserve.engine.common.protocol import LoadTable, PrefixRouted, RankLoad  # noqa: E402
from dpserve.engine.kv_events import KVEventBatch, KVEventLog, KVSnapshot  # noqa: E402
from dpserve.engine.testing.sim_cache import SimCache, SimCacheRank, SimRequest, SimSpeeds, chain_hashes  # noqa: E402

POLICIES = ("round-robin", "tokens", "approximate", "exact", "oracle")
BLOCK_SIZE = 16
VOCAB = 50_000


def workload(args, seed: int) -> list[tuple[float, list[int], int, int]]:
    """(arrival time, prompt, max_tokens, direct rank or -1) per request, the same for every policy.

    Tenants take turns: at any moment the questions come from a window of
    --active-tenants consecutive tenants, uniformly, and the window slides over
    all of them --cycles times during the run, so a tenant comes back after its
    prefix was evicted (what an index that never learns of evictions gets wrong).
    A share --direct-share of the requests reaches a random rank by another
    path than these routers (a pin through an API server that shares nothing,
    a migrated request, an external load balancer): only the ranks' KV events
    and load reports tell the routers of them. A share --hot-share goes to one
    tenant that is always active: its prefix must be held by more ranks than one.
    """
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(args.prefix_tokens)] for _ in range(args.tenants)]
    active = args.active_tenants or max(1, args.tenants // 6)
    out, t = [], 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        if args.prefix_tokens:
            start = int(i / args.requests * args.cycles * args.tenants)
            tenant = (start + rng.randrange(active)) % args.tenants
            if args.hot_share and rng.random() < args.hot_share:
                tenant = 0  # the hot tenant: always active, more questions than one rank serves
            prompt = prefixes[tenant] + [rng.randrange(VOCAB) for _ in range(args.question_tokens)]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(args.unshared_tokens)]
        direct = rng.randrange(args.ranks) if rng.random() < args.direct_share else -1
        out.append((t, prompt, args.output_tokens, direct))
    return out


def cache_tokens(args, rank: int) -> int:
    """Rank `rank`'s KV cache, in tokens (--cache-spread: two sizes, the same total)."""
    return int(args.cache_tokens * (1 - args.cache_spread if rank % 2 == 0 else 1 + args.cache_spread))


class Sim:
    """One policy's run: ranks, routers and the event queue between them."""

    def __init__(self, args, policy: str) -> None:
        self.args, self.policy = args, policy
        speeds = SimSpeeds(args.prefill_tokens_per_s, args.decode_base_ms, args.decode_per_seq_ms, args.chunk_tokens)
        self.logs = [KVEventLog(BLOCK_SIZE) for _ in range(args.ranks)]
        self.ranks = [SimCacheRank(r, SimCache(cache_tokens(args, r) // BLOCK_SIZE, BLOCK_SIZE, self.logs[r]), speeds, args.max_num_seqs)
                      for r in range(args.ranks)]
        self.num_resets = 0
        router_policy = {"approximate": "cache-aware", "exact": "cache-aware", "oracle": "tokens"}.get(policy, policy)
        self.routers = [Router(args.ranks, router_policy, kv_events=policy == "exact", cache_weight=args.cache_weight)
                        for _ in range(args.api_servers)]
        self.queue: list = []
        self.n = 0
        self.table_seq = 0
        self.stepping = [False] * args.ranks
        self.done: list[SimRequest] = []
        self.event_bytes = 0
        self.event_batches = 0
        self.apply_s = 0.0
        self.pick_s = 0.0
        self.num_picks = 0
        self.codec = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.codec_s = 0.0  # encoding at the rank + decoding at one API server, every batch
        self.inflight: list[dict[int, int]] = [{} for _ in range(args.ranks)]  # oracle: hash -> prompts computing it
        for i, router in enumerate(self.routers):
            router.origin = f"api{i}"
            if policy in ("approximate", "exact") and args.api_servers > 1:
                delay = args.table_interval_s if args.note_delay_s is None else args.note_delay_s
                router.on_routed = lambda rank, keys, i=i, delay=delay: self.at(self.now + delay, "routed", (i, rank, keys))
            for r in range(args.ranks):
                router.engine_hello(r, f"i{r}")
            if router.kv is not None:
                router.kv.clock = lambda: self.now
        self.now = 0.0
        self.publish_table()

    def at(self, t: float, kind: str, payload) -> None:
        self.n += 1
        heapq.heappush(self.queue, (t, self.n, kind, payload))

    def publish_table(self) -> None:
        self.table_seq += 1
        table = LoadTable(self.table_seq, len(self.ranks), [
            RankLoad(r.rank, f"i{r.rank}", True, len(r.decoding) + len(r.prefilling), len(r.waiting),
                     r.num_waiting_prefill_tokens, r.num_remaining_decode_tokens) for r in self.ranks])
        for router in self.routers:
            router.update_table(table)

    def run(self, requests) -> dict:
        for rid, (t, prompt, max_tokens, direct) in enumerate(requests):
            self.at(t, "arrive", (rid, prompt, max_tokens, direct))
        self.at(self.args.table_interval_s, "table", None)
        if self.args.reset_every_s:
            self.at(self.args.reset_every_s, "reset", random.Random(self.args.seed + 1))
        handlers = {"arrive": self.arrive, "step": self.step_end, "table": self.table, "kv": self.kv, "routed": self.routed,
                    "reset": self.reset}
        remaining = len(requests)
        while self.queue and (remaining > len(self.done)):
            self.now, _, kind, payload = heapq.heappop(self.queue)
            handlers[kind](payload)
        return self.report(requests)

    def table(self, _payload) -> None:
        self.publish_table()
        self.at(self.now + self.args.table_interval_s, "table", None)

    def reset(self, rng: random.Random) -> None:
        """A rank drops every cached block nobody is using, for its own reasons (a weight update,
        vLLM's /reset_prefix_cache, another workload's memory), without restarting: its events
        say so, its load reports do not."""
        r = rng.randrange(len(self.ranks))
        cache = self.ranks[r].cache
        while cache.cached:
            cache._evict()
            cache.num_free += 1
        self.num_resets += 1
        if self.policy == "exact" and not self.stepping[r]:  # an idle rank publishes at its next step: now
            batch = self.logs[r].take_batch(r, f"i{r}")
            if batch is not None:
                self.at(self.now + self.args.event_delay_s, "kv", batch)
        self.at(self.now + self.args.reset_every_s, "reset", rng)

    def arrive(self, payload) -> None:
        rid, prompt, max_tokens, direct = payload
        a = rid % len(self.routers) if direct < 0 else -1  # -1: by another path, no router of ours saw it
        req = SimRequest(rid, prompt, chain_hashes(prompt, BLOCK_SIZE), max_tokens, self.now, a)
        if direct < 0:
            router = self.routers[a]
            t0 = time.perf_counter()
            rank = self.oracle_pick(router, req) if self.policy == "oracle" else router.pick(None, prompt)
            router.on_send(rank, len(prompt) + max_tokens)
            self.pick_s += time.perf_counter() - t0
            self.num_picks += 1
        else:
            rank = direct
        if self.policy == "oracle":
            coming = self.inflight[rank]
            for h in req.hashes:
                coming[h] = coming.get(h, 0) + 1
        self.ranks[rank].enqueue(req)
        if not self.stepping[rank]:
            self.start_step(rank)

    def oracle_pick(self, router: Router, req: SimRequest) -> int:
        """The exact policy's cost model on what each cache truly holds now: a cached token is
        worth cache_weight load tokens, shared among the ranks that hold as much (at least 1)."""
        held = []
        for r, sim in enumerate(self.ranks):
            # what the cache holds, or what a prompt sent there is computing (the rank waits for it)
            hits = sim.cache.num_hits(req.hashes)
            coming = self.inflight[r]
            while hits < len(req.hashes) and req.hashes[hits] in coming:
                hits += 1
            held.append(hits * BLOCK_SIZE // 64 * 64)  # in routing blocks, as the router credits
        weight = self.args.cache_weight or CACHE_WEIGHT
        best, best_cost, best_cached = -1, None, 0
        for r, cached in enumerate(held):
            key = router._key[r]
            if key is None:
                continue
            holders = sum(1 for c in held if c >= cached) if cached else 1
            cost = (key - cached * max(1.0, weight / holders), key)
            if best_cost is None or cost < best_cost:
                best, best_cost, best_cached = r, cost, cached
        router._pending_credit = best_cached  # as the exact policy's pick does
        return best

    def start_step(self, r: int) -> None:
        rank = self.ranks[r]
        end, first, done = rank.step(self.now)
        self.stepping[r] = True
        self.at(end, "step", (r, first, done))

    def step_end(self, payload) -> None:
        r, first, done = payload
        for req in first:
            if req.router >= 0:
                self.routers[req.router].on_progress(r, len(req.prompt) + 1)
            if self.policy == "oracle":
                coming = self.inflight[r]
                for h in req.hashes:
                    coming[h] -= 1
                    if not coming[h]:
                        del coming[h]
        for req in done:
            if req.router >= 0:
                self.routers[req.router].on_finish(r, req.max_tokens - 1)
            self.done.append(req)
        if self.policy == "exact":
            batch = self.logs[r].take_batch(r, f"i{r}")
            if batch is not None:
                t0 = time.process_time()
                data = self.codec.encode(batch)
                self.decoder.decode(data)
                self.codec_s += time.process_time() - t0
                self.event_bytes += len(data)
                self.event_batches += 1
                self.at(self.now + self.args.event_delay_s, "kv", batch)
        self.stepping[r] = False
        if self.ranks[r].is_busy:
            self.start_step(r)

    def kv(self, batch) -> None:
        t0 = time.process_time()  # CPU time: other processes' load does not inflate it
        for router in self.routers:
            if router.kv.apply(batch):
                log = self.logs[batch.rank]
                router.kv.apply_snapshot(KVSnapshot(batch.rank, batch.incarnation, log.seq, log.snapshot(), log.block))
        self.apply_s += time.process_time() - t0

    def routed(self, payload) -> None:
        origin, rank, keys = payload
        note = PrefixRouted(f"api{origin}", [(rank, keys)])  # as the coordinator forwards it
        for router in self.routers:
            router.learn(note)

    def report(self, requests) -> dict:
        done = self.done
        ttfts = sorted(q.t_first - q.t_arrival for q in done)
        prompt = sum(r.num_prompt_tokens for r in self.ranks)
        cached = sum(r.num_cached_tokens for r in self.ranks)
        span = max(q.t_first for q in done) - requests[0][0]
        out_tokens = sum(q.max_tokens for q in done)
        sim_s = self.now
        return {
            "policy": self.policy,
            "requests": len(done),
            "hit_rate": round(cached / prompt, 3) if prompt else 0.0,
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
            "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000, 1),
            "output_tok_s": round(out_tokens / span, 1),
            "evictions": sum(r.cache.num_evictions for r in self.ranks),
            "resets": self.num_resets,
            "pick_us": round(self.pick_s / max(1, self.num_picks) * 1e6, 1),
            "event_bytes_per_s_per_rank": round(self.event_bytes / sim_s / len(self.ranks)) if self.event_bytes else 0,
            "event_batches_per_s_per_rank": round(self.event_batches / sim_s / len(self.ranks), 1),
            # one API server's CPU share to decode nothing (in process) and file every rank's events
            "apply_cpu_share_per_api_server": round(self.apply_s / len(self.routers) / sim_s, 5),
            "codec_cpu_share": round(self.codec_s / sim_s, 5),  # one encode + one decode of every rank's batches
        }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--api-servers", type=int, default=1)
    ap.add_argument("--tenants", type=int, default=1536)
    ap.add_argument("--active-tenants", type=int, default=0, help="the sliding window's width (default: tenants / 6)")
    ap.add_argument("--cycles", type=float, default=2.0, help="times the window goes over every tenant")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="0: no shared prefixes (every prompt random)")
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--unshared-tokens", type=int, default=2112, help="prompt length without shared prefixes")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--direct-share", type=float, default=0.0,
                    help="share of requests sent to a random rank by another path (pins elsewhere, migration): routers see only events")
    ap.add_argument("--hot-share", type=float, default=0.0,
                    help="share of requests from one always-active tenant (a prefix too hot for one rank)")
    ap.add_argument("--cache-tokens", type=int, default=16384, help="each rank's KV cache")
    ap.add_argument("--cache-spread", type=float, default=0.0,
                    help="caches of different sizes: even ranks hold cache-tokens x (1 - F), odd ranks x (1 + F)")
    ap.add_argument("--note-delay-s", type=float, default=None,
                    help="approximate/exact with several API servers: what one routed reaches the others this late (default: a table interval)")
    ap.add_argument("--reset-every-s", type=float, default=0.0,
                    help="every this many seconds a random rank drops its unused cached blocks without restarting (0: never)")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second, Poisson")
    ap.add_argument("--requests", type=int, default=12000)
    # the realistic model (135M-class, bf16, eager, OMP 1) on this CPU, measured with EngineCore (see RESULTS)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=245.0)
    ap.add_argument("--decode-base-ms", type=float, default=215.0)
    ap.add_argument("--decode-per-seq-ms", type=float, default=5.3)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--table-interval-s", type=float, default=0.05)
    ap.add_argument("--event-delay-s", type=float, default=0.002)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--cache-weight", type=float, default=None,
                    help="approximate, exact and oracle: load tokens a cached prompt token held by one rank is worth "
                         "(by k ranks: max(1, weight / k)); default: the router's, CACHE_WEIGHT")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    requests = workload(args, args.seed)
    pressure = args.tenants * args.prefix_tokens / sum(cache_tokens(args, r) for r in range(args.ranks))
    rows = []
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        row = Sim(args, policy).run(requests)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"pressure": round(pressure, 2), "args": vars(args), "rows": rows}, indent=2))
        return 0
    print(f"\n{args.ranks} ranks, {args.api_servers} API server(s), {args.tenants} tenants x {args.prefix_tokens}-token prefix, "
          f"{args.question_tokens}-token questions, {args.output_tokens}-token answers, {args.rate} req/s; "
          f"working set / cache = {pressure:.2f}\n")
    print("| policy | hit rate | TTFT p50 | TTFT p90 | output tok/s | evictions | router pick |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']} ms | {r['ttft_p90_ms']} ms | {r['output_tok_s']} | "
              f"{r['evictions']} | {r['pick_us']} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
