"""The model's linear layers on oneDNN's prepacked bfloat16 or float32 weights (CPU only).

The eager bf16 linear lays its weights out for oneDNN again on every call;
packed once at load, the projections, MLP and output head run 1.0-1.6x faster
at decode batch sizes (the head, 28 M weights on a 135M model, the most). The
packed copies live beside the weights (the KV budget is sized after load, so
it sees them). Uses torch's private mkldnn ops, fenced here: a model is packed
only after a packed layer matched F.linear on this CPU, so anything unexpected
(e.g. oneDNN without its JIT under MemoryDenyWriteExecute) leaves plain linears.
In float32 (MKL's sgemm on the plain weight otherwise) oneDNN's packed inner
product is 1.5-2.5x at decode sizes, the output head's 2.5x (issue 26 fifth round);
at up to 4 rows on AVX2 CPUs gemv.py's kernel streams the plain weights faster still.
Must never change what the model computes beyond the dtype's rounding.
"""

from __future__ import annotations

import ctypes
import logging
import os

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


# The data_ptr() of bf16 weights that gemv's kernel multiplies (CPUs where oneDNN cannot pack bf16).
_GEMV: set[int] = set()
# float32 calls of at most this many rows go through gemv's kernel on the plain weight instead of the
# packed copy (set by pack_linears: gemv.float32_rows() where the kernel loads, else 0).
_GEMV_ROWS = 0


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), on weight's packed copy when it has one (or through gemv's kernel)."""
    ptr = weight.data_ptr()
    if ptr in _GEMV or x.numel() <= _GEMV_ROWS * weight.shape[1]:
        return torch.ops.dpserve_gemv.linear(x, [weight], [bias])
    packed = _PACKED.get(ptr)
    if packed is None:
        return F.linear(x, weight, bias)  # a fused group's member (its packed copy made way for the group's)
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


# Projections that read the same input run as one GEMM in the compiled decode, as vLLM's merged qkv and
# gate_up layers do: at batch 1 a decode step is 210 small GEMMs over 30 layers, and 120 wider ones
# read the same bytes with fewer calls (benchmarks/RESULTS.md, issue 26 sixth round).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# a group's first weight's data_ptr() -> (the group's packed weight, its concatenated bias or None);
# (None, None) for a group of bf16 layers that gemv's kernel multiplies (no packed copies)
_GROUPS: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

_LIB.define("linear_cat(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")


def linear_cat(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    """torch.cat([F.linear(x, w, b) for each member], -1), in one GEMM on the group's packed weight."""
    found = _GROUPS.get(weights[0].data_ptr())
    if found is None:
        return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)
    if found[0] is None or x.numel() <= _GEMV_ROWS * x.shape[-1]:
        return torch.ops.dpserve_gemv.linear(x, weights, biases)  # the members' own weights, one call
    return _LINEAR_POINTWISE(x, found[0], found[1], "none", [], "")


_LIB.impl("linear_cat", linear_cat, "CPU")


@torch.library.register_fake("dpserve::linear_cat", lib=_LIB)
def _(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


class GroupedLinear(torch.nn.Linear):
    """A member of a fused group: each member takes its own columns of the group's one GEMM. Traced (the
    compiled decode), each calls the group's op and compiled_artifact.DedupeLinearCat leaves one call in
    the graph. Eager (long prefill chunks), the first member called with an input runs the group's GEMM
    on its packed weight and the others take their columns of it: before, each member ran a plain
    F.linear on its unpacked weight (its packed copy made way for the group's), a third of an eager
    32-token step in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, biases, lo, hi = self.dpserve_group
        if torch.compiler.is_compiling():
            return torch.ops.dpserve.linear_cat(x, weights, biases)[..., lo:hi]
        shared = self.dpserve_shared  # [input, the group's output, members still to take theirs]
        if shared[0] is not x:  # (held, so no other tensor can have its identity)
            shared[:] = [x, linear_cat(x, weights, biases), len(weights)]
        out = shared[1][..., lo:hi]
        shared[2] -= 1
        if shared[2] == 0:  # every member served: the group's output is not held past the layer
            shared[:] = [None, None, 0]
        return out


# Set to 0 to keep every projection its own GEMM in the compiled decode.
FUSE_SWITCH = "DPSERVE_FUSE_LINEARS"


def fuse_groups(model: torch.nn.Module) -> int:
    """Replace the packed copies of each FUSED_GROUPS group of packed linears (same input size, all or none
    with a bias) by one packed copy of their concatenated weights, for the compiled decode; how many groups.
    Memory stays as it was: the group's copy holds what the members' copies held. A group of bf16 layers
    on gemv's kernel needs no copy: the kernel reads the members' weights in one call."""
    if os.environ.get(FUSE_SWITCH, "1") == "0":
        return 0
    fused = 0
    for parent in list(model.modules()):
        for names in FUSED_GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is PackedLinear for m in members):
                continue
            on_kernel = [m.weight.data_ptr() in _GEMV for m in members]
            if not all(on_kernel) and not all(m.weight.data_ptr() in _PACKED for m in members):
                continue
            if len({m.in_features for m in members}) != 1 or len({m.bias is None for m in members}) != 1:
                continue
            weights = [m.weight for m in members]
            biases = [m.bias for m in members]
            packed = bias = None
            if not all(on_kernel):
                packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.detach() for w in weights]), PACK_ROWS_HINT)
                bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            lo = 0
            shared = [None, None, 0]
            for m in members:
                _PACKED.pop(m.weight.data_ptr(), None)
                m.__class__ = GroupedLinear
                m.dpserve_group = (weights, biases, lo, lo + m.out_features)
                m.dpserve_shared = shared
                lo += m.out_features
            _GROUPS[weights[0].data_ptr()] = (packed, bias)
            fused += 1
    if fused:
        _return_freed_memory()
    return fused


def _return_freed_memory() -> None:
    """The members' packed copies were freed into glibc's heap, which keeps them: ~200 MB of RSS on the
    135M model in fp32 until trimmed (the KV budget was sized before, and the RSS is what operators see)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def pack_linears(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Give every nn.Linear of the model a packed copy where that is sound; how many."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return 0
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == dtype]
    if not linears:
        return 0
    if not _packs_correctly(linears[0]):
        return _use_bf16_kernel(linears) if dtype == torch.bfloat16 else 0
    for module in linears:
        _PACKED[module.weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS_HINT)
        _GEMV.discard(module.weight.data_ptr())  # an earlier model's, freed (tests load several)
        module.__class__ = PackedLinear
    if dtype == torch.float32:
        _use_float32_kernel(linears[0])
    return len(linears)


def _use_float32_kernel(module: torch.nn.Linear) -> None:
    """float32 calls of a decode batch's rows through gemv's kernel where it was measured to stream the
    weights faster than oneDNN's packed copy (gemv.float32_rows; RESULTS, issue 26 seventh round)."""
    global _GEMV_ROWS
    from dpserve.engine import gemv

    rows = gemv.float32_rows()
    if not rows or not gemv.load() or not _kernel_matches(module, torch.float32, 1e-4):
        return
    _GEMV_ROWS = rows
    log.info("float32 linears of up to %d rows through the gemv kernel", rows)


def _use_bf16_kernel(linears: list[torch.nn.Linear]) -> int:
    """bf16 linears through gemv's kernel where oneDNN cannot pack them (no native bf16): 1.3-4x
    PyTorch's bf16 linear there, at every batch size measured (RESULTS, issue 26 sixth round)."""
    from dpserve.engine import gemv

    if not gemv.load() or not _kernel_matches(linears[0], torch.bfloat16, 2e-2):
        return 0
    for module in linears:
        _GEMV.add(module.weight.data_ptr())
        _PACKED.pop(module.weight.data_ptr(), None)  # an earlier model's, freed (tests load several)
        module.__class__ = PackedLinear
    log.info("bf16 linears through the gemv kernel (no native bf16 on this CPU): %d layers", len(linears))
    return len(linears)


def _kernel_matches(module: torch.nn.Linear, dtype: torch.dtype, tol: float) -> bool:
    """gemv's kernel gives F.linear's result in float on this CPU (else it stays unused, with a warning)."""
    x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    got = torch.ops.dpserve_gemv.linear(x, [weight], [bias])
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if not torch.allclose(got.float(), want, rtol=tol, atol=tol):
        log.warning("%s linears stay off the gemv kernel: its result differs on this CPU", dtype)
        return False
    return True


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
