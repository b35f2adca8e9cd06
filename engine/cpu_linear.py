"""The output head's matmul on oneDNN's prepacked bfloat16 weights (CPU only).

The head (hidden x vocabulary, 28 M weights on a 135M model) is the largest
single matmul of a decode step, and the eager bf16 linear re-lays its weights
out on every call: prepacked once, it is ~1.6x faster at 16 rows. Uses
torch's private mkldnn ops, fenced here; a head is packed only after the
packed result matched F.linear on this CPU, so anything unexpected leaves
the plain linear in place. Must never change what the model computes beyond
bfloat16 rounding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# oneDNN picks the packed layout for about this many rows (a decode batch).
PACK_ROWS_HINT = 16


class PackedLinear:
    """A replacement forward for one nn.Linear: x @ W^T + b on the packed copy of W."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed, self.bias = packed, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_output_head(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Swap the model's output head to a packed bf16 forward where that is sound; whether it did."""
    head = model.get_output_embeddings()
    if device.type != "cpu" or dtype != torch.bfloat16 or type(head) is not torch.nn.Linear:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    weight = head.weight.detach()
    bias = head.bias.detach() if head.bias is not None else None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        forward = PackedLinear(packed, bias)
        x = torch.randn(1, 3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
        got, want = forward(x), F.linear(x, weight, bias)
    except (RuntimeError, AttributeError) as exc:
        log.info("output head stays a plain linear: %s", exc)
        return False
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        log.warning("output head stays a plain linear: the packed result differs on this CPU")
        return False
    head.forward = forward
    return True
