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


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (Llama's model.layers, GPT-2's transformer.h): the
    longest ModuleList of modules of one class. transformers names it differently per
    architecture and promises none of the names; the compiled decode compiles one of
    these blocks' code once and runs it for all of them."""
    best: list[torch.nn.Module] = []
    for child in model.modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) > len(best):
            if len({type(m) for m in child}) == 1:
                best = list(child)
    return best


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that call the attention function, in layer order: those with the
    `layer_idx` that layer_index() reads, whose class name says attention."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and "attention" in type(m).__name__.lower()]
    return sorted(found, key=layer_index)


def without_hub_kernel_wrappers(model: torch.nn.Module) -> list[str]:
    """Run the model's own forwards, not the `kernels` package's dispatch around them; returns
    the classes it unwrapped.

    transformers 5.25 requires `kernels`, and with it installed, a module class that calls a
    hub-replaceable function (Llama's attention calls apply_rotary_pos_emb) gets a forward that
    first publishes a per-instance wrapper in a context variable, for kernels.kernelize() to swap
    in a downloaded kernel. dpserve never kernelizes (its ranks load nothing from the hub), so the
    dispatch only costs Python per layer call, and the compiled decode's saved artifact cannot hold
    it (its guards reach a class defined inside a function, which torch refuses to save: every
    start then traced the block again). The original forward is kept on the wrapper as __wrapped__
    (functools.wraps), and goes back on the class: an instance attribute would be pickled into the
    artifact with its closure, which torch's loader then cannot rebuild. A forward of any other
    shape is left alone."""
    unwrapped = []
    for cls in {type(m) for m in model.modules()}:
        forward = cls.__dict__.get("forward")
        # functools.wraps copied the original's name and module onto the wrapper: where its code was
        # defined is what tells it apart
        if (getattr(forward, "__globals__", {}).get("__name__", "").startswith("kernels.")
                and "use_kernelized_func" in getattr(getattr(forward, "__code__", None), "co_qualname", "")
                and callable(getattr(forward, "__wrapped__", None))):
            cls.forward = forward.__wrapped__
            unwrapped.append(cls.__qualname__)
    return sorted(unwrapped)
