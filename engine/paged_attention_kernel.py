"""A C++/OpenMP paged-attention decode kernel for CPUs: keys and values read in place, in one pass per row.

`torch.ops.dpserve_kernels.paged_decode(query, k_cache, v_cache, block_tables, lengths,
block_size, scale, window)` computes what paged_attention.paged_decode computes (that
pure-PyTorch function stays the fallback and the reference the tests compare against):
one query token per sequence against its first lengths[b] cached positions (the last
`window` of them when window > 0), looked up through the block table, grouped-query
heads sharing their KV head's loads, float accumulation, for float32, bfloat16 and
float16 caches. Work is split over rows with ATen's parallel_for (the rank's
intra-op threads); a row reads each cached position's keys (all KV heads) once, in order.

Registered with the dispatcher (TORCH_LIBRARY) and given a fake (meta) function, so
Dynamo traces it as one op and inductor calls it from the compiled decode block
without a graph break. Built once per machine by torch.utils.cpp_extension, under the
compile cache dir (compiled.compile_cache_dir) in a folder keyed by torch, the
compiler and the CPU flags (compile_cache.machine_key: it is built with
-march=native), so a restarted rank loads the built library. Without a C++ compiler
or ninja, or if the build fails, load() says so once in the log and returns False:
callers keep the pure-PyTorch path. Must never allocate KV memory nor decide what runs.

On by default where it builds; DPSERVE_CPU_ATTENTION_KERNEL=0 keeps the PyTorch path.
With its AVX-512 paths (fifth round) one call is 3-4x inductor's code for the PyTorch
attention (batch 8 x 128 positions, bf16: 133 vs 394-603 us), and a decode step of 16
rows 15-20% faster (RESULTS, issue 26 fifth round); its AVX2 paths (8 lanes, for CPUs without
AVX-512) do the same there (sixth round). Its first start on a machine
builds it (~25 s here); later starts load the built library. Head sizes 32, 64 and 128 take a
faster AVX-512 path (16 positions' scores a tree of adds, bf16 keys by vdpbf16ps where the CPU has
AVX512_BF16, value accumulators in registers): 208 -> 46 us a call at 16 rows x 100 positions in
bf16 on 2 threads (RESULTS, issue 26 eleventh round). The source is paged_attention_kernel.cpp.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LIBRARY = "dpserve_kernels"
NAME = "dpserve_paged_attention"  # the built library's file name
# Set to 0 to keep decode attention on the pure-PyTorch path (the kernel is on by default).
ENV_SWITCH = "DPSERVE_CPU_ATTENTION_KERNEL"

# The C++ source beside this file (package data), built as it is read.
SOURCE = (Path(__file__).parent / "paged_attention_kernel.cpp").read_text(encoding="utf-8")

_lock = threading.Lock()
_state: dict[str, bool] = {}  # "loaded": the op is registered and usable (set once per process)


def loaded() -> bool:
    """Whether the kernel is registered in this process (load() succeeded)."""
    return _state.get("loaded", False)


def load(cache_dir: str | None = None) -> bool:
    """Build (once per machine) and register the kernel; False, logged once, when it cannot be had."""
    with _lock:
        if "loaded" in _state:
            return _state["loaded"]
        _state["loaded"] = _load(cache_dir)
        return _state["loaded"]


def _load(cache_dir: str | None) -> bool:
    from dpserve.engine.compile_cache import load_op_library

    registered = hasattr(getattr(torch.ops, LIBRARY), "paged_decode")
    if not load_op_library(NAME, SOURCE, ENV_SWITCH, "decode attention stays on the pure-PyTorch path", cache_dir,
                           registered):
        return False
    if not registered:
        _register_fake()
    return True


def build_and_register(directory: str, march: tuple[str, ...] = ("-march=native",)) -> None:
    """Build SOURCE in `directory` (unless built there already) and register the op in this process.
    `march` picks the vector paths: the engine's native build; the tests also build the paths this
    CPU would not take (e.g. "-mno-avx512f": the AVX2 code on an AVX-512 machine)."""
    from dpserve.engine.compile_cache import build_library

    build_library(directory, NAME, SOURCE, march)
    _register_fake()


def _register_fake() -> None:
    @torch.library.register_fake(f"{LIBRARY}::paged_decode")
    def _(query, k_cache, v_cache, block_tables, lengths, block_size, scale, window):
        return query.new_empty(query.shape)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 lengths: torch.Tensor, block_size: int, scale: float, window: int | None = None) -> torch.Tensor:
    """The kernel's [B, H, D] (load() must have succeeded); paged_attention.paged_decode's arguments."""
    return torch.ops.dpserve_kernels.paged_decode(query, k_cache, v_cache, block_tables, lengths, block_size,
                                                  float(scale), -1 if window is None else int(window))
