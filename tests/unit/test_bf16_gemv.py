"""bf16_gemv: the bf16 linear kernel against a float reference, and pack_linears using it where oneDNN cannot pack bf16."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from dpserve.engine import bf16_gemv, cpu_linear
from dpserve.engine.loader import fast_bf16

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"),
]


@pytest.fixture(scope="module")
def kernel():
    assert bf16_gemv.load(), "a compiler is here, the kernel must build"
    return torch.ops.dpserve_gemv.bf16_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 17])
@pytest.mark.parametrize("n,k", [(64, 576), (13, 40), (7, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float_linear(kernel, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    got = kernel(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # float accumulation, one rounding


def test_kernel_keeps_leading_dims_and_any_row_order(kernel):
    x = torch.randn(2, 5, 24).to(torch.bfloat16)
    w = torch.randn(10, 24).to(torch.bfloat16)
    got = kernel(x, w, None)
    assert got.shape == (2, 5, 10)
    # a row's result does not depend on the other rows (batch-invariant, unlike a blocked GEMM)
    torch.testing.assert_close(kernel(x[1, 3:4], w, None), got[1, 3:4], rtol=0, atol=0)
    torch.testing.assert_close(kernel(x.transpose(0, 1), w, None), got.transpose(0, 1), rtol=0, atol=0)


def test_kernel_refuses_what_it_does_not_compute(kernel):
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(torch.randn(2, 8), torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="weight"):
        kernel(torch.randn(2, 8).bfloat16(), torch.randn(4, 9).bfloat16(), None)


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
    assert cpu_linear.fuse_groups(model) == 0  # no packed copies to fuse
