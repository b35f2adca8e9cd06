"""Which rank probably holds which prompt prefix: the API server's side of cache-aware routing.

Approximate, as SGLang's router: a rank is assumed to hold the prefixes of
the prompts it was sent (its engine's prefix cache keeps them until memory
pressure evicts them), so no engine reports its cache and nothing on the
request path waits for anyone. Exact knowledge (ranks publishing every block
they cache, as llm-d consumes vLLM's KV events) would cost a message per
cached block per rank, fanned out to every API server: at 1,024 ranks that
is more traffic than the load tables, for routing that differs only after
an eviction, which the load term of the score absorbs anyway.

A prompt is cut into blocks of BLOCK tokens; block k's key is a hash of the
key of block k-1 and its token ids (a chain: equal keys mean equal prefixes,
up to a 64-bit collision). Keys are stable across processes (hash() of int
tuples is not salted), so API servers could share what they routed. Entries
live in an LRU of bounded size; a rank that restarts or dies forgets
everything at once (its generation changes; stale entries are skipped and
dropped as they are met).
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 64  # tokens per routing block (coarser than the engine's KV blocks: cheaper, same affinity)
MAX_ENTRIES = 1 << 18  # block keys remembered (16 M prompt tokens of history at 64 tokens each)
MAX_BLOCKS = 128  # a prompt's first 8,192 tokens decide; beyond, affinity is settled


_CUTS: dict[int, list[slice]] = {}  # block size -> the slices of blocks 0..MAX_BLOCKS-1


def block_key(parent: int, tokens: tuple) -> int:
    """The key of a block of `tokens` after the block keyed `parent` (0 at the root)."""
    # hash() of a tuple of ints is not salted (only str and bytes are), so keys
    # agree across API servers; a 64-bit collision only costs a cache miss
    return hash((parent, hash(tokens)))


def chain_keys(prompt: list[int], block: int = BLOCK) -> list[int]:
    """The keys of the prompt's full blocks, in order (at most MAX_BLOCKS): block_key chained.

    Hashed once per request, in one pass of C loops: the ids copied into a
    tuple once, cut into block tuples and hashed by map(); only the chaining
    of two ints per block runs in Python (36 us at 4,096 tokens where the
    tuple-unpacking loop took 41; reading 4,096 ints at all, sum(), takes ~16).
    """
    n = min(len(prompt) // block, MAX_BLOCKS)
    if n <= 0:
        return []
    cuts = _CUTS.get(block)
    if cuts is None:
        cuts = _CUTS[block] = [slice(i * block, (i + 1) * block) for i in range(MAX_BLOCKS)]
    ids = tuple(prompt) if len(prompt) < (n + 1) * block else tuple(prompt[: n * block])
    keys: list[int] = []
    append = keys.append
    parent = 0
    for h in map(hash, map(ids.__getitem__, cuts[:n])):
        parent = hash((parent, h))
        append(parent)
    return keys


def leading_holders(entries: dict[int, dict[int, int]], keys: list[int]) -> list[dict[int, int]]:
    """The holders of each leading block of `keys`, up to the first block nobody holds
    (one dict probe per block: KVIndex.match; routing reads holder_steps)."""
    out = []
    for key in keys:
        holders = entries.get(key)
        if not holders:
            break
        out.append(holders)
    return out


def holder_steps(entries: dict[int, dict[int, int]], keys: list[int], rank: int, gen: int) -> list[tuple[int, dict[int, int]]]:
    """The holders of the prompt's leading blocks where they change, deepest first: [(depth, holders)],
    down to the first set that holds `rank` (at generation `gen`), or to the root.

    Holders are prefix-closed (a rank holding block d holds every block before
    it), so the sets shrink with depth and an equal count is the same set:
    binary searches find the deepest held block and each depth where the
    count grows, O(log n) probes each, not one probe per block (what
    Router._cache_pick reads: only sets deeper than `rank`'s can beat it).
    """
    get = entries.get
    lo, hi = 0, len(keys)
    while lo < hi:  # the deepest block anybody holds
        mid = (lo + hi + 1) >> 1
        if get(keys[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    steps = []
    depth = lo
    while depth:
        holders = entries[keys[depth - 1]]
        steps.append((depth, holders))
        if holders.get(rank, -1) == gen:
            break
        size, lo, hi = len(holders), 0, depth - 1
        while lo < hi:  # the deepest block held by more ranks than this one
            mid = (lo + hi + 1) >> 1
            if len(get(keys[mid - 1]) or ()) > size:
                lo = mid
            else:
                hi = mid - 1
        depth = lo
    return steps


class PrefixIndex:
    """block key -> {rank: generation} for the ranks that were sent a prompt with that prefix.

    Invariant: an entry maps to the ranks whose generation at insertion is
    still their generation, or to stale ranks that `match` drops when met.
    """

    def __init__(self, size: int, max_entries: int = MAX_ENTRIES) -> None:
        self.generation = [0] * size
        self.max_entries = max_entries
        self.entries: OrderedDict[int, dict[int, int]] = OrderedDict()

    def forget_rank(self, rank: int) -> None:
        """The rank restarted or died: its cache is gone."""
        self.generation[rank] += 1

    def add(self, keys: list[int], rank: int) -> None:
        """`rank` was sent a prompt with these block keys."""
        gen = self.generation[rank]
        entries = self.entries
        for key in keys:
            holders = entries.get(key)
            if holders is None:
                entries[key] = {rank: gen}
            else:
                holders[rank] = gen
                entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def match(self, keys: list[int]) -> dict[int, int]:
        """rank -> how many leading blocks of `keys` it holds, for ranks holding at least one."""
        found: dict[int, int] = {}
        generation, entries = self.generation, self.entries
        for depth, key in enumerate(keys, 1):
            holders = entries.get(key)
            if not holders:
                break
            live = False
            for rank, gen in list(holders.items()):
                if gen != generation[rank]:
                    del holders[rank]
                elif found.get(rank, 0) == depth - 1:  # it held every block before this one
                    found[rank] = depth
                    live = True
            if not live:
                break
        return found
