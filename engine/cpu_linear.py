"""The model's linear layers on oneDNN's prepacked bfloat16 or float32 weights (CPU only).

The eager bf16 linear lays its weights out for oneDNN again on every call;
packed once at load, the projections, MLP and output head run 1.0-1.6x faster
at decode batch sizes (the head, 28 M weights on a 135M model, the most). The
packed copies live beside the weights (the KV budget is sized after load, so
it sees them). Uses torch's private mkldnn ops, fenced here: a model is packed
only after a packed layer matched F.linear on this CPU, so anything unexpected
(e.g. oneDNN without its JIT under MemoryDenyWriteExecute) leaves plain linears.
In float32 (MKL's sgemm on the plain weight otherwise) oneDNN's packed inner
product is 1.5-2.5x at decode sizes, the output head's 2.5x (issue 26 fifth round).
Must never change what the model computes beyond the dtype's rounding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float32)
# oneDNN picks the packed layout for about this many rows (a decode batch).
PACK_ROWS_HINT = 16

# weight.data_ptr() -> its packed copy. Keyed by the weight, which the compiled decode
# passes as an input, so one compiled block serves every layer (a packed tensor itself is
# an opaque mkldnn tensor that inductor cannot take as an input). Weights never move after load.
_PACKED: dict[int, torch.Tensor] = {}


# dpserve::linear, defined and implemented through torch.library directly, not @custom_op: the
# compiled decode calls it 7 times a block (210 a step on a 30-layer model), and custom_op's Python
# wrappers (dynamo-disable, alias checks, autograd) cost ~8 us a call, a direct CPU kernel ~2 us
# (benchmarks/RESULTS.md, issue 26 fifth round). Inference only: no autograd formula.
_LIB = torch.library.Library("dpserve", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), on weight's packed copy when it has one."""
    packed = _PACKED.get(weight.data_ptr())
    if packed is None:
        return F.linear(x, weight, bias)
    return _LINEAR_POINTWISE(x, packed, bias, "none", [], "")


_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
_LIB.impl("linear", packed_linear, "CPU")  # PackedLinear is only ever given to CPU layers


@torch.library.register_fake("dpserve::linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(torch.nn.Linear):
    """An nn.Linear whose forward goes through packed_linear (the class a packed layer is given)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dpserve.linear(x, self.weight, self.bias)


def pack_linears(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Give every nn.Linear of the model a packed copy where that is sound; how many."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return 0
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == dtype]
    if not linears or not _packs_correctly(linears[0]):
        return 0
    for module in linears:
        _PACKED[module.weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS_HINT)
        module.__class__ = PackedLinear
    return len(linears)


def _packs_correctly(module: torch.nn.Linear) -> bool:
    weight = module.weight.detach()
    bias = module.bias.detach() if module.bias is not None else None
    x = torch.randn(1, 3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        log.info("linear layers stay plain: %s", exc)
        return False
    want = F.linear(x, weight, bias)
    tol = 2e-2 if weight.dtype == torch.bfloat16 else 1e-4
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        log.warning("linear layers stay plain: oneDNN's packed result differs on this CPU")
        return False
    return True
