"""The decode forward compiled by torch.compile (inductor's C++/OpenMP code on CPU), warmed at start.

Owns when a step may take the compiled path (decodes only), the compile
itself, its warm-up and its on-disk cache (inductor's, under the cache dir,
so a restarted rank loads the compiled code instead of building it again).
Must never decide what runs nor allocate KV memory: it runs the model over a
step the model runner packed, with attention in place (paged_attention.py).

The CPU analogue of vLLM's CUDA-graph capture sizes: there are no graphs to
replay on a CPU, so one compiled block with a symbolic batch size and context
width serves every decode step (inductor specializes sizes 0 and 1, so the model
runner pads a batch of one to two rows): one compile, at start. Prefill chunks stay eager:
their time is in the matmuls and SDPA (benchmarks/step_profile.py: Python is
3-4% of a 512-token chunk), and their many shapes would each cost a compile.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch
import torch.fx.experimental._config
from dpserve.engine import hf_compat, paged_attention_kernel
from dpserve.engine.compile_cache import settle_vec_isa

log = logging.getLogger(__name__)

# Models at least this large compile their decode by default (see use_compiled_decode).
COMPILE_MIN_PARAMS = 100_000_000
# Warm-up batch size: 2 (the symbolic code for every batch; the runner pads a batch of one to two rows,
# since inductor would specialize batch 1 and compile it separately: ~half the start cost).
WARM_BATCH_SIZES = (2,)


def compile_cache_dir() -> str:
    """Inductor's cache: $TORCHINDUCTOR_CACHE_DIR when set, else under dpserve's cache dir
    (not torch's default under /tmp, which a reboot or systemd's PrivateTmp empties).
    torch writes its default into the environment once it has used it, so that value
    does not count as set."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dpserve", "inductor")


def use_compiled_decode(enforce_eager: bool | None, loaded) -> bool:
    """Whether a rank runs its decode steps compiled: --enforce-eager (vLLM's flag) says no,
    --no-enforce-eager yes; unset, a CUDA rank replays CUDA graphs (cuda_graphs.py, vLLM's
    default) and a CPU rank compiles a model of COMPILE_MIN_PARAMS or more.

    Below that (the tiny test and demo models) a CPU step is a few milliseconds, and the
    compile would cost more start time than a day of Python overhead. A CPU host without
    a C++ compiler cannot compile."""
    if enforce_eager is not None:
        return not enforce_eager and _can_compile(loaded.device)
    if loaded.device.type == "cuda":
        return True
    num_params = sum(p.numel() for p in loaded.model.parameters())
    return num_params >= COMPILE_MIN_PARAMS and _can_compile(loaded.device)


def _can_compile(device: torch.device) -> bool:
    if device.type == "cuda":
        return True  # graphs are captured, not compiled
    if device.type != "cpu":
        return False
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        log.warning("no C++ compiler on PATH: the decode forward runs eagerly")
        return False
    return True


def bind_kv(model: torch.nn.Module, kv) -> None:
    """Each attention module reads its layer's cache from itself on the compiled and graph paths
    (attention.py): one compiled block, or one captured call, serves every layer."""
    if getattr(model, "_dpserve_bound_kv", None) is kv:
        return
    for module in hf_compat.attention_modules(model):
        layer = hf_compat.layer_index(module)
        module.dpserve_k_cache, module.dpserve_v_cache = kv.keys[layer], kv.values[layer]
    model._dpserve_bound_kv = kv


class CompiledDecode:
    """The model over a decode-only step, its decoder blocks compiled (regional compilation).

    Every block of a model runs the same code on its own weights, so one trace
    and one compile serve all of them (torch.compile's inlining of nn.Modules
    makes weights and the per-layer caches inputs, not constants); the model's
    outer forward (embedding, rotary tables, final norm, lm_head) stays eager.
    Compiling whole models instead cost minutes of tracing at start on a
    30-layer model. Eager steps must run under eager() (the blocks stay
    compiled in the shared model object)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cache_dir = compile_cache_dir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        # inductor's vector-ISA probe, ~3 s of every start: once per machine (compile_cache.py)
        self.vec_isa = settle_vec_isa(cache_dir)
        # attention's C++ kernel when DPSERVE_CPU_ATTENTION_KERNEL=1 (built once per machine); else PyTorch's
        self.attention_kernel = paged_attention_kernel.load(cache_dir)
        # Without duck sizing, a batch that happens to equal the context width (or any other
        # size) is no reason for a graph of its own: one graph per batch-size class, as warmed.
        torch.fx.experimental._config.use_duck_shape = False
        self.model = model
        self.attention = hf_compat.attention_modules(model)
        blocks = hf_compat.decoder_layers(model)
        if not blocks or not self.attention:
            raise RuntimeError(f"{type(model).__name__}: no repeated decoder blocks with attention modules found")
        for block in blocks:
            block.compile(dynamic=True)
        self.warm_s = 0.0

    def bind_kv(self, kv) -> None:
        bind_kv(self.model, kv)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of every row."""
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=0)
        return out.logits[0]

    def warm(self, run_dummy) -> float:
        """Compile (or load from the cache) by running `run_dummy(batch)` at WARM_BATCH_SIZES; seconds taken."""
        start = time.perf_counter()
        for batch in WARM_BATCH_SIZES:
            run_dummy(batch)
        self.warm_s = time.perf_counter() - start
        log.info("compiled decode ready in %.1f s (cache %s, vector ISA probe: %s, attention: %s)", self.warm_s,
                 os.environ["TORCHINDUCTOR_CACHE_DIR"], self.vec_isa,
                 "C++ kernel" if self.attention_kernel else "PyTorch")
        return self.warm_s


def eager():
    """A context in which compiled blocks run their eager code (prefill and mixed steps)."""
    return torch.compiler.set_stance("force_eager")
