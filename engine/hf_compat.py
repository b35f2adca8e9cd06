"""Every use of transformers beyond its documented API, in one place.

The native engine runs its paged attention inside transformers' own model
classes, which leans on a few things transformers does not promise. Each
lives here with the reason for it, and tests/unit/test_dependency_internals.py
checks each by name, so an upgrade that drops one fails there and not in
serving. Nothing else in dpserve may reach into transformers' internals.
transformers is imported lazily: importing it costs seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def register_attention(name: str, function: Callable) -> None:
    """Make `function` the attention of every model loaded with attn_implementation=name.

    AttentionInterface is public (transformers' "attention interface" guide)
    but young; what the engine relies on is that every attention layer of the
    supported architectures calls the registered function with
    (module, query, key, value, attention_mask, dropout=, scaling=,
    sliding_window=, softcap=, ...), query and key already rotated."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


def sdpa_attention(module: torch.nn.Module, query, key, value, attention_mask, dropout: float, scaling, **kwargs):
    """transformers' own SDPA attention (transformers.integrations.sdpa_attention, not
    a public module), for forwards outside an engine step (generate() in tests and
    tools), where the paged path has no step to read. Same arguments and result as
    a registered attention function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def layer_index(module: torch.nn.Module) -> int:
    """The layer number of the attention module that called the attention function:
    its `layer_idx` attribute, which transformers' attention modules set (0 .. layers-1,
    in order) for their own KV caches but do not document. The paged cache keeps one
    key and one value tensor per layer, found by this number."""
    return module.layer_idx


def is_attention_refusal(exc: BaseException) -> bool:
    """Whether from_pretrained refused the attention implementation (an architecture
    that does not route attention through the interface), not the model itself.
    transformers says so only in the ValueError's or ImportError's text."""
    text = str(exc)
    return isinstance(exc, (ValueError, ImportError)) and ("attn_implementation" in text or "attention" in text)
