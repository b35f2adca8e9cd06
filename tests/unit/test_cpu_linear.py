"""cpu_linear.pack_linears: packed bf16 linears compute the plain linear's result, eager and compiled, and are used only where they may be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dpserve.engine import cpu_linear, gemv
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
    monkeypatch.setenv("DPSERVE_CPU_GEMV", "0")
    monkeypatch.setattr(gemv, "_state", {})
    assert cpu_linear.pack_linears(model, torch.bfloat16, torch.device("cpu")) == 0
    assert type(model[0]) is torch.nn.Linear
    # the bf16 kernel is a built library, not oneDNN's JIT: where it loads, it takes the bf16 linears
    monkeypatch.delenv("DPSERVE_CPU_GEMV")
    monkeypatch.setattr(gemv, "_state", {})
    if gemv.load():
        assert cpu_linear.pack_linears(model, torch.bfloat16, torch.device("cpu")) == 2
        assert model[0].weight.data_ptr() in cpu_linear._GEMV and model[0].weight.data_ptr() not in cpu_linear._PACKED


class _Block(torch.nn.Module):
    """The shapes of a Llama block's projections: q/k/v (with biases, as Qwen2's) and gate/up/down."""

    def __init__(self, bias: bool):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.q_proj, self.attn.k_proj, self.attn.v_proj = (torch.nn.Linear(64, n, bias=bias) for n in (64, 16, 16))
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
        self.mlp.down_proj = torch.nn.Linear(96, 64, bias=False)

    def forward(self, x):
        a = self.attn
        h = a.q_proj(x) + torch.cat([a.k_proj(x), a.v_proj(x)], -1).repeat(1, 1, 2)
        m = self.mlp
        return m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


def _op_calls(fn, *args, ops=("dpserve::linear_cat",)) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(e.count for e in prof.key_averages() if e.key in ops)


GEMMS = ("mkldnn::_linear_pointwise", "dpserve_gemv::linear", "aten::linear")


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linears_are_one_gemm_a_group_in_compiled_code(bias):
    """fuse_groups (the compiled decode's): q/k/v and gate/up each one packed GEMM in compiled code, the
    DedupeLinearCat pass leaving one call per group; eager, one GEMM a group too (the first member runs it,
    the others take their columns, nothing held after); the same results either way."""
    from dpserve.engine.compiled_artifact import PASSES

    torch.manual_seed(1)
    block = _Block(bias).requires_grad_(False)
    with torch.inference_mode():  # as the engine runs (a tensor made outside would be another graph)
        x = torch.randn(1, 3, 64)
        want = block(x)
    assert cpu_linear.pack_linears(block, torch.float32, torch.device("cpu")) == 6
    assert cpu_linear.fuse_groups(block) == 2
    assert type(block.attn.k_proj) is cpu_linear.GroupedLinear and type(block.mlp.down_proj) is cpu_linear.PackedLinear
    assert block.attn.q_proj.weight.data_ptr() not in cpu_linear._PACKED  # the group's copy replaced the member's
    fn = torch.compile(lambda b, x: b(x), dynamic=True, fullgraph=True, options=PASSES)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)
        for rows in (3, 2, 7):
            xr = torch.randn(1, rows, 64)
            torch.testing.assert_close(fn(block, xr), _Block.forward(_plain_block(block), xr), rtol=1e-5, atol=1e-5)
        assert _op_calls(fn, block, x) == 2
        assert _op_calls(block, x, ops=GEMMS) == 3  # q/k/v, gate/up, down
        assert block.attn.q_proj.dpserve_shared == [None, None, 0] and block.mlp.up_proj.dpserve_shared == [None, None, 0]
        torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)
        # a member called on another input than its group's last one runs the GEMM again
        y = torch.randn(1, 2, 64)
        block.attn.q_proj(x)
        torch.testing.assert_close(block.attn.k_proj(y), F.linear(y, block.attn.k_proj.weight, block.attn.k_proj.bias),
                                   rtol=1e-5, atol=1e-5)


def _plain_block(block):
    """A copy of block with plain nn.Linear layers over the same weights (the reference)."""
    plain = _Block(block.attn.q_proj.bias is not None).requires_grad_(False)
    for name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):
            target = plain.get_submodule(name)
            target.weight, target.bias = module.weight, module.bias
    return plain


def test_only_whole_groups_of_packed_linears_are_fused():
    block = _Block(bias=False).requires_grad_(False)
    assert cpu_linear.fuse_groups(block) == 0  # nothing packed: nothing to fuse
    cpu_linear.pack_linears(block, torch.float32, torch.device("cpu"))
    block.attn.k_proj.bias = torch.nn.Parameter(torch.zeros(16), requires_grad=False)  # biases: all or none
    assert cpu_linear.fuse_groups(block) == 1
    assert type(block.attn.q_proj) is cpu_linear.PackedLinear and type(block.mlp.up_proj) is cpu_linear.GroupedLinear
