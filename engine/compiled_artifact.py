"""The compiled decoder block saved whole, so that a restarted rank skips Dynamo (torch.compile's AOT path).

Inductor's cache alone still leaves every start to trace the block with Dynamo
(~3 s of symbolic shapes on the 135M model) and to rebuild its guards before the
cached code is found. torch.compile(...).aot_compile() instead packages the
traced bytecode, its guards and inductor's code in one artifact, which a later
start loads in about a second (benchmarks/RESULTS.md, fourth round).

Owns the artifact's file: its name (everything the compiled code depends on
besides the traced source: torch, the machine, the model's config, dtype,
block size, attention kernel) and its validation on load (the traced source,
line by line, as torch recorded it). Must never serve an artifact built for
other code: a stale or unreadable one is logged, removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
from collections.abc import Callable

import torch
from dpserve.engine import cpu_linear  # noqa: F401 - registers dpserve::linear_cat, which the pass looks for
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger(__name__)

FORMAT = 3  # bump when what run_block or the artifact's key mean changes


# Less Python per block call (the block runs 30 times a step): the block's float attributes (norm eps,
# attention scale) are constants of the code, checked by its guards, rather than symbolic floats the
# pre-graph code boxes into a tensor each call; and no size/stride assertion per tensor per call.
COMPILE_DYNAMO = {"specialize_float": True}
COMPILE_INDUCTOR = {"size_asserts": False}


class DedupeLinearCat(CustomGraphPass):
    """Inductor's post-grad pass for the compiled decode: the members of a group each trace the same
    linear_cat call (same input, same weights); keep the first, point the others' users at it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        target = torch.ops.dpserve.linear_cat.default
        first: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not target:
                continue
            x, weights, biases = node.args
            key = (x, tuple(weights), tuple(biases))
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node

    def uuid(self) -> str:
        return "dpserve-dedupe-linear-cat-1"


# inductor options of every compile of the block (the AOT one and torch.compile's fallback, compiled.py)
PASSES = {"post_grad_custom_pre_pass": DedupeLinearCat()}


def run_block(block: torch.nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """One decoder block's forward: the function compiled ahead of time.

    A plain module-level function, not the block's forward: transformers wraps
    forwards in decorators whose closures torch cannot save, and the class's
    forward (not the instance's, which compiled.py replaces) avoids recursion."""
    return type(block).forward(block, hidden_states, **kwargs)


def artifact_path(cache_dir: str, model: torch.nn.Module, block: torch.nn.Module, dtype: torch.dtype,
                  block_size: int, use_kernel: bool, vec_isa: str) -> str:
    """Where the artifact for this model, dtype, block size and attention lives under the compile cache."""
    from dpserve.engine.compile_cache import machine_key

    config = getattr(model, "config", None)
    parts = {
        "format": FORMAT,
        "torch": torch.__version__,
        "python": sys.version,
        "machine": machine_key(),
        "block": f"{type(block).__module__}.{type(block).__qualname__}",
        # plain, packed or grouped (cpu_linear): which op each projection traces to
        "linears": sorted({type(m).__name__ for m in block.modules() if isinstance(m, torch.nn.Linear)}),
        "config": config.to_json_string() if config is not None else repr(model),
        "dtype": str(dtype),
        "block_size": block_size,
        "compile_config": [COMPILE_DYNAMO, COMPILE_INDUCTOR],
        "kernel": use_kernel,
        "vec_isa": vec_isa,
        # part of the global state the guards check: a rank with another share of the cores has its own
        "num_threads": torch.get_num_threads(),
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cache_dir, "aot", f"decode-block-{key}.bin")


def _closure_data() -> dict[str, object]:
    return {f"closure{i}": cell.cell_contents for i, cell in enumerate(run_block.__closure__ or ())}


def compile_block(example: tuple) -> Callable:
    """run_block compiled ahead of time for `example` = (block, hidden_states, kwargs) (inductor,
    symbolic sizes, one graph); its guards check every later call's inputs."""
    with torch._dynamo.config.patch(COMPILE_DYNAMO), torch._inductor.config.patch(COMPILE_INDUCTOR):
        return torch.compile(run_block, fullgraph=True, dynamic=True, options=PASSES).aot_compile((example, {}))


def save(compiled: Callable, path: str) -> None:
    """Written whole, then renamed: the ranks of a node start together, and one must never load
    another's half-written file (it would be taken as unusable, removed and rebuilt)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        compiled.save_compiled_function(tmp, external_data=_closure_data())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: str) -> Callable | None:
    """The artifact at `path` (None if there is none); a stale or unreadable one is logged and removed."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        compiled = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=run_block.__globals__,
                                                         external_data=_closure_data())
        stale = stale_sources(compiled)
    except Exception as exc:  # noqa: BLE001 - torch's loader raises many kinds; any means "rebuild"
        log.warning("compiled decode artifact %s unusable (%s: %s): compiling again", path, type(exc).__name__, exc)
        discard(path)
        return None
    if stale:
        log.info("compiled decode artifact %s was traced from other source (%s): compiling again", path,
                 ", ".join(sorted(stale)[:3]))
        discard(path)
        return None
    return compiled


def stale_sources(compiled) -> set[str]:
    """The modules whose traced lines changed since the artifact was built (torch records a checksum of
    every function Dynamo inlined; its own caching_precompile checks them the same way)."""
    import importlib

    from torch._dynamo.package import _hash_sourcelines

    stale = set()
    for src in compiled.source_info().inlined_sources:
        try:
            module = importlib.import_module(src.module)
            same = _hash_sourcelines(module, src.firstlineno, src.lastlineno) == src.checksum
        except Exception:  # noqa: BLE001 - a module gone or unreadable is a change too
            same = False
        if not same:
            stale.add(src.module)
    return stale


def discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
