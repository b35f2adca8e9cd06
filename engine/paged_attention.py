"""Decode attention that reads cached keys and values in place, through the block table.

One query token per sequence against its cached context. Written as indexed
loads feeding elementwise products and reductions (no matmul, no SDPA), so that
inductor, compiling the decode forward, fuses the block-table lookup into the
loops that consume it: no copy of the context is ever made. Run eagerly the same
code materializes the gather (slower than attention.py's path, which stays the
eager engine's and the reference the tests compare this with).
Must never allocate KV memory nor decide what runs.
"""

from __future__ import annotations

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """The new tokens' keys and values ([N, KVH, D]) into their cache slots ([N] long)."""
    k_cache.index_copy_(0, slots, key)
    v_cache.index_copy_(0, slots, value)


def paged_decode(
    query: torch.Tensor,  # [B, H, D]: one new token per sequence, positions applied
    k_cache: torch.Tensor,  # [num_blocks * block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] long: each row's blocks, padded with any valid block
    lengths: torch.Tensor,  # [B] long: context lengths including the new token (already written)
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """[B, H, D]: each row's attention over its first lengths[b] cached positions (the last `window` of them)."""
    rows, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    width = block_tables.shape[1]
    k = k_cache.view(-1, block_size, kv_heads, dim)[block_tables].view(rows, width * block_size, kv_heads, 1, dim)
    v = v_cache.view(-1, block_size, kv_heads, dim)[block_tables].view(rows, width * block_size, kv_heads, 1, dim)
    q = query.view(rows, 1, kv_heads, group, dim).float()
    scores = (q * k.float()).sum(-1) * scale  # [B, T, KVH, G]
    pos = torch.arange(width * block_size, device=query.device).unsqueeze(0)
    valid = pos < lengths.unsqueeze(1)
    if window is not None:
        valid = valid & (pos >= lengths.unsqueeze(1) - window)
    scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1).unsqueeze(-1)  # [B, T, KVH, G, 1]
    out = (probs * v.float()).sum(1)  # [B, KVH, G, D]
    return out.reshape(rows, heads, dim).to(query.dtype)


def paged_sdpa_decode(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks * block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] long
    lengths: torch.Tensor,  # [B] long
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """paged_decode's result through SDPA (the CUDA-graph decode's attention): each row's blocks
    gathered by one index_select into [B, KVH, W * block_size, D], then one masked SDPA call
    (FlashAttention-class fused kernels on CUDA, grouped-query heads without repeating keys).
    Everything stays on the device: no host sync, so it can be captured in a CUDA graph."""
    rows, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    width = block_tables.shape[1]
    flat = block_tables.reshape(-1)
    k = k_cache.view(-1, block_size, kv_heads, dim).index_select(0, flat).view(rows, width * block_size, kv_heads, dim)
    v = v_cache.view(-1, block_size, kv_heads, dim).index_select(0, flat).view(rows, width * block_size, kv_heads, dim)
    pos = torch.arange(width * block_size, device=query.device).unsqueeze(0)
    valid = pos < lengths.unsqueeze(1)
    if window is not None:
        valid = valid & (pos >= lengths.unsqueeze(1) - window)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=scale, enable_gqa=heads != kv_heads)
    return out.squeeze(2)
