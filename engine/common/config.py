"""Configuration of one engine rank, as handed to the engine process.

A plain msgspec Struct so the supervisor can pass it to a child as JSON.
Must never import torch: the daemons build it without loading a model.
"""

from __future__ import annotations

import json
import os

import msgspec

DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype's choices
# native: the engine of this package; vllm: vLLM's LLMEngine in the rank process (engine/backends/vllm/core.py)
NATIVE_ENGINE = "native"
ENGINES = (NATIVE_ENGINE, "vllm")
# --scheduling-policy (vLLM's): fcfs, arrival order; priority, the request's `priority` (lower first), then arrival
SCHEDULING_POLICIES = ("fcfs", "priority")
# Older spellings still accepted, for one release: --engine dpserve meant the native engine.
ENGINE_ALIASES = {"dpserve": NATIVE_ENGINE}


# Token budget per step when none is configured. On a GPU a step's cost
# barely grows with its tokens until thousands (weights are read once per
# step), so the budget is large; on a CPU every token costs its full share of
# FLOPs, so a smaller budget bounds the step time (and the stall a long prompt
# imposes on the streams beside it) at no cost in throughput.
GPU_MAX_NUM_BATCHED_TOKENS = 8192
CPU_MAX_NUM_BATCHED_TOKENS = 512
# While other sequences decode in the step, a prefill chunk is at most this
# many tokens on a CPU (measured: a 16-stream decode step costs about as much
# as 16-24 prefill tokens there, so the streams' step time stays within ~3x).
CPU_LONG_PREFILL_TOKEN_THRESHOLD = 32
# Tokens per KV-cache block of the native engine when none is configured
# (vLLM's engine picks its own).
DEFAULT_BLOCK_SIZE = 16


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str  # local Hugging Face model directory
    rank: int = 0
    local_rank: int = 0  # index among this node's ranks (device placement)
    engine: str = NATIVE_ENGINE  # one of ENGINES
    dtype: str = "auto"  # auto: bf16 where the device computes it fast (checkpoint's dtype if 16-bit), else float32
    device: str = "auto"  # auto: cuda:<rank mod visible GPUs> when CUDA is present, else cpu (loader.resolve_device)
    max_num_seqs: int = 256
    max_model_len: int = 0  # 0: from the model's config
    max_num_batched_tokens: int = 0  # tokens per step at most; 0: by device (see above)
    enable_chunked_prefill: bool = True  # split long prompts across steps
    enforce_eager: bool | None = None  # vLLM's: no compiled decode; None: engine/compiled.py's rule
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs (arrival order) or priority (the request's `priority`, lower first)
    long_prefill_token_threshold: int = 0  # chunk cap while others decode; 0: by device
    block_size: int = 0  # tokens per KV block; 0: the engine's own (native: DEFAULT_BLOCK_SIZE)
    kv_cache_memory_bytes: int = 0  # KV budget; 0: auto (CPU: share of available RAM)
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights + KV
    num_local_ranks: int = 1  # ranks on this node sharing its memory (for the auto budget)
    seed: int = 0
    # vLLM engine only (the CLI refuses them with the native engine)
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool | None = None  # None: the engine's default
    engine_args: dict[str, str] = {}  # --engine-arg KEY=VALUE: vLLM EngineArgs fields, values as typed


def resolve_token_budget(config: EngineConfig, device) -> tuple[int, int]:
    """(max_num_batched_tokens, long_prefill_token_threshold) for this device."""
    gpu = getattr(device, "type", str(device)) == "cuda"
    budget = config.max_num_batched_tokens or (GPU_MAX_NUM_BATCHED_TOKENS if gpu else CPU_MAX_NUM_BATCHED_TOKENS)
    threshold = config.long_prefill_token_threshold or (budget if gpu else CPU_LONG_PREFILL_TOKEN_THRESHOLD)
    return budget, min(threshold, budget)


def model_max_len(model_dir: str) -> int:
    """The model's own context length from config.json, without transformers."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def resolve_max_model_len(model_dir: str, requested: int) -> int:
    """requested if set (and within the model's limit), else the model's own limit."""
    limit = model_max_len(model_dir)
    if requested <= 0:
        return limit
    if requested > limit:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's max_position_embeddings {limit}"
        )
    return requested


class EngineProcessConfig(msgspec.Struct, kw_only=True):
    name: str
    engine: EngineConfig
    node_rank: int
    key_file: str
    coordinator_address: str
    supervisor_address: str
    fingerprint: str
    heartbeat_interval_s: float
    parent_pid: int
    log_level: str = "info"
    node_relay_address: str = ""  # LoadReports go to the node's relay (issue 30); '' = to the coordinator
    node_hop: bool = False  # --rank-links node: reach the API servers through the node's hops (needs the relay)
