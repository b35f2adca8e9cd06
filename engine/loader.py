"""Loads a local Hugging Face causal LM onto this rank's device.

Owns device/dtype/thread choices and reading EOS ids from the model directory.
It must never download anything (local_files_only) nor keep gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

import torch

from .config import EngineConfig, resolve_max_model_len

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
    """"auto": cuda:<rank mod device count> when CUDA is usable, else cpu."""
    if spec != "auto":
        return torch.device(spec)
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA, float32 elsewhere (CPU half precision is slow)."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[spec]
    except KeyError:
        raise ValueError(f"unknown dtype {spec!r}; expected auto or one of {sorted(_DTYPES)}") from None


def configure_threads(device: torch.device) -> None:
    """One intra-op pool sized to the CPUs this process may actually use.

    OMP_NUM_THREADS wins when set (the supervisor may split cores between
    ranks). Otherwise torch's default (all physical cores of the machine)
    is capped by the affinity mask, so a pinned or cgroup-limited rank does
    not oversubscribe its cores.
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        torch.set_num_threads(int(env))
    elif device.type == "cpu" and hasattr(os, "sched_getaffinity"):
        torch.set_num_threads(max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)))))


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
    last_error: Exception | None = None
    for attn in ("sdpa", "eager"):  # eager: for architectures without an SDPA path
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation=attn, local_files_only=True, **placement
            )
            return model.to(device)
        except (ValueError, ImportError) as e:
            if "attn_implementation" not in str(e) and "scaled_dot_product_attention" not in str(e):
                raise  # not about attention: a real loading error
            last_error = e
    raise RuntimeError(f"cannot load {model_dir} with sdpa or eager attention") from last_error


def load_model(config: EngineConfig) -> LoadedModel:
    """Load config.model (a local directory) for inference on this rank."""
    model_dir = os.path.abspath(config.model)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    max_model_len = resolve_max_model_len(model_dir, config.max_model_len)
    device = resolve_device(config.device, config.rank)
    dtype = resolve_dtype(config.dtype, device)
    configure_threads(device)

    model = _from_pretrained(model_dir, dtype, device)
    model.eval()
    model.requires_grad_(False)
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
