"""cpu_linear.pack_linears: packed bf16 linears compute the plain linear's result, eager and compiled, and are used only where they may be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dpserve.engine import cpu_linear
from dpserve.engine.loader import fast_bf16

needs_bf16 = pytest.mark.skipif(not fast_bf16(torch.device("cpu")), reason="the CPU has no native bfloat16")


def _model(dtype, bias=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=bias), torch.nn.SiLU(), torch.nn.Linear(96, 300, bias=bias))
    return model.to(dtype).requires_grad_(False)  # as the loader leaves a model: no autograd


def _plain(model, x):
    first, _, last = model
    return F.linear(F.silu(F.linear(x, first.weight, first.bias)), last.weight, last.bias)


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linears_equal_the_plain_ones(bias):
    model = _model(torch.bfloat16, bias)
    assert cpu_linear.pack_linears(model, torch.bfloat16, torch.device("cpu")) == 2
    assert all(type(m) is cpu_linear.PackedLinear for m in (model[0], model[2]))
    assert model[0].weight.data_ptr() in cpu_linear._PACKED
    for shape in ((1, 1, 64), (1, 16, 64), (1, 200, 64), (7, 64)):
        x = torch.randn(shape).to(torch.bfloat16)
        torch.testing.assert_close(model(x).float(), _plain(model, x).float(), rtol=3e-2, atol=3e-2)


@needs_bf16
def test_packed_linears_compile_with_the_weights_as_inputs():
    """The compiled decode passes weights in: one compiled function serves two models' packed layers."""
    a, b = _model(torch.bfloat16), _model(torch.bfloat16)
    b[0].weight.data.mul_(2)
    cpu_linear.pack_linears(a, torch.bfloat16, torch.device("cpu"))
    cpu_linear.pack_linears(b, torch.bfloat16, torch.device("cpu"))
    fn = torch.compile(lambda m, x: m(x), dynamic=True)
    x = torch.randn(1, 5, 64).to(torch.bfloat16)
    for model in (a, b):
        with torch.inference_mode():
            got = fn(model, x)
        torch.testing.assert_close(got.float(), _plain(model, x).float(), rtol=3e-2, atol=3e-2)


def test_float32_linears_are_packed_and_equal_the_plain_ones():
    model = _model(torch.float32, bias=True)
    assert cpu_linear.pack_linears(model, torch.float32, torch.device("cpu")) == 2
    x = torch.randn(1, 5, 64)
    torch.testing.assert_close(model(x), _plain(model, x), rtol=1e-5, atol=1e-5)


def test_only_bf16_and_fp32_linears_on_cpu_are_packed(monkeypatch):
    assert cpu_linear.pack_linears(_model(torch.float16), torch.float16, torch.device("cpu")) == 0
    assert cpu_linear.pack_linears(_model(torch.bfloat16), torch.bfloat16, torch.device("meta")) == 0
    model = _model(torch.bfloat16)

    def refuse(*a):
        raise RuntimeError("could not create a primitive")  # oneDNN without its JIT (MemoryDenyWriteExecute)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    assert cpu_linear.pack_linears(model, torch.bfloat16, torch.device("cpu")) == 0
    assert type(model[0]) is torch.nn.Linear
