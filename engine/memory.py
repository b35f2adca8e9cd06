"""How much host memory a rank's KV cache may take when no budget is configured.

One rule for every engine (the native engine's kv_cache.py and the vLLM
backend both size a CPU cache by it). Plain Python: it must never import
torch or vllm, so the vLLM backend's configuration stays testable without them.
"""

from __future__ import annotations

# This share of the memory available at start, split between the node's local
# ranks, and never more than this cap (vLLM's CPU backend reserves a fixed
# 4 GiB by default).
CPU_AUTO_FRACTION = 0.4
CPU_AUTO_CAP_BYTES = 4 << 30


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


def cpu_kv_budget_bytes(available: int, num_local_ranks: int) -> int:
    """One rank's CPU KV budget: CPU_AUTO_FRACTION of `available` split between
    the node's ranks, capped at CPU_AUTO_CAP_BYTES."""
    return int(min(available * CPU_AUTO_FRACTION / max(1, num_local_ranks), CPU_AUTO_CAP_BYTES))
