"""Which rank probably holds which prompt prefix: the API server's side of cache-aware routing.

Approximate, as SGLang's router: a rank is assumed to hold the prefixes of
the prompts it was sent (its engine's prefix cache keeps them until memory
pressure evicts them), so no engine reports its cache and nothing on the
request path waits for anyone. It never learns of an eviction, nor of what
reached a rank by another path: where ranks publish KV events, the router
reads kv_index.py's exact index instead, keyed the same way. Both are
searched by cheapest_holder below.

A prompt is cut into blocks of BLOCK tokens; block k's key is a hash of the
key of block k-1 and its token ids (a chain: equal keys mean equal prefixes,
up to a 64-bit collision). Keys are stable across processes (hash() of int
tuples is not salted), so API servers could share what they routed. They are
computed in C (_prefix_keys.c, which reproduces CPython's tuple and int hashes)
where the extension was built, else by py_chain_keys: the same keys. Entries
live in an LRU of bounded size; a rank that restarts or dies forgets
everything at once (its generation changes; stale entries are skipped and
dropped as they are met).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from dpserve.engine.kv_events import ROUTING_BLOCK as BLOCK  # tokens per routing block: the ranks' events key the same
from dpserve.engine.kv_events import block_key  # noqa: F401  (the definition every key here must match)

MAX_ENTRIES = 1 << 18  # block keys remembered (16 M prompt tokens of history at 64 tokens each)
MAX_BLOCKS = 128  # a prompt's first 8,192 tokens decide; beyond, affinity is settled


_CUTS: dict[int, list[slice]] = {}  # block size -> the slices of blocks 0..MAX_BLOCKS-1


def py_chain_keys(prompt: list[int], block: int = BLOCK, parent: int = 0, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """The keys of the prompt's full blocks, in order (at most max_blocks): block_key chained
    from `parent`.

    The pure-Python fallback of _prefix_keys.c (an install without a compiler),
    and the definition that C code must match: the ids copied into a tuple
    once, cut into block tuples and hashed by map(); only the chaining of two
    ints per block runs in Python (~40 us at 4,096 tokens, ~2x reading the ids).
    """
    n = min(len(prompt) // block, max_blocks)
    if n <= 0:
        return []
    cuts = _CUTS.get(block)
    if cuts is None:
        cuts = _CUTS[block] = [slice(i * block, (i + 1) * block) for i in range(MAX_BLOCKS)]
    if n > len(cuts):
        cuts = [slice(i * block, (i + 1) * block) for i in range(n)]
    ids = tuple(prompt) if len(prompt) < (n + 1) * block else tuple(prompt[: n * block])
    keys: list[int] = []
    append = keys.append
    for h in map(hash, map(ids.__getitem__, cuts[:n])):
        parent = hash((parent, h))
        append(parent)
    return keys


try:  # the same keys, computed in C (~5x faster: one pass over the ids' ints, in place)
    from dpserve.daemons.api._prefix_keys import chain_keys as _c_chain_keys
except ImportError:  # built without a compiler (the extension is optional): same keys, slower
    _c_chain_keys = None
KEYS_IMPL = "c" if _c_chain_keys is not None else "python"  # which one chain_keys runs


def chain_keys(prompt: list[int], block: int = BLOCK) -> list[int]:
    """The keys of the prompt's full blocks, in order (at most MAX_BLOCKS): block_key chained,
    in C when the extension was built (KEYS_IMPL), else py_chain_keys. The same keys either way."""
    if _c_chain_keys is not None:
        return _c_chain_keys(prompt, block, MAX_BLOCKS)
    return py_chain_keys(prompt, block)


def leading_holders(entries: dict[int, dict[int, int]], keys: list[int]) -> list[dict[int, int]]:
    """The holders of each leading block of `keys`, up to the first block nobody holds
    (one dict probe per block: KVIndex.match; routing reads cheapest_holder)."""
    out = []
    for key in keys:
        holders = entries.get(key)
        if not holders:
            break
        out.append(holders)
    return out


def deepest_held(entries: dict[int, dict[int, int]], keys: list[int]) -> int:
    """How many leading blocks of `keys` anybody holds. Holders are prefix-closed (a rank
    holding block d holds every block before it), so a binary search: the first and the
    last block are probed first (a prompt nobody holds costs one probe, a later turn of a
    held conversation two). `in` does not read the holders: a big index is cold, and each
    object a probe touches is a cache miss (~0.15 us here)."""
    n = len(keys)
    if not n or keys[0] not in entries:
        return 0
    if keys[-1] in entries:
        return n
    lo, hi = 1, n - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if keys[mid - 1] in entries:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _wider(get, keys: list[int], size: int, floor: int, depth: int) -> int:
    """The deepest depth in [floor, depth) whose block more than `size` ranks hold (the sets
    shrink with depth: a binary search), or floor - 1 when none; `floor` is probed first."""
    if floor >= depth or len(get(keys[floor - 1]) or ()) <= size:
        return floor - 1
    lo, hi = floor, depth - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if len(get(keys[mid - 1]) or ()) > size:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cheapest_holder(entries: dict[int, dict[int, int]], keys: list[int], best: int, scores: list, gen: list[int],
                    block: int, weight: float = 1.0) -> tuple[int, int]:
    """The rank for a prompt with these block keys, and how many leading blocks it holds: `best`
    (the lowest score among the candidates), or a rank holding a deeper prefix whose score less
    its credit is lower (ties: best, then the deeper rank). scores[rank]: None for no
    candidate; entries hold {rank: generation}, and a rank's stale entries are skipped.

    The credit of a rank holding `depth` blocks that k ranks hold: depth x `block` x
    max(1, weight / k). A prefix only one rank holds is worth `weight` load tokens a token
    (a copy elsewhere costs that prefill, and under eviction pressure the prefixes it
    evicts: below ~8 the hit rate collapses when the cluster is loaded, prefix_sim.py); a
    prefix every rank holds already has its copies, so load decides among them (with the
    full weight, a rank that lost a hot system prompt would idle until the others were
    weight x its length busier).

    Holders are prefix-closed, so the sets shrink with depth and an equal count is the same
    set. From the deepest held block down, a set is read only where the count grows (binary
    searches), and only down to the depth `floor` below which not even best (whose score is
    the lowest) could beat the cheapest holder found so far. A later turn of a conversation
    that one rank holds, best holding its shared system prompt only: four probes, not one per
    block nor a search down to the system prompt (the probes, not the arithmetic, cost here).
    """
    depth = deepest_held(entries, keys)
    get, n = entries.get, len(scores)
    best_gen, best_score = gen[best], scores[best]
    win, win_cost, win_depth, floor, seen = best, None, 0, 1, set()
    most = block * max(1.0, weight)  # the largest credit a block can earn (the floor's bound)
    while depth >= floor:
        holders = entries[keys[depth - 1]]
        credit = block * max(1.0, weight / len(holders))
        if holders.get(best, -1) == best_gen:  # best's own depth: nothing shallower can beat it
            return (best, depth) if win_cost is None or best_score - depth * credit <= win_cost else (win, win_depth)
        for rank, g in holders.items():
            if g != gen[rank] or rank in seen:
                continue
            seen.add(rank)  # its deepest level: its credit
            score = scores[rank] if 0 <= rank < n else None
            if score is None:
                continue  # not eligible here, down, or at its queue limit
            cost = score - depth * credit
            if win_cost is None or cost < win_cost:
                win, win_cost, win_depth = rank, cost, depth
        if win_cost is not None:  # (one depth of margin for the float division)
            floor = max(floor, math.ceil((best_score - win_cost) / most) - 1)
        depth = _wider(get, keys, len(holders), floor, depth)
    # best holds nothing at `floor` or deeper: at floor > 1 the winner costs less by floor's
    # definition; at floor 1, best holds nothing, and its score alone is its cost
    return (best, 0) if win_cost is None or best_score <= win_cost else (win, win_depth)


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
        # deepest first, so that a prompt's root is its most recently used block and the
        # LRU drops a chain from its tail: what is left stays prefix-closed, as the search needs
        for key in reversed(keys):
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
