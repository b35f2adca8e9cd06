"""Paged KV memory of one rank: fixed-size blocks, a free list, the prefix cache, and the budget that sizes them.

Owns which block belongs to whom and which full blocks are kept for reuse
(BlockManager), and the tensors that hold them (KVCache). It must never
decide who runs: the scheduler asks for blocks and chooses whom to preempt
when there are none.
"""

from __future__ import annotations

import hashlib
import math
import mmap
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch
from dpserve.engine.kv_events import KVEventLog
from dpserve.engine.memory import available_memory_bytes, cpu_kv_budget_bytes


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token costs in the cache: every layer's key and value for every KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def plan_num_blocks(
    shape: KVShape,
    device: torch.device,
    *,
    block_size: int,
    budget_bytes: int,
    gpu_memory_utilization: float,
    num_local_ranks: int,
    max_useful_tokens: int,
) -> int:
    """How many blocks this rank's KV cache gets.

    budget_bytes > 0 is taken as given. Otherwise on CUDA: the share
    gpu_memory_utilization of the device's memory, less what is in use after
    the model loaded (weights, torch's workspace), as vLLM sizes its cache;
    on CPU: engine/memory.py's rule, a share of available memory split between
    the node's ranks, capped. Never more blocks than
    max_useful_tokens (every slot full at max length) could fill.
    """
    per_block = shape.bytes_per_token * block_size
    if budget_bytes <= 0:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            in_use = total - free
            budget_bytes = int(total * gpu_memory_utilization) - in_use
            if budget_bytes <= 0:
                raise RuntimeError(
                    f"no room for a KV cache: {in_use / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is in use after "
                    f"loading the model, over --gpu-memory-utilization {gpu_memory_utilization}"
                )
        else:
            budget_bytes = cpu_kv_budget_bytes(available_memory_bytes(), num_local_ranks)
    num_blocks = min(budget_bytes // per_block, math.ceil(max_useful_tokens / block_size))
    return int(num_blocks)


def hash_block(parent: bytes, token_ids) -> bytes:
    """A full block's key: its tokens and, through parent (the previous block's
    key; b"" for the first), every token before it. Stable within the process
    (blake2b, not Python's salted hash); collisions are caught anyway by
    comparing the tokens on a hit."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """KV blocks: who uses them, and which full blocks are cached for reuse (prefix caching).

    A full block (block_size tokens, all computed) is registered under its
    hash-chain key (hash_block), so a later sequence whose token ids start
    the same way attaches it instead of computing it again, as in vLLM v1
    and nano-vllm. Blocks are reference-counted: one block may sit in the
    tables of several sequences (a shared prefix); only full, computed
    blocks are ever shared, so nobody writes into a shared block.

    Invariants, for every block id in [0, num_blocks):
    - ref_count[b] is the number of block tables (running sequences) that
      hold b; those tables hold it at most once each.
    - ref_count[b] == 0 iff b is in exactly one of `free` (no contents worth
      keeping; hash None) or `cached` (an LRU of evictable blocks that keep
      their contents and key, the least recently released first).
    - hash_to_block[h] == b iff block_hash[b] == h; block_tokens[b] holds the
      ids the key was made from. A block in use may be registered or not
      (duplicates of a registered block stay unregistered).
    Allocation takes `free` blocks first, then evicts the least recently used
    cached block (dropping its key). With caching off nothing is registered,
    so `cached` stays empty and this is a plain free list.

    With `events` (a KVEventLog), every registration is recorded as stored
    and every eviction of a registered block as removed, in the order they
    happen: what a consumer replays is exactly `hash_to_block`'s keys.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.cached: OrderedDict[int, None] = OrderedDict()  # evictable, least recently released first
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.num_evictions = 0
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses: truly free plus evictable cached ones (what admission may take)."""
        return len(self.free) + len(self.cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by sequences (vLLM's kv_cache_usage_perc, as a 0..1
        fraction): evictable cached blocks count as free, as in vLLM."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks a sequence lacks to hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_missing(block_table, num_tokens) <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend block_table in place to hold num_tokens tokens (the caller checked can_grow)."""
        for _ in range(self.num_missing(block_table, num_tokens)):
            block = self._allocate()
            self.ref_count[block] = 1
            block_table.append(block)

    def _allocate(self) -> int:
        if self.free:
            return self.free.pop()
        block, _ = self.cached.popitem(last=False)  # the least recently used cached block
        del self.hash_to_block[self.block_hash[block]]
        if self.events is not None:
            self.events.removed(self.block_hash[block])
        self.block_hash[block] = self.block_tokens[block] = None
        self.num_evictions += 1
        return block

    def release(self, block_table: list[int]) -> None:
        """Drop one reference to each block of the table (and clear it). A block nobody
        uses any more becomes evictable if registered, else free. The table's tail
        goes first, so it is evicted first: its head is the likelier shared prefix."""
        for block in reversed(block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self.cached[block] = None
                else:
                    self.free.append(block)
        block_table.clear()

    # ------------------------------------------------------------ prefix caching

    def extend_hashes(self, hashes: list[bytes], token_ids: list[int], num_tokens: int) -> None:
        """Append to `hashes` (a sequence's key chain) the keys of its full blocks within token_ids[:num_tokens]."""
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else b"", token_ids[i * bs : (i + 1) * bs]))

    def match(self, hashes: list[bytes], token_ids: list[int], max_blocks: int) -> list[int]:
        """The cached blocks that hold the leading blocks of this chain, at most max_blocks (stops at the first miss)."""
        hits: list[int] = []
        bs = self.block_size
        for i, key in enumerate(hashes[:max_blocks]):
            block = self.hash_to_block.get(key)
            if block is None or self.block_tokens[block] != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        return hits

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of these blocks sit in the evictable pool (attaching them takes them out of it)."""
        return sum(1 for b in blocks if self.ref_count[b] == 0)

    def attach(self, block_table: list[int], blocks: list[int]) -> None:
        """Append cached blocks to an empty block table, taking a reference to each."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.cached[block]
            self.ref_count[block] += 1
            block_table.append(block)

    def register(self, block: int, key: bytes, token_ids: list[int], parent: bytes | None = None) -> None:
        """Block is full and computed: make it findable under key (unless an equal block already is).
        `parent` is the previous block's key (None for a prompt's first), for the events."""
        if key in self.hash_to_block or self.block_hash[block] is not None:
            return
        self.hash_to_block[key] = block
        self.block_hash[block] = key
        self.block_tokens[block] = tuple(token_ids)
        if self.events is not None:
            self.events.stored(key, parent, token_ids)


class KVCache:
    """Keys and values of every layer, as [num_blocks * block_size, kv_heads, head_dim] slot arrays.

    Slot s = block * block_size + offset. Every slot always holds finite
    values, which masked attention relies on (a masked slot still enters the
    product with weight 0, and 0 x NaN is NaN): fresh memory is zero, a
    reused block holds what an earlier sequence computed. On CPU the arrays
    live in one anonymous mapping, whose pages the kernel hands out zeroed on
    first write: a large budget costs resident memory as the cache fills,
    not at start. On CUDA they are zeroed device memory.
    """

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        per_layer = (num_blocks * block_size, shape.num_kv_heads, shape.head_dim)
        count = 2 * shape.num_layers
        if device.type == "cpu":
            numel = math.prod(per_layer)
            itemsize = torch.empty((), dtype=shape.dtype).element_size()
            self._mapping = mmap.mmap(-1, max(1, count * numel * itemsize))
            flat = torch.frombuffer(self._mapping, dtype=shape.dtype, count=count * numel)
            arrays = [flat[i * numel : (i + 1) * numel].view(per_layer) for i in range(count)]
        else:
            arrays = [torch.zeros(per_layer, dtype=shape.dtype, device=device) for _ in range(count)]
        self.keys = arrays[: shape.num_layers]
        self.values = arrays[shape.num_layers :]

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.shape.bytes_per_token
