"""The decode forward compiled by torch.compile (inductor's C++/OpenMP code on CPU), warmed at start.

Owns the compile itself, its warm-up and its on-disk cache (the block compiled ahead of time
and saved whole, compiled_artifact.py, beside inductor's cache under the cache
dir: a restarted rank loads it without tracing or building it again).
Must never decide what runs nor allocate KV memory: it runs the model over a
step the model runner packed, with attention in place (paged_attention.py).

The CPU analogue of vLLM's CUDA-graph capture sizes: there are no graphs to
replay on a CPU, so one compiled block with a symbolic batch size and context
width serves every decode step (inductor specializes sizes 0 and 1, so the model
runner pads a batch of one to two rows): one compile, at start. A prompt's tokens run through it
as rows of their own when they attend to little (model_runner.py decides); long chunks stay eager,
where SDPA attends far faster than rows one by one and Python is 3-4% of a 512-token chunk.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Callable

import torch
import torch.fx.experimental._config
from dpserve.engine import compiled_artifact, cpu_linear, hf_compat, paged_attention_kernel
from dpserve.engine.attention import DECODE_KWARG, DecodeStep
from dpserve.engine.compile_cache import settle_vec_isa

log = logging.getLogger(__name__)

# Models at least this large compile their decode by default (see use_compiled_decode).
COMPILE_MIN_PARAMS = 100_000_000
# "0": skip the saved ahead-of-time block and compile through torch.compile at every start
# (Dynamo traces, inductor's cache serves the code): the third round's path, for comparison.
AOT_SWITCH = "DPSERVE_COMPILE_AOT"
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
    and one compile serve all of them (the block is an argument of the compiled
    function: weights and per-layer caches are its inputs, not constants); the
    model's outer forward (embedding, rotary tables, final norm, lm_head) stays
    eager. Compiling whole models instead cost minutes of tracing at start on a
    30-layer model. The block is compiled ahead of time and saved whole
    (compiled_artifact.py): a restarted rank loads it without Dynamo. Each block's
    forward dispatches: the compiled code for a step that carries the decode
    keyword argument (attention.DECODE_KWARG), its own eager forward for every
    other (prefill and mixed steps, generate())."""

    def __init__(self, model: torch.nn.Module, block_size: int) -> None:
        cache_dir = compile_cache_dir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        # inductor's vector-ISA probe, ~3 s of every start: once per machine (compile_cache.py)
        self.vec_isa = settle_vec_isa(cache_dir)
        # attention's C++ kernel (built once per machine) unless DPSERVE_CPU_ATTENTION_KERNEL=0; else PyTorch's
        self.attention_kernel = paged_attention_kernel.load(cache_dir)
        # Without duck sizing, a batch that happens to equal the context width (or any other
        # size) is no reason for a graph of its own: one graph per batch-size class, as warmed.
        torch.fx.experimental._config.use_duck_shape = False
        self.model = model
        self.block_size = block_size
        # q/k/v and gate/up as one GEMM each in the compiled code (packed CPU linears only)
        self.fused_groups = cpu_linear.fuse_groups(model)
        self.attention = hf_compat.attention_modules(model)
        self.blocks = hf_compat.decoder_layers(model)
        if not self.blocks or not self.attention:
            raise RuntimeError(f"{type(model).__name__}: no repeated decoder blocks with attention modules found")
        dtype = next(model.parameters()).dtype
        self.path = compiled_artifact.artifact_path(cache_dir, model, self.blocks[0], dtype, block_size,
                                                    self.attention_kernel, self.vec_isa)
        self.fn = None  # the compiled run_block; None: every block runs eagerly
        self.checked = False  # the compiled fn checks its own guards (torch.compile) or we do (AOT)
        self._guards_ok = False  # this step's inputs passed the AOT function's guards (checked at block 0)
        self._warned = False
        self.source = ""
        self.on_block: Callable[[], None] | None = None  # set for one step's forward by __call__
        for block in self.blocks:
            block.forward = functools.partial(self._block_forward, block)
        self.warm_s = 0.0

    def bind_kv(self, kv) -> None:
        bind_kv(self.model, kv)

    def step(self, slots: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor) -> DecodeStep:
        return DecodeStep(slots, block_tables, lengths, self.block_size, self.attention_kernel)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: DecodeStep,
                 keep: torch.Tensor | None = None, on_block: Callable[[], None] | None = None) -> torch.Tensor:
        """Logits [B, vocab] of every row, or of the rows `keep` names, in its order."""
        self.on_block = on_block
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             logits_to_keep=0 if keep is None else keep, **{DECODE_KWARG: step})
        finally:
            self.on_block = None
        return out.logits[0]

    def _block_forward(self, block: torch.nn.Module, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self._run_block(block, hidden_states, **kwargs)
        if self.on_block is not None:  # the step's progress (and its yield check) after every block
            self.on_block()
        return out

    def _run_block(self, block: torch.nn.Module, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.fn is None or kwargs.get(DECODE_KWARG) is None:
            return type(block).forward(block, hidden_states, **kwargs)
        if self.checked:
            return self.fn(block, hidden_states, kwargs)
        if block is self.blocks[0]:  # every block of a step has the same shapes: its guards once a step
            self._guards_ok = self.fn.guard_check(block, hidden_states, kwargs)
            if not self._guards_ok and not self._warned:
                self._warned = True
                log.warning("decode steps outside the compiled code's guards run eagerly (said once): %s",
                            _guard_failure(self.fn, block, hidden_states, kwargs))
        if not self._guards_ok:
            return type(block).forward(block, hidden_states, **kwargs)
        return self.fn.fn(block, hidden_states, kwargs)

    def warm(self, run_dummy) -> float:
        """Load the saved block, or compile and save it, then run `run_dummy(batch)` at WARM_BATCH_SIZES
        through it; seconds taken."""
        start = time.perf_counter()
        if os.environ.get(AOT_SWITCH, "1") == "0":
            self._fall_back(f"{AOT_SWITCH}=0")
        else:
            with torch.inference_mode():
                self.fn = compiled_artifact.load(self.path)
            self.source = "loaded"
            if self.fn is None:
                self._compile(run_dummy)
        fits = self._run_warm(run_dummy)
        if not fits and self.source == "loaded":  # the saved block does not fit after all
            log.warning("the saved compiled decode %s refused the warm-up step: compiling again", self.path)
            compiled_artifact.discard(self.path)
            self.fn = None
            self._compile(run_dummy)
            fits = self._run_warm(run_dummy)
        if not fits:
            compiled_artifact.discard(self.path)
            self._fall_back("its guards refused the warm-up step")
            self._run_warm(run_dummy)
        self.warm_s = time.perf_counter() - start
        log.info("compiled decode ready in %.1f s (%s; cache %s, vector ISA probe: %s, attention: %s)", self.warm_s,
                 self.source, self.path, self.vec_isa, "C++ kernel" if self.attention_kernel else "PyTorch")
        return self.warm_s

    def _run_warm(self, run_dummy) -> bool:
        """The warm-up steps through the compiled code; whether its guards let them in."""
        for batch in WARM_BATCH_SIZES:
            run_dummy(batch)
        return self.checked or self._guards_ok

    def _compile(self, run_dummy) -> None:
        """Compile run_block ahead of time on the first block's inputs of an eager dummy step, and save it."""
        example = []
        hook = self.blocks[0].register_forward_pre_hook(
            lambda mod, args, kwargs: example.append((mod, args[0], dict(kwargs))) if not example else None,
            with_kwargs=True)
        try:
            run_dummy(WARM_BATCH_SIZES[0])
        finally:
            hook.remove()
        try:
            with torch.inference_mode():
                self.fn = compiled_artifact.compile_block(example[0])
        except Exception as exc:  # noqa: BLE001 - AOT compilation is young in torch; plain compile still works
            self._fall_back(f"ahead-of-time compile failed: {type(exc).__name__}: {exc}")
            return
        self.source = "compiled"
        try:
            compiled_artifact.save(self.fn, self.path)
            self.source = "compiled and saved"
        except Exception as exc:  # noqa: BLE001 - unsaved, the next start compiles again
            log.warning("compiled decode not saved to %s (%s: %s): the next start compiles again", self.path,
                        type(exc).__name__, exc)

    def _fall_back(self, why: str) -> None:
        """torch.compile's own path (Dynamo at every start, inductor's cache): slower to start, same code."""
        log.warning("compiled decode through torch.compile at every start: %s", why)
        self.fn = torch.compile(compiled_artifact.run_block, dynamic=True, options=compiled_artifact.PASSES)
        self.checked = True
        self.source = "torch.compile"


def _guard_failure(fn, *args) -> str:
    try:
        return str(fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(*args)).verbose_code_parts)
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return f"({type(exc).__name__})"


def eager():
    """A context in which compiled blocks run their eager code (prefill and mixed steps)."""
    return torch.compiler.set_stance("force_eager")
