"""The C++ paged-attention decode kernel (paged_attention_kernel.py) against the pure-PyTorch reference.

Same cases as test_paged_attention.py (scattered, shared and padded block tables;
one token, a block's edge, several blocks; windows), plus what the kernel does on
its own: head sizes that are not a multiple of its vector width, plain multi-head
attention, a query with the strides attention.py passes, bf16/fp16, inside
torch.compile without a graph break, and its fallbacks. Skipped only on a host
without a C++ compiler (where the engine keeps the PyTorch path).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from dpserve.engine import paged_attention_kernel as kernel
from dpserve.engine.paged_attention import paged_decode

from tests.unit.test_paged_attention import BS, CASES, GROUP, KVH, NUM_BLOCKS, D, make_case, padded, reference

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the engine keeps the pure-PyTorch attention")
    with switched_on():
        assert kernel.load(str(tmp_path_factory.mktemp("compile-cache"))), "a compiler is here, the kernel must build"
        yield kernel.paged_decode


@contextlib.contextmanager
def switched_on():
    """DPSERVE_CPU_ATTENTION_KERNEL=1 and a fresh load() decision; the process's earlier one is put back after."""
    saved = dict(kernel._state)
    kernel._state.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernel.ENV_SWITCH, "1")
        try:
            yield
        finally:
            kernel._state.clear()
            kernel._state.update(saved)


@pytest.mark.parametrize("lengths,shared", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_reference_fp32(built, lengths, shared, window):
    query, k_cache, v_cache, tables = make_case(lengths, seed=len(lengths) * 5 + (window or 0), shared=shared)
    scale = D**-0.5
    got = built(query, k_cache, v_cache, padded(tables), torch.tensor(lengths), BS, scale, window)
    want = reference(query, k_cache, v_cache, tables, lengths, scale, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    wide = built(query, k_cache, v_cache, padded(tables, 8), torch.tensor(lengths), BS, scale, window)
    torch.testing.assert_close(wide, got, atol=0, rtol=0)  # padding past every length is never read


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_types(built, dtype):
    lengths = [5, 17, 2, 3 * BS]
    query, k_cache, v_cache, tables = make_case(lengths, seed=3, dtype=dtype)
    got = built(query, k_cache, v_cache, padded(tables), torch.tensor(lengths), BS, 0.25)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), reference(query, k_cache, v_cache, tables, lengths, 0.25), atol=2e-2, rtol=2e-2)
    # the same float accumulation as the PyTorch path: equal up to the final rounding
    pure = paged_decode(query, k_cache, v_cache, padded(tables), torch.tensor(lengths), BS, 0.25)
    torch.testing.assert_close(got.float(), pure.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kv_heads,group,dim", [(4, 1, 24), (1, 8, 40), (2, 3, 128)])
def test_kernel_head_shapes(built, kv_heads, group, dim):
    gen = torch.Generator().manual_seed(kv_heads * 100 + dim)
    blocks, lengths = 12, [1, 9, 2 * BS + 1]
    k_cache = torch.randn(blocks * BS, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks * BS, kv_heads, dim, generator=gen)
    tables = torch.tensor([[3, 0, 0], [7, 1, 11], [2, 9, 5]])
    # [B, H, D] as attention.py passes it: query[0].transpose(0, 1) of [1, H, B, D]
    query = torch.randn(1, kv_heads * group, len(lengths), dim, generator=gen)[0].transpose(0, 1)
    got = built(query, k_cache, v_cache, tables, torch.tensor(lengths), BS, dim**-0.5)
    want = paged_decode(query, k_cache, v_cache, tables, torch.tensor(lengths), BS, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# Head sizes of 32, 64 and 128 take the AVX-512 path on a CPU that has it (16 positions' scores at a time,
# bf16 keys by vdpbf16ps where the CPU has AVX512_BF16): runs of positions that end inside and on a
# 16-position chunk and a block, blocks of 16 and of 4 (a chunk's positions from several blocks), windows,
# groups wider than one values pass (128: 2 query heads a pass; 64: 4).
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 8, 64), (2, 3, 128), (1, 1, 32)])
@pytest.mark.parametrize("block_size", [16, 4])
def test_kernel_vector_head_sizes(built, dtype, tol, kv_heads, group, dim, block_size):
    gen = torch.Generator().manual_seed(dim * 10 + group + block_size)
    lengths = [1, 15, 16, 17, 33, 100]
    width = max(-(-n // block_size) for n in lengths)
    blocks = len(lengths) * width + 3
    k_cache = torch.randn(blocks * block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks * block_size, kv_heads, dim, generator=gen).to(dtype)
    query = (torch.randn(len(lengths), kv_heads * group, dim, generator=gen) * 3).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(lengths) * width].view(len(lengths), width)
    for window in (None, 5, 20):
        args = (query, k_cache, v_cache, tables, torch.tensor(lengths), block_size, dim**-0.5, window)
        got = built(*args)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), paged_decode(*args).float(), atol=tol, rtol=tol)
        exact = paged_decode(query.float(), k_cache.float(), v_cache.float(), *args[3:])
        torch.testing.assert_close(got.float(), exact, atol=2 * tol, rtol=2 * tol)


def test_kernel_inside_compiled_code_without_graph_break(built):
    """The compiled decode block calls it: Dynamo must trace it as one op (fullgraph)."""

    def step(query, k_cache, v_cache, tables, lengths):
        return built(query * 1.0, k_cache, v_cache, tables, lengths, BS, D**-0.5).relu()

    fn = torch.compile(step, dynamic=True, fullgraph=True)
    for lengths, shared in CASES[2:]:
        query, k_cache, v_cache, tables = make_case(lengths, seed=len(lengths), shared=shared)
        got = fn(query, k_cache, v_cache, padded(tables), torch.tensor(lengths))
        want = reference(query, k_cache, v_cache, tables, lengths, D**-0.5).relu()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kernel_rejects_a_length_past_its_table(built):
    query, k_cache, v_cache, tables = make_case([5], seed=1)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        built(query, k_cache, v_cache, padded(tables), torch.tensor([len(tables[0]) * BS + 1]), BS, 0.5)


def test_fallbacks_keep_the_pytorch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(kernel.ENV_SWITCH, "0")
    assert kernel._load(str(tmp_path)) is False
    monkeypatch.delenv(kernel.ENV_SWITCH, raising=False)  # on by default: wants a compiler
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert kernel._load(str(tmp_path)) is False
    assert "no C++ compiler" in caplog.text
    assert not any(tmp_path.iterdir())  # nothing was built


def test_eager_decode_groups_through_the_kernel(built, monkeypatch):
    """attention.py's eager step (mixed steps' decodes) uses the kernel once it is built: same output as its SDPA path."""
    from dpserve.engine import attention
    from dpserve.engine.attention import DecodeGroup, StepMetadata
    from dpserve.engine.kv_cache import KVCache, KVShape

    lengths = [3, BS + 2, 2 * BS]
    _, _, _, tables = make_case(lengths, seed=11)
    kv = KVCache(KVShape(1, KVH, D, torch.float32), NUM_BLOCKS, BS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    kv.keys[0].copy_(torch.randn(kv.keys[0].shape, generator=gen))
    kv.values[0].copy_(torch.randn(kv.values[0].shape, generator=gen))
    query = torch.randn(1, KVH * GROUP, len(lengths), D, generator=gen)
    key, value = torch.randn(1, KVH, len(lengths), D, generator=gen), torch.randn(1, KVH, len(lengths), D, generator=gen)
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lengths)])
    layer = torch.nn.Module()
    layer.layer_idx = 0
    outs = []
    for use_kernel in (True, False):
        monkeypatch.setitem(kernel._state, "loaded", use_kernel)
        group = DecodeGroup(0, len(lengths), padded(tables).flatten(), torch.tensor(lengths))
        with attention.step_metadata(StepMetadata(kv, slots, [group], [])):
            outs.append(attention.paged_attention(layer, query, key, value, None, scaling=D**-0.5)[0])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


# The kernel is built with -march=native, so a machine tests only the vector path its CPU takes. This
# builds the next path down as well (AVX-512 -> its AVX2 code, AVX2 -> the generic code), in a
# subprocess (a process registers the op's namespace once), and checks it against the PyTorch path.
VARIANT_CHECK = r"""
import sys, torch
from dpserve.engine import paged_attention_kernel as kernel
from dpserve.engine.paged_attention import paged_decode
kernel.build_and_register(sys.argv[1], ("-march=native", sys.argv[2]))
gen = torch.Generator().manual_seed(0)
BS = 16
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)):
    for kvh, group, dim, lengths in ((3, 3, 64, [1, 7, 16, 17, 100]), (2, 3, 128, [16, 50]), (2, 4, 40, [3, 33]),
                                     (1, 1, 24, [9])):
        width = max(-(-n // BS) for n in lengths)
        blocks = len(lengths) * width + 2
        k = torch.randn(blocks * BS, kvh, dim, generator=gen).to(dtype)
        v = torch.randn(blocks * BS, kvh, dim, generator=gen).to(dtype)
        q = (torch.randn(len(lengths), kvh * group, dim, generator=gen) * 3).to(dtype)
        tables = torch.randperm(blocks, generator=gen)[: len(lengths) * width].view(len(lengths), width)
        for window in (None, 5):
            args = (q, k, v, tables, torch.tensor(lengths), BS, dim**-0.5, window)
            torch.testing.assert_close(kernel.paged_decode(*args).float(), paged_decode(*args).float(), atol=tol, rtol=tol)
print("variant ok")
"""


def _build_and_check(tmp_path, variant: str) -> None:
    proc = subprocess.run([sys.executable, "-c", VARIANT_CHECK, str(tmp_path), variant], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0 and "variant ok" in proc.stdout, proc.stderr[-3000:]


def _cpu_flags() -> list[str]:
    return open("/proc/cpuinfo", encoding="utf-8").read().split() if os.path.exists("/proc/cpuinfo") else []


def test_the_next_vector_path_down_matches(tmp_path):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    flags = _cpu_flags()
    if "avx512f" in flags:
        variant = "-mno-avx512f"  # the AVX2 + FMA code
    elif "avx2" in flags:
        variant = "-mno-avx2"  # the generic code
    else:
        pytest.skip("not an x86 CPU with AVX2: -march=native already builds the generic code")
    _build_and_check(tmp_path, variant)


def test_the_avx512_path_without_bf16_dot_products_matches(tmp_path):
    """On a CPU with AVX512_BF16 the native build scores bf16 keys with vdpbf16ps; an AVX-512 CPU without
    it converts them to float first: that code, built here, against the PyTorch path."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    if "avx512_bf16" not in _cpu_flags():
        pytest.skip("no AVX512_BF16: -march=native already builds the float path")
    _build_and_check(tmp_path, "-mno-avx512bf16")
