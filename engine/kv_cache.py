"""Paged KV memory of one rank: fixed-size blocks, a free list, and the budget that sizes them.

Owns which block belongs to whom (BlockManager) and the tensors that hold
them (KVCache). It must never decide who runs: the scheduler asks for
blocks and chooses whom to preempt when there are none.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

DEFAULT_BLOCK_SIZE = 16
# CPU budget when none is configured: this share of the memory available at
# start, split between the node's local ranks, and never more than this cap
# (vLLM's CPU backend reserves a fixed 4 GiB by default).
CPU_AUTO_FRACTION = 0.4
CPU_AUTO_CAP_BYTES = 4 << 30


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


def available_memory_bytes() -> int:
    """MemAvailable (and the cgroup's limit, when lower): what a new allocation may take."""
    import psutil

    avail = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            raw = f.read().strip()
        if raw != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                avail = min(avail, int(raw) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return max(0, avail)


def plan_num_blocks(
    shape: KVShape,
    device: torch.device,
    *,
    block_size: int,
    budget_bytes: int,
    gpu_memory_utilization: float,
    num_local_ranks: int,
    max_useful_tokens: int,
) -> tuple[int, int]:
    """(number of blocks, the budget in bytes they came from).

    budget_bytes > 0 is taken as given. Otherwise on CUDA: the share
    gpu_memory_utilization of the device's memory, less what is in use after
    the model loaded (weights, torch's workspace), as vLLM sizes its cache;
    on CPU: CPU_AUTO_FRACTION of available memory split between the node's
    ranks, capped at CPU_AUTO_CAP_BYTES. Never more blocks than
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
            share = available_memory_bytes() * CPU_AUTO_FRACTION / max(1, num_local_ranks)
            budget_bytes = int(min(share, CPU_AUTO_CAP_BYTES))
    num_blocks = min(budget_bytes // per_block, math.ceil(max_useful_tokens / block_size))
    return int(num_blocks), int(budget_bytes)


class BlockManager:
    """The free list of KV blocks.

    Invariant: every block id in [0, num_blocks) is either in `free` or in
    exactly one running sequence's block_table; never both, never twice.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc, as a 0..1 fraction)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks a sequence lacks to hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_missing(block_table, num_tokens) <= len(self.free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend block_table in place to hold num_tokens tokens (the caller checked can_grow)."""
        for _ in range(self.num_missing(block_table, num_tokens)):
            block_table.append(self.free.pop())

    def release(self, block_table: list[int]) -> None:
        self.free.extend(reversed(block_table))
        block_table.clear()


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
