"""A simulated rank's prefix cache and its timing: blocks, LRU eviction, KV events, prefill cost.

A TEST AND BENCHMARK TOOL (no model, no torch): what engine/kv_cache.py's
BlockManager does with full blocks (reference-counted, registered under a
hash chain, evictable least recently released first, tail first), with the
same KVEventLog, so that simulated ranks publish the events real ones do;
and SimCacheRank, one rank's queue and steps timed from the realistic model's
measured speeds (SimSpeeds), for benchmarks/prefix_sim.py. It never decides
where a request goes.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque

from dpserve.engine.kv_events import KVEventLog


def chain_hashes(prompt: list[int], block_size: int) -> list[int]:
    """The prompt's full blocks' keys (ints: the simulation's own, like vLLM's int hashes)."""
    out, parent = [], 0
    for i in range(len(prompt) // block_size):
        parent = hash((parent, *prompt[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


class SimCache:
    """num_blocks blocks; registered full blocks are shared, kept after release, and evicted LRU.

    Invariant: num_free + len(cached) + blocks in use == num_blocks; a
    registered hash is either referenced (ref[h] > 0) or in `cached`.
    """

    def __init__(self, num_blocks: int, block_size: int, events: KVEventLog | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free = num_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.ref: dict[int, int] = {}
        self.events = events
        self.num_evictions = 0

    def num_hits(self, hashes: list[int]) -> int:
        """Leading blocks of the chain this cache holds."""
        n = 0
        for h in hashes:
            if h not in self.ref:
                break
            n += 1
        return n

    def admit(self, hashes: list[int], num_blocks: int) -> int | None:
        """Take the cached leading blocks and num_blocks - hits new ones; None if they do not fit."""
        hits = self.num_hits(hashes[: num_blocks - 1]) if num_blocks > 1 else 0
        shared_evictable = sum(1 for h in hashes[:hits] if self.ref[h] == 0)
        need = num_blocks - hits
        if need > self.num_free + len(self.cached) - shared_evictable:
            return None
        for h in hashes[:hits]:
            if self.ref[h] == 0:
                del self.cached[h]
            self.ref[h] += 1
        for _ in range(need):
            if self.num_free:
                self.num_free -= 1
            else:
                self._evict()
        return hits

    def _evict(self) -> None:
        h, _ = self.cached.popitem(last=False)
        del self.ref[h]
        self.num_evictions += 1
        if self.events is not None:
            self.events.removed(h)

    def register(self, hashes: list[int], prompt: list[int], hits: int) -> list[int]:
        """The prompt's blocks after the hits are computed: register the ones nobody registered
        (an equal block another request registered meanwhile keeps ours private). Returns the
        hashes this request now references."""
        bs = self.block_size
        held = list(hashes[:hits])
        for i in range(hits, len(hashes)):
            h = hashes[i]
            if h in self.ref:
                continue  # private duplicate: freed on release
            self.ref[h] = 1
            held.append(h)
            if self.events is not None:
                self.events.stored(h, hashes[i - 1] if i else None, prompt[i * bs : (i + 1) * bs])
        return held

    def release(self, held: list[int], num_blocks: int) -> None:
        """A request of num_blocks blocks, referencing `held`, finished: the tail goes first."""
        for h in reversed(held):
            self.ref[h] -= 1
            if self.ref[h] == 0:
                self.cached[h] = None
        self.num_free += num_blocks - len(held)


class SimSpeeds:
    """One rank's step time: decode_base_ms + decode_per_seq_ms x running + prefilled tokens / prefill rate."""

    def __init__(self, prefill_tokens_per_s: float, decode_base_ms: float, decode_per_seq_ms: float, chunk_tokens: int = 512) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_base_ms = decode_base_ms
        self.decode_per_seq_ms = decode_per_seq_ms
        self.chunk_tokens = chunk_tokens

    def step_s(self, num_running: int, prefill_tokens: int) -> float:
        decode = (self.decode_base_ms + self.decode_per_seq_ms * num_running) / 1000 if num_running else 0.0
        return decode + prefill_tokens / self.prefill_tokens_per_s


class SimRequest:
    __slots__ = ("rid", "prompt", "hashes", "max_tokens", "t_arrival", "hits", "held", "prefill_left", "num_generated",
                 "t_first", "num_blocks", "router")

    def __init__(self, rid: int, prompt: list[int], hashes: list[int], max_tokens: int, t_arrival: float, router: int) -> None:
        self.rid, self.prompt, self.hashes, self.max_tokens, self.t_arrival = rid, prompt, hashes, max_tokens, t_arrival
        self.router = router
        self.hits = 0
        self.held: list[int] = []
        self.prefill_left = 0
        self.num_generated = 0
        self.t_first = 0.0
        self.num_blocks = 0


class SimCacheRank:
    """One rank: a FIFO of waiting requests, admitted while blocks allow (at most max_num_seqs running),
    prefilled in chunks within each step's budget; every running request gains a token a step."""

    def __init__(self, rank: int, cache: SimCache, speeds: SimSpeeds, max_num_seqs: int = 64) -> None:
        self.rank = rank
        self.cache = cache
        self.speeds = speeds
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.num_prompt_tokens = self.num_cached_tokens = 0
        self.num_waiting_tokens = 0  # prompt tokens in `waiting` (a running sum: queues grow long)

    def enqueue(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.num_waiting_tokens += len(req.prompt)

    @property
    def is_busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    @property
    def num_waiting_prefill_tokens(self) -> int:
        return self.num_waiting_tokens + sum(r.prefill_left for r in self.prefilling)

    @property
    def num_remaining_decode_tokens(self) -> int:
        return sum(r.max_tokens - r.num_generated for r in self.decoding)

    def step(self, now: float) -> tuple[float, list[SimRequest], list[SimRequest]]:
        """One step from `now`: returns (its end, requests whose first token it made, requests it finished)."""
        bs, cache = self.cache.block_size, self.cache
        # as the real scheduler: a prompt whose next block another prefill is computing waits for it
        in_flight = {h for r in self.prefilling for h in r.hashes[r.hits :]}
        for req in list(self.waiting):
            if len(self.prefilling) + len(self.decoding) >= self.max_num_seqs:
                break
            req.num_blocks = -(-(len(req.prompt) + req.max_tokens) // bs)
            first_new = cache.num_hits(req.hashes)
            if first_new < len(req.hashes) - 1 and req.hashes[first_new] in in_flight:
                continue
            hits = cache.admit(req.hashes, req.num_blocks)
            if hits is None:
                break
            self.waiting.remove(req)
            self.num_waiting_tokens -= len(req.prompt)
            in_flight.update(req.hashes[hits:])
            req.hits, req.held = hits, req.hashes[:hits]
            req.prefill_left = len(req.prompt) - hits * bs
            self.num_prompt_tokens += len(req.prompt)
            self.num_cached_tokens += hits * bs
            self.prefilling.append(req)
        budget, used, first, done = self.speeds.chunk_tokens, 0, [], []
        for req in list(self.prefilling):
            take = min(budget - used, req.prefill_left)
            req.prefill_left -= take
            used += take
            if req.prefill_left == 0:
                self.prefilling.remove(req)
                req.held = cache.register(req.hashes, req.prompt, req.hits)
                first.append(req)
            if used >= budget:
                break
        end = now + self.speeds.step_s(len(self.decoding) + len(first), used)
        still = []
        for req in self.decoding + first:
            req.num_generated += 1
            if req.num_generated == 1:
                req.t_first = end
            if req.num_generated >= req.max_tokens:
                cache.release(req.held, req.num_blocks)
                done.append(req)
            else:
                still.append(req)
        self.decoding = still
        return end, first, done


SIM_BLOCK = 16  # the simulated engine's block size (the native engine's default)


class _Cached:
    __slots__ = ("hashes", "prompt", "hits", "held", "num_blocks", "is_registered")

    def __init__(self, hashes: list[int], prompt: list[int], hits: int, num_blocks: int) -> None:
        self.hashes, self.prompt, self.hits, self.num_blocks = hashes, prompt, hits, num_blocks
        self.held = hashes[:hits]  # referenced: the hits until the prefill registers the rest
        self.is_registered = False


@functools.cache
def caching_core(base: type):
    """`dpserve sim-engine --kv-cache-blocks N`: SimCore (engine/testing/sim.py, passed as `base`)
    with a SimCache of N blocks. A prompt's cached leading blocks are not prefilled again, and the
    cache's KV events reach the API servers that ask, as a real rank's do (RankIO's KVPublisher
    reads `kv_events` after each step and answers snapshots from it).

    Invariant: `requests` holds the cache state of exactly the requests SimCore still holds that
    got blocks (a request that found no room runs uncached); each releases them once, when it
    finishes or is aborted."""

    class CachingSimCore(base):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.kv_events = KVEventLog(SIM_BLOCK)
            self.cache = SimCache(cfg.kv_cache_blocks, SIM_BLOCK, self.kv_events)
            self.requests: dict[str, _Cached] = {}

        def describe(self) -> dict:
            return {**super().describe(), "kv_cache_blocks": self.cache.num_blocks, "block_size": SIM_BLOCK}

        def add_request(self, req):
            out = super().add_request(req)
            prompt = list(req.prompt_token_ids)
            hashes = chain_hashes(prompt, SIM_BLOCK)
            num_blocks = -(-(len(prompt) + req.params.max_tokens) // SIM_BLOCK)
            # as vLLM: a prompt wholly cached still computes its last token
            hits = self.cache.admit(hashes[: (len(prompt) - 1) // SIM_BLOCK], num_blocks)
            if hits is not None:
                self.requests[req.request_id] = _Cached(hashes, prompt, hits, num_blocks)
                self.by_id[req.request_id].prefill_left -= hits * SIM_BLOCK
            return out

        def step(self):
            outs = super().step()
            for out in outs:
                state = self.requests.get(out.request_id)
                if state is None:
                    continue
                if not state.is_registered:  # its prefill is done: its first token came
                    state.held = self.cache.register(state.hashes, state.prompt, state.hits)
                    state.is_registered = True
                if out.finish_reason is not None:
                    self._release(out.request_id)
            return outs

        def abort_requests(self, request_ids) -> None:
            request_ids = list(request_ids)
            super().abort_requests(request_ids)
            for rid in request_ids:
                self._release(rid)

        def _release(self, request_id: str) -> None:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.cache.release(state.held, state.num_blocks)

    return CachingSimCore
