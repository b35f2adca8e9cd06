"""Configuration of one engine rank, as handed to the engine process.

A plain msgspec Struct so the supervisor can pass it to a child as JSON.
Must never import torch: the daemons build it without loading a model.
"""

from __future__ import annotations

import json
import os

import msgspec

DTYPES = ("auto", "float32", "bfloat16", "float16")


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str  # local Hugging Face model directory
    rank: int = 0
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda:<rank*tp> when CUDA is present, else cpu
    max_num_seqs: int = 256
    max_model_len: int = 0  # 0: from the model's config
    max_num_batched_tokens: int = 8192  # prompt tokens prefilled per step at most
    seed: int = 0


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
