"""cpu_linear.pack_output_head: the packed bf16 head computes the plain linear's logits, and is used only where it may be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dpserve.engine import cpu_linear
from dpserve.engine.loader import fast_bf16


class _Model(torch.nn.Module):
    def __init__(self, dtype, bias=False):
        super().__init__()
        self.head = torch.nn.Linear(64, 300, bias=bias).to(dtype)

    def get_output_embeddings(self):
        return self.head


@pytest.mark.skipif(not fast_bf16(torch.device("cpu")), reason="the CPU has no native bfloat16")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_head_equals_the_linear(bias):
    model = _Model(torch.bfloat16, bias)
    weight, b = model.head.weight.detach().clone(), None if model.head.bias is None else model.head.bias.detach().clone()
    assert cpu_linear.pack_output_head(model, torch.bfloat16, torch.device("cpu"))
    assert isinstance(model.head.forward, cpu_linear.PackedLinear)
    for shape in ((1, 1, 64), (1, 16, 64), (1, 200, 64), (7, 64)):
        x = torch.randn(shape).to(torch.bfloat16)
        torch.testing.assert_close(model.head(x).float(), F.linear(x, weight, b).float(), rtol=2e-2, atol=2e-2)


def test_only_bf16_linear_heads_on_cpu_are_packed(monkeypatch):
    assert not cpu_linear.pack_output_head(_Model(torch.float32), torch.float32, torch.device("cpu"))
    assert not cpu_linear.pack_output_head(_Model(torch.bfloat16), torch.bfloat16, torch.device("meta"))
    model = _Model(torch.bfloat16)

    def refuse(*a):
        raise RuntimeError("could not create a primitive")  # oneDNN without its JIT (MemoryDenyWriteExecute)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    assert not cpu_linear.pack_output_head(model, torch.bfloat16, torch.device("cpu"))
    assert "forward" not in vars(model.head)
