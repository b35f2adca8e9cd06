"""Paged attention for a packed step, plugged into transformers' attention interface.

A step runs every scheduled token of every sequence as one packed row
([1, N] tokens: decodes first, then prefill chunks), so the projections and
MLPs are one batched matmul each. Only attention needs to know whose token
is whose; it reads that from the StepMetadata the model runner installs for
the duration of the forward. Works for any model whose attention layers call
transformers' attention interface (Llama, Mistral, Qwen, Gemma, GPT-2, ...).
Must never allocate KV memory nor decide what runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from dpserve.engine import hf_compat, paged_attention_kernel
from dpserve.engine.kv_cache import KVCache
from dpserve.engine.paged_attention import paged_decode, paged_sdpa_decode, write_kv

ATTN_IMPLEMENTATION = "dpserve_paged"


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one new token each, of similar context length, attended in one batched call.

    Rows [start, end) of the packed step; flat_blocks [B * max blocks]: each
    row's block table padded with block 0, one after another; lengths [B]
    context lengths including the new token.
    """

    start: int
    end: int
    flat_blocks: torch.Tensor
    lengths: torch.Tensor
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, width: int) -> torch.Tensor:
        """[B, 1, 1, width] bool: the cached positions each row may attend to."""
        got = self._masks.get(window)
        if got is None:
            cols = torch.arange(width, device=self.lengths.device).unsqueeze(0)
            lengths = self.lengths.unsqueeze(1)
            got = cols < lengths
            if window is not None:
                got &= cols >= lengths - window
            got = got[:, None, None, :]
            self._masks[window] = got
        return got


@dataclass(slots=True)
class PrefillChunk:
    """n tokens of one sequence whose first context_len tokens are already cached.

    Rows [start, end) of the packed step; block_table [blocks] covers
    context_len + n tokens.
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, context_len + n] bool: causal, shifted by the cached prefix (and windowed)."""
        got = self._masks.get(window)
        if got is None:
            n = self.end - self.start
            device = self.block_table.device
            q_pos = torch.arange(self.context_len, self.context_len + n, device=device).unsqueeze(1)
            k_pos = torch.arange(self.context_len + n, device=device).unsqueeze(0)
            got = k_pos <= q_pos
            if window is not None:
                got &= k_pos > q_pos - window
            self._masks[window] = got
        return got


@dataclass(slots=True)
class DecodeBatch:
    """A step of decodes only, attended in place (paged_attention.paged_decode): the compiled path;
    or through SDPA over the gathered blocks (paged_sdpa_decode): the CUDA-graph path.

    block_tables [B, W] long: each row's blocks, padded with block 0;
    lengths [B] context lengths including the new token.
    """

    block_tables: torch.Tensor
    lengths: torch.Tensor
    sdpa: bool = False  # attend through paged_sdpa_decode (the CUDA-graph path) instead of in place


@dataclass(slots=True)
class StepMetadata:
    """Who owns which row of the packed step, and where its keys and values go.

    With `batch` set every row is a decode and decodes/prefills are empty.
    """

    kv: KVCache
    slot_mapping: torch.Tensor  # [N] long: the cache slot of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    on_layer: Callable[[], None] | None = None  # progress: called after every layer's attention
    batch: DecodeBatch | None = None


@dataclass(slots=True)
class DecodeStep:
    """A decode-only step as the compiled decode blocks read it (compiled.py).

    Passed down the model's forward as the keyword argument DECODE_KWARG (transformers
    hands a forward's extra keyword arguments to every layer and on to the attention
    function), not through step_metadata's global: a compiled block's inputs are then
    all its arguments, which is what an ahead-of-time compiled block is guarded on and
    loaded against. Every row is a decode; attention reads the cache in place.
    """

    slot_mapping: torch.Tensor  # [B] long: each row's new cache slot
    block_tables: torch.Tensor  # [B, W] long, padded with block 0
    lengths: torch.Tensor  # [B] long: context lengths including the new token
    block_size: int
    use_kernel: bool  # attention through the C++ kernel (paged_attention_kernel), else PyTorch's


DECODE_KWARG = "dpserve_decode"

_current: StepMetadata | None = None


@contextlib.contextmanager
def step_metadata(meta: StepMetadata):
    global _current
    _current = meta
    try:
        yield
    finally:
        _current = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D], positions already applied
    key: torch.Tensor,  # [1, KVH, N, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    step = kwargs.pop(DECODE_KWARG, None)
    if step is not None:
        return _attend_in_place(module, query, key, value, step.slot_mapping, step.block_tables, step.lengths,
                                step.block_size, scaling, sliding_window, step.use_kernel, False), None
    meta = _current
    if meta is None:
        # Outside an engine step (generate() in tests and tools): transformers'
        # SDPA on unpadded batches; no mask is built for this implementation.
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is None and sliding_window is not None and kv_len > sliding_window:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device).unsqueeze(1)
            k_pos = torch.arange(kv_len, device=query.device).unsqueeze(0)
            attention_mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
        return hf_compat.sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping is not supported by the paged attention path")
    if meta.batch is not None:
        return _attend_in_place(module, query, key, value, meta.slot_mapping, meta.batch.block_tables,
                                meta.batch.lengths, meta.kv.block_size, scaling, sliding_window,
                                paged_attention_kernel.loaded(), meta.batch.sdpa), None
    layer = hf_compat.layer_index(module)
    k_cache, v_cache = meta.kv.keys[layer], meta.kv.values[layer]
    _, heads, n_tokens, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    # 1. Store the new tokens' keys and values in their slots.
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    out = query.new_empty((n_tokens, heads, dim))
    q_rows = query[0].transpose(0, 1)  # [N, H, D]
    block_size = meta.kv.block_size
    k_blocks = k_cache.view(-1, block_size, kv_heads, dim)
    v_blocks = v_cache.view(-1, block_size, kv_heads, dim)

    # 2. Decodes: one query per sequence.
    for g in meta.decodes:
        out[g.start : g.end] = _attend_decodes(g, q_rows[g.start : g.end], k_cache, v_cache, block_size, scaling,
                                               sliding_window)

    # 3. Prefill chunks: causal over the cached prefix and the chunk itself.
    for c in meta.prefills:
        n = c.end - c.start
        q = q_rows[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.context_len == 0 and (sliding_window is None or sliding_window >= n):
            k, v = key[:, :, c.start : c.end], value[:, :, c.start : c.end]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=group > 1)
        else:
            total = c.context_len + n
            k = k_blocks.index_select(0, c.block_table).view(1, -1, kv_heads, dim)[:, :total].transpose(1, 2)
            v = v_blocks.index_select(0, c.block_table).view(1, -1, kv_heads, dim)[:, :total].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask(sliding_window), scale=scaling, enable_gqa=group > 1)
        out[c.start : c.end] = o[0].transpose(0, 1)

    if meta.on_layer is not None:
        meta.on_layer()
    return out.unsqueeze(0), None


def _attend_in_place(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     slots: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                     scaling: float | None, window: int | None, use_kernel: bool, sdpa: bool) -> torch.Tensor:
    """[1, B, H, D]: a decode-only step (compiled, or replayed from CUDA graphs). This layer's cache comes
    from the module (compiled.bind_kv), not by its index, so that one compiled block serves every layer
    (an index would be a constant)."""
    k_cache, v_cache = module.dpserve_k_cache, module.dpserve_v_cache
    write_kv(k_cache, v_cache, slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if sdpa:
        decode = paged_sdpa_decode
    else:  # the C++ kernel when it was built (compiled.CompiledDecode loads it), else the PyTorch reference
        decode = paged_attention_kernel.paged_decode if use_kernel else paged_decode
    out = decode(query[0].transpose(0, 1), k_cache, v_cache, block_tables, lengths, block_size, scale, window)
    return out.unsqueeze(0)


def _attend_decodes(g: DecodeGroup, q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_size: int, scaling: float | None, window: int | None) -> torch.Tensor:
    """[rows, H, D]: one decode group of an eager step. Through the C++ kernel when it was built
    (for the compiled decode: mixed steps' decodes use it too), else its heads packed per KV head
    ([B, KVH, G, D], so no key is repeated for grouped-query attention) over gathered blocks."""
    rows, heads, dim = q_rows.shape
    kv_heads = k_cache.shape[1]
    if paged_attention_kernel.loaded():
        return paged_attention_kernel.paged_decode(q_rows, k_cache, v_cache, g.flat_blocks.view(rows, -1), g.lengths,
                                                   block_size, scaling if scaling is not None else dim**-0.5, window)
    q = q_rows.reshape(rows, kv_heads, heads // kv_heads, dim)
    # index_select on a flat block list is several times faster than advanced indexing
    k = k_cache.view(-1, block_size, kv_heads, dim).index_select(0, g.flat_blocks).view(rows, -1, kv_heads, dim)
    v = v_cache.view(-1, block_size, kv_heads, dim).index_select(0, g.flat_blocks).view(rows, -1, kv_heads, dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask(window, k.shape[2]), scale=scaling)
    return o.reshape(rows, heads, dim)


def register() -> str:
    """Make ATTN_IMPLEMENTATION known to transformers (idempotent); returns its name."""
    hf_compat.register_attention(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
