"""Decode throughput of EngineCore against transformers' generate() on the same model.

Usage: python benchmarks/engine_bench.py [--model DIR] [--batch-sizes 1,32,64]
       [--new-tokens 64] [--prompt-len 16] [--threads N]
Without --model the demo model is built into a temp dir first. Every request
is greedy with ignore_eos, so each one produces exactly --new-tokens tokens;
generate() gets no EOS id for the same effect. Figures are printed, not
asserted: they vary with the machine and with whatever else runs on it.
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time

import torch
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.common.protocol import AddRequest, SamplingParams
from dpserve.engine.core import EngineCore
from dpserve.engine.loader import load_model
from dpserve.engine.testing.demo_model import create_demo_model


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(batch)]


def run_engine(loaded, config: EngineConfig, prompts: list[list[int]], new_tokens: int):
    engine = EngineCore.from_loaded(config, loaded)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        assert engine.add_request(AddRequest(str(i), prompt, params, time.time())) is None
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    return elapsed, [tokens[str(i)] for i in range(len(prompts))]


@torch.inference_mode()
def run_generate(model, prompts: list[list[int]], new_tokens: int, pad_token_id: int):
    # No EOS at all is generate()'s ignore_eos: min_new_tokens would instead forbid
    # EOS tokens, which the engine (like vLLM) still emits under ignore_eos. An
    # explicit eos_token_id=None is refilled from the model's defaults, so those go.
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: no padding needed
    try:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, pad_token_id=pad_token_id)
    finally:
        model.generation_config = saved
    elapsed = time.perf_counter() - start
    return elapsed, out[:, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local HF model dir (default: the demo model, built in a temp dir)")
    parser.add_argument("--batch-sizes", default="1,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: the loader's choice)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or create_demo_model(f"{tmp}/demo-model")
        config = EngineConfig(model=model_dir, max_num_seqs=max(256, *map(int, args.batch_sizes.split(","))))
        loaded = load_model(config)
        if args.threads:
            torch.set_num_threads(args.threads)
        pad = min(loaded.eos_token_ids, default=0)
        print(f"model {model_dir}: device {loaded.device}, {loaded.dtype}, torch threads {torch.get_num_threads()}")
        print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request, greedy, ignore_eos")

        warm = make_prompts(2, args.prompt_len, loaded.vocab_size, seed=1)
        run_engine(loaded, config, warm, 4)
        run_generate(loaded.model, warm, 4, pad)

        print(f"{'batch':>5} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>6} {'same tokens':>12}")
        for batch in map(int, args.batch_sizes.split(",")):
            prompts = make_prompts(batch, args.prompt_len, loaded.vocab_size)
            engine_s, engine_tokens = run_engine(loaded, config, prompts, args.new_tokens)
            gen_s, gen_tokens = run_generate(loaded.model, prompts, args.new_tokens, pad)
            total = batch * args.new_tokens
            same = sum(a == b for a, b in zip(engine_tokens, gen_tokens))
            print(f"{batch:>5} {total / engine_s:>13,.0f} {total / gen_s:>15,.0f} "
                  f"{gen_s / engine_s:>6.2f} {same:>6}/{batch:<5}")


if __name__ == "__main__":
    main()
