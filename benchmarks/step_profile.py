#!/usr/bin/env python3
"""Where one engine step's time goes: a decode step and a prefill chunk, broken down with torch.profiler.

    python benchmarks/step_profile.py [--model-dir DIR] [--batch 1 16 64] [--dtype bfloat16 float32]
                                      [--steps N] [--enforce-eager] [--json]

With the compiled decode (the default for this model), each decode row also
gives the eager step time and, when the C++ attention kernel is built, the compiled
step with its pure-PyTorch attention instead, alternating in the same run.

The model is the realistic 135M-class shape (`dpserve demo-model --size small`,
random weights; the engine_realistic.py model). The engine core runs in this
process (no sockets): B requests with 70-token prompts are prefilled, decoded
32 tokens, then N decode steps are profiled (each step: every sequence gains
one token, context ~100). The prefill row is one 512-token prompt's first chunk.

Buckets (self CPU time of every op, filed under the innermost labelled region):
matmul (the projections and MLP), lm_head, attention write (the new keys and
values into the cache), attention gather (index_select copies of cached K/V),
attention compute (SDPA and its kernels), other forward ops (norms, rotary,
activations, embedding, masks), compiled code (inductor's kernels and their
wrapper, with the compiled decode), python (time inside the forward, attention
and runner regions not spent in any op: Python and dispatch), runner packing
(building the step's index tensors), sampler, output path (postprocess),
scheduler. Shares are of the profiled step; `step ms` is measured without the
profiler (the profiler's own per-op cost inflates python).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from dpserve.engine import paged_attention_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.common import begin, machine_info, parser, render  # noqa: E402
from benchmarks.engine_realistic import small_model_dir  # noqa: E402

BUCKETS = ("matmul", "lm_head", "attn write", "attn gather", "attn compute", "other ops", "compiled code", "python",
           "runner packing", "sampler", "output path", "scheduler")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_addmm_activation",
              "mkldnn::_linear_pointwise", "dpserve::linear"}
LABELS = ("step:schedule", "step:runner", "step:forward", "step:attention", "step:lm_head", "step:sample",
          "step:postprocess")


def _wrap(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)


def build_engine(model_dir: str, dtype: str, enforce_eager: bool):
    from dpserve.engine import attention, hf_compat
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.core import EngineCore
    from dpserve.engine.loader import load_model

    config = EngineConfig(model=model_dir, device="cpu", dtype=dtype, max_model_len=2048, max_num_seqs=256,
                          kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False, enforce_eager=enforce_eager)
    loaded = load_model(config)
    # Labels inside the forward go in before the compile traces it (inside compiled code they are dropped).
    _wrap(loaded.model.get_output_embeddings(), "forward", "step:lm_head")
    inner = attention.paged_attention

    def labelled(*a, **k):
        with record_function("step:attention"):
            return inner(*a, **k)

    hf_compat.register_attention(attention.ATTN_IMPLEMENTATION, labelled)
    engine = EngineCore.from_loaded(config, loaded)
    print(f"{dtype}: compiled decode {engine.describe()['compiled_decode_s']} s", file=sys.stderr, flush=True)
    _wrap(engine.scheduler, "schedule", "step:schedule")
    _wrap(engine.runner, "execute", "step:runner")
    _wrap(engine.runner, "_forward", "step:forward")
    _wrap(engine, "_sample", "step:sample")
    _wrap(engine, "_postprocess", "step:postprocess")
    if engine.runner.compiled is not None:  # its packing counts as the forward's python
        _wrap(engine.runner, "_execute_compiled", "step:forward")
    return engine


def add(engine, n: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    from dpserve.engine.common.protocol import AddRequest, SamplingParams

    for i in range(n):
        ids = [(97 + 13 * i + 7 * j) % 40000 + 100 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        refused = engine.add_request(AddRequest(request_id=f"{tag}{i}", prompt_token_ids=ids, params=params,
                                      arrival_time=time.time()))
        assert refused is None, refused


def bucket_of(name: str, label: str | None) -> str:
    if name.startswith("dpserve_kernels::"):  # the C++ paged-attention kernel (inside the compiled block)
        return "attn compute"
    if "Compiled" in name or "cpp_fused" in name or "inductor" in name.lower():
        return "compiled code"
    if name.startswith("step:"):
        return {"step:schedule": "scheduler", "step:sample": "sampler", "step:postprocess": "output path",
                "step:runner": "runner packing"}.get(name, "python")
    if label == "step:schedule":
        return "scheduler"
    if label == "step:sample":
        return "sampler"
    if label == "step:postprocess":
        return "output path"
    if label == "step:runner":
        return "runner packing"
    if label == "step:lm_head":
        return "lm_head"
    if label == "step:attention":
        if name in ("aten::index_copy_", "aten::index_put_"):
            return "attn write"
        if name in ("aten::index_select", "aten::gather"):
            return "attn gather"
        if "scaled_dot_product" in name or "flash" in name or name in MATMUL_OPS or name == "aten::_softmax":
            return "attn compute"
        return "other ops"
    if name in MATMUL_OPS:
        return "matmul"
    return "other ops"


def breakdown(prof, steps: int) -> dict[str, float]:
    """Self CPU microseconds per bucket, per step."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        label, p = None, ev.cpu_parent
        while p is not None:
            if p.name in LABELS:
                label = p.name
                break
            p = p.cpu_parent
        if ev.name.startswith("step:") and ev.name not in LABELS:
            continue
        out[bucket_of(ev.name, label)] += ev.self_cpu_time_total / steps
    return out


def run_steps(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1000)
    return times


def measure(engine, kind: str, batch: int, steps: int) -> dict:
    """Bring `engine` to the phase, time `steps` steps without and with the profiler."""
    if kind == "prefill":
        wall = []
        for r in range(steps + 1):  # the first is warm-up
            add(engine, 1, 512, 1, f"p{r}-")
            wall += run_steps(engine, 1)
        add(engine, 1, 512, 1, "p-profiled")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        while engine.has_unfinished():
            engine.step()
        return {"step_ms": statistics.median(wall[1:]), "buckets": breakdown(prof, 1)}
    add(engine, batch, 70, 32 + 6 * steps + 8, f"d{batch}-")
    while engine.num_waiting or any(s.num_computed_tokens < 100 for s in engine._requests.values()):
        engine.step()
    wall, eager, pytorch_attn = [], [], []
    compiled = engine.runner.compiled
    kernel_state = paged_attention_kernel._state
    with_kernel = compiled is not None and paged_attention_kernel.loaded()
    for _ in range(2):  # alternating, so the machine's load hits all alike
        wall += run_steps(engine, steps)
        if compiled is not None:
            engine.runner.compiled = None
            eager += run_steps(engine, steps)
            engine.runner.compiled = compiled
        if with_kernel:  # the compiled decode with its pure-PyTorch attention (compiled once more, then cached)
            kernel_state["loaded"] = False
            try:
                pytorch_attn += run_steps(engine, steps)
            finally:
                kernel_state["loaded"] = True
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(engine, steps)
    assert engine.num_step_errors == 0, "a step failed"
    engine.abort_requests(list(engine._requests))
    got = {"step_ms": statistics.median(wall), "buckets": breakdown(prof, steps)}
    if eager:
        got["eager_step_ms"] = statistics.median(eager)
    if pytorch_attn:
        got["pytorch_attn_step_ms"] = statistics.median(pytorch_attn[1:])  # the first one compiles
    return got


def main(argv=None) -> int:
    p = parser(__doc__, model_dir=True, json=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--dtype", nargs="+", default=None, help="default: bfloat16 (when the CPU has it) and float32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--enforce-eager", action="store_true", help="the eager forward (default: the engine's compiled decode)")
    args, run = begin(p, argv)
    from dpserve.engine.loader import fast_bf16

    dtypes = args.dtype or (["bfloat16", "float32"] if fast_bf16(torch.device("cpu")) else ["float32"])
    model = small_model_dir(args.model_dir)
    results: dict = {"machine": machine_info(), "threads": torch.get_num_threads(), "rows": []}
    for dtype in dtypes:
        engine = build_engine(model, dtype, args.enforce_eager)
        cases = [("decode", b) for b in args.batch] + [("prefill", 512)]
        for kind, batch in cases:
            got = measure(engine, kind, batch, args.steps)
            row = {"dtype": dtype, "phase": kind, "batch": batch, **got}
            results["rows"].append(row)
            eager = f" (eager {got['eager_step_ms']:.1f} ms, alternating)" if "eager_step_ms" in got else ""
            if "pytorch_attn_step_ms" in got:
                eager += f" (compiled, PyTorch attention {got['pytorch_attn_step_ms']:.1f} ms)"
            print(f"{dtype} {kind} {batch}: {got['step_ms']:.1f} ms{eager}", file=sys.stderr, flush=True)
    table = []
    for r in results["rows"]:
        total = sum(r["buckets"].values()) or 1.0
        shares = [f"{100 * r['buckets'].get(b, 0.0) / total:.0f}" for b in BUCKETS]
        others = [f"{r[k]:.1f}" if k in r else "-" for k in ("eager_step_ms", "pytorch_attn_step_ms")]
        table.append([r["dtype"], f"{r['phase']} {r['batch']}", f"{r['step_ms']:.1f}", *others, *shares])
    if args.json:
        print(json.dumps(run.info(**results)))
    else:
        print(f"threads {results['threads']}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}; "
              f"shares in % of the profiled step (self CPU time)")
        print(render(["dtype", "step", "step ms", "eager ms", "PyTorch attn ms", *BUCKETS], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
