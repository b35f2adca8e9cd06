"""paged_attention.paged_decode (in place through the block table) against a reference, and against attention.py's eager path.

The reference copies each sequence's context out of the cache by Python
indexing and runs SDPA on it; every case uses several block tables (scattered,
shared, padded) and lengths (one token, a block's edge, several blocks).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from dpserve.engine import attention
from dpserve.engine.attention import DecodeBatch, DecodeGroup, StepMetadata
from dpserve.engine.kv_cache import KVCache, KVShape
from dpserve.engine.paged_attention import paged_decode, write_kv

pytestmark = pytest.mark.timeout(300)

BS, KVH, GROUP, D, NUM_BLOCKS = 4, 2, 3, 16, 40


def make_case(lengths: list[int], seed: int, dtype=torch.float32, shared: bool = False):
    """A cache of random values and one block table per sequence (random blocks; with
    `shared`, every table starts with the same two blocks, as a cached prefix does)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS * BS, KVH, D, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS * BS, KVH, D, generator=gen).to(dtype)
    rng = random.Random(seed)
    pool = list(range(1, NUM_BLOCKS))
    rng.shuffle(pool)
    prefix = [pool.pop(), pool.pop()] if shared else []
    tables = []
    for n in lengths:
        need = -(-n // BS)
        own = prefix[:need] + [pool.pop() for _ in range(need - len(prefix[:need]))]
        tables.append(own)
    query = torch.randn(len(lengths), KVH * GROUP, D, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables


def padded(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    width = width or max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def reference(query, k_cache, v_cache, tables, lengths, scale, window=None) -> torch.Tensor:
    out = []
    for b, (table, n) in enumerate(zip(tables, lengths)):
        slots = [blk * BS + i for blk in table for i in range(BS)][:n]
        k = k_cache[slots].float().transpose(0, 1)  # [KVH, n, D]
        v = v_cache[slots].float().transpose(0, 1)
        q = query[b].float().view(KVH, GROUP, D)
        mask = None
        if window is not None:
            mask = (torch.arange(n) >= n - window).view(1, 1, n)
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).reshape(-1, D))
    return torch.stack(out)


CASES = [
    ([1], False),
    ([BS], False),
    ([BS + 1, 1, 3 * BS], False),
    ([7, 13, 2, 9, 4 * BS + 3], False),
    ([9, 11, 3 * BS], True),
]


@pytest.mark.parametrize("lengths,shared", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_matches_reference(lengths, shared, window):
    query, k_cache, v_cache, tables = make_case(lengths, seed=len(lengths) * 7 + (window or 0), shared=shared)
    scale = D**-0.5
    got = paged_decode(query, k_cache, v_cache, padded(tables), torch.tensor(lengths), BS, scale, window)
    torch.testing.assert_close(got, reference(query, k_cache, v_cache, tables, lengths, scale, window))
    # wider padding (extra blocks of 0 past every length) changes nothing
    wide = paged_decode(query, k_cache, v_cache, padded(tables, 8), torch.tensor(lengths), BS, scale, window)
    torch.testing.assert_close(wide, got)


def test_paged_decode_bfloat16():
    lengths = [5, 17, 2]
    query, k_cache, v_cache, tables = make_case(lengths, seed=3, dtype=torch.bfloat16)
    got = paged_decode(query, k_cache, v_cache, padded(tables), torch.tensor(lengths), BS, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(query, k_cache, v_cache, tables, lengths, 0.25), atol=2e-2, rtol=2e-2)


class _Layer(torch.nn.Module):
    layer_idx = 0


def test_batch_path_equals_eager_group_path():
    """The same decode step through attention.py's two forms: grouped index_select + SDPA
    (eager) and DecodeBatch (in place); both write the new keys and values the same way."""
    lengths = [3, BS + 2, 2 * BS]
    _, _, _, tables = make_case(lengths, seed=11)
    shape = KVShape(1, KVH, D, torch.float32)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, KVH * GROUP, len(lengths), D, generator=gen)
    key = torch.randn(1, KVH, len(lengths), D, generator=gen)
    value = torch.randn(1, KVH, len(lengths), D, generator=gen)
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lengths)])
    outs, caches = [], []
    for form in ("group", "batch"):
        kv = KVCache(shape, NUM_BLOCKS, BS, torch.device("cpu"))
        kv.keys[0].copy_(torch.randn(kv.keys[0].shape, generator=torch.Generator().manual_seed(1)))
        kv.values[0].copy_(torch.randn(kv.values[0].shape, generator=torch.Generator().manual_seed(2)))
        table = padded(tables)
        layer = _Layer()
        if form == "group":
            meta = StepMetadata(kv, slots, [DecodeGroup(0, len(lengths), table.flatten(), torch.tensor(lengths))], [])
        else:
            meta = StepMetadata(kv, slots, [], [], None, DecodeBatch(table, torch.tensor(lengths)))
            layer.dpserve_k_cache, layer.dpserve_v_cache = kv.keys[0], kv.values[0]  # as compiled.bind_kv does
        with attention.step_metadata(meta):
            out, _ = attention.paged_attention(layer, query, key, value, None, scaling=D**-0.5)
        outs.append(out)
        caches.append((kv.keys[0].clone(), kv.values[0].clone()))
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(caches[1], caches[0])


def test_write_kv_fills_only_the_named_slots():
    k_cache, v_cache = torch.zeros(8, KVH, D), torch.zeros(8, KVH, D)
    key, value = torch.ones(2, KVH, D), torch.full((2, KVH, D), 2.0)
    write_kv(k_cache, v_cache, torch.tensor([5, 2]), key, value)
    assert k_cache[[2, 5]].eq(1).all() and v_cache[[2, 5]].eq(2).all()
    assert k_cache[[0, 1, 3, 4, 6, 7]].eq(0).all()


def test_compiled_paged_decode_matches_reference():
    """What the compiled decode runs: inductor's code for paged_decode, sizes symbolic."""
    fn = torch.compile(paged_decode, dynamic=True)
    for lengths, shared in CASES[2:]:
        query, k_cache, v_cache, tables = make_case(lengths, seed=len(lengths), shared=shared)
        got = fn(query, k_cache, v_cache, padded(tables), torch.tensor(lengths), BS, D**-0.5)
        torch.testing.assert_close(got, reference(query, k_cache, v_cache, tables, lengths, D**-0.5))
