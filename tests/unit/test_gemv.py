"""gemv: the linear kernel against a float reference, and pack_linears using it (bf16 where oneDNN cannot
pack bf16; float32 at decode rows where it was measured to win)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from dpserve.engine import cpu_linear, gemv
from dpserve.engine.loader import fast_bf16

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"),
]

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # float accumulation, one rounding to the dtype


@pytest.fixture(scope="module")
def kernel():
    assert gemv.load(), "a compiler is here, the kernel must build"
    return torch.ops.dpserve_gemv.linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 17])
@pytest.mark.parametrize("n,k", [(64, 576), (13, 40), (7, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float_linear(kernel, dtype, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = kernel(x, [w], [b])
    assert got.dtype == dtype and got.shape == (rows, n)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_a_group_is_its_members_side_by_side(kernel, dtype, bias):
    """Members of any sizes (the 4-row tiles straddle their boundaries) give torch.cat of their own linears."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 48, generator=gen).to(dtype)
    ws = [torch.randn(n, 48, generator=gen).to(dtype) for n in (70, 5, 130)]
    bs = [torch.randn(w.shape[0], generator=gen).to(dtype) if bias else None for w in ws]
    got = kernel(x, ws, bs)
    assert got.shape == (3, 205)
    torch.testing.assert_close(got, torch.cat([kernel(x, [w], [b]) for w, b in zip(ws, bs)], -1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_keeps_leading_dims_and_any_row_order(kernel, dtype):
    x = torch.randn(2, 5, 24).to(dtype)
    w = torch.randn(10, 24).to(dtype)
    got = kernel(x, [w], [None])
    assert got.shape == (2, 5, 10)
    # a row's result does not depend on the other rows (batch-invariant, unlike a blocked GEMM)
    torch.testing.assert_close(kernel(x[1, 3:4], [w], [None]), got[1, 3:4], rtol=0, atol=0)
    torch.testing.assert_close(kernel(x.transpose(0, 1), [w], [None]), got.transpose(0, 1), rtol=0, atol=0)


def test_kernel_refuses_what_it_does_not_compute(kernel):
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel(torch.randn(2, 8).half(), [torch.randn(4, 8).half()], [None])
    with pytest.raises(RuntimeError, match="weight"):
        kernel(torch.randn(2, 8).bfloat16(), [torch.randn(4, 9).bfloat16()], [None])
    with pytest.raises(RuntimeError, match="weight"):
        kernel(torch.randn(2, 8), [torch.randn(4, 8).bfloat16()], [None])
    with pytest.raises(RuntimeError, match="one bias"):
        kernel(torch.randn(2, 8), [torch.randn(4, 8)], [None, None])


@pytest.mark.skipif(fast_bf16(torch.device("cpu")), reason="oneDNN packs bf16 on this CPU: the kernel is not used")
def test_bf16_linears_take_the_kernel_where_onednn_cannot_pack(kernel):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 30)).bfloat16()
    model.requires_grad_(False)
    x = torch.randn(3, 64).bfloat16()
    want = model[2](F.silu(model[0](x.float().bfloat16()).float()).bfloat16())  # PyTorch's bf16 path
    assert cpu_linear.pack_linears(model, torch.bfloat16, torch.device("cpu")) == 2
    assert model[0].weight.data_ptr() in cpu_linear._GEMV
    torch.testing.assert_close(model(x).float(), want.float(), rtol=3e-2, atol=3e-2)


def test_float32_rows_follow_the_cpu_and_the_switch(monkeypatch):
    monkeypatch.setenv(gemv.ROWS_ENV, "0")
    assert gemv.float32_rows() == 0
    monkeypatch.setenv(gemv.ROWS_ENV, "8")
    assert gemv.float32_rows() == 8
    monkeypatch.setenv(gemv.ROWS_ENV, "many")
    assert gemv.float32_rows() == 0
    monkeypatch.delenv(gemv.ROWS_ENV)
    monkeypatch.setattr(gemv, "_cpu_flags", lambda: {"avx2", "fma"})
    assert gemv.float32_rows() == gemv.MEASURED_ROWS
    monkeypatch.setattr(gemv, "_cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert gemv.float32_rows() == 0  # not measured there: oneDNN keeps every size


def test_float32_decode_rows_take_the_kernel_and_larger_batches_onednn(kernel, monkeypatch):
    """With the kernel on for up to 2 rows, a packed float32 layer gives F.linear's result either way, and
    only the small calls reach the kernel."""
    monkeypatch.setenv(gemv.ROWS_ENV, "2")
    monkeypatch.setattr(cpu_linear, "_GEMV_ROWS", 0)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40)
    layer.requires_grad_(False)
    plain = torch.nn.Linear(64, 40)
    plain.load_state_dict(layer.state_dict())
    assert cpu_linear.pack_linears(layer, torch.float32, torch.device("cpu")) == 1
    assert cpu_linear._GEMV_ROWS == 2
    calls = []
    real = torch.ops.dpserve_gemv.linear
    monkeypatch.setattr(cpu_linear.torch.ops.dpserve_gemv, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a), raising=False)
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, 2]


@pytest.mark.skipif(fast_bf16(torch.device("cpu")), reason="oneDNN packs bf16 on this CPU: the kernel is not used")
def test_bf16_groups_on_the_kernel_fuse_without_a_copy(kernel):
    """bf16 q/k/v and gate/up on the kernel fuse as one call on the members' own weights (no concatenated
    copy); compiled, one linear_cat a group; eager (prefill), one kernel call a group too."""
    from dpserve.engine.compiled_artifact import PASSES

    from tests.unit.test_cpu_linear import _Block, _op_calls

    torch.manual_seed(2)
    block = _Block(bias=True).bfloat16().requires_grad_(False)
    with torch.inference_mode():
        x = torch.randn(1, 3, 64).bfloat16()
        want = block(x).float()
    assert cpu_linear.pack_linears(block, torch.bfloat16, torch.device("cpu")) == 6
    assert cpu_linear.fuse_groups(block) == 2
    assert cpu_linear._GROUPS[block.attn.q_proj.weight.data_ptr()] == (None, None)
    fn = torch.compile(lambda b, x: b(x), dynamic=True, fullgraph=True, options=PASSES)
    with torch.inference_mode():
        eager = block(x)
        torch.testing.assert_close(eager.float(), want, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(fn(block, x).float(), want, rtol=3e-2, atol=3e-2)
        assert _op_calls(fn, block, x) == 2
