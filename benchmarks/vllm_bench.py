#!/usr/bin/env python3
"""vLLM's own client, `vllm bench serve`, as a benchmark client for dpserve and `vllm serve` alike.

    from benchmarks.vllm_bench import run_vllm_bench
    result = run_vllm_bench("http://127.0.0.1:8000", "demo", "/path/to/hf-model-dir",
                            input_len=32, output_len=16, concurrency=4, num_prompts=32)
    print(result.output_tok_per_s, result.ttft_ms["p50"], result.ok, result.error_count)

It runs `vllm bench serve` from vLLM's venv (explicit, else $DPSERVE_VLLM_VENV,
else common.DEFAULT_VLLM_VENV: the checkout's .venv-vllm that `make
setup-vllm` builds) against an OpenAI-compatible base URL: the random dataset
(--random-input-len / --random-output-len token ids, --random-range-ratio 0),
streamed /v1/completions (backend `openai`) or chat (`openai-chat`),
--ignore-eos so every answer has its full length, --max-concurrency clients,
--num-prompts requests (plus --num-warmups not counted). The tokenizer is a
local HF folder and HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1 are set, so
nothing is downloaded. The subprocess runs in its own process group, bounded
by `timeout`; on timeout, error, Ctrl-C or SIGTERM the whole group is killed.

The saved JSON result (--save-result) is read back into a `load.LoadResult`
holding the figures load.py also reports: output tok/s, req/s (completed /
duration), TTFT, ITL, TPOT and E2E latency (p50/p90/p99 and mean, ms),
completed (`ok`) and failed (`errors["failed"]`) counts, token totals. One
difference in definitions: vLLM's ITL is the gap between stream chunks as they
arrive (not divided by the tokens a chunk carries, as load.py does); TPOT is
the same in both, (E2E - TTFT) / (tokens - 1). The run is a fixed number of
requests, not load.py's timed window: `window_s` is vLLM's benchmark duration.
A missing venv raises VllmBenchUnavailable (callers skip or fall back to load.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DEFAULT_VLLM_VENV  # noqa: E402
from benchmarks.load import LoadResult  # noqa: E402

PERCENTILES = (50, 90, 99)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class VllmBenchUnavailable(RuntimeError):
    """No venv with a `vllm` executable: the vllm-bench client cannot run."""


class VllmBenchFailed(RuntimeError):
    """`vllm bench serve` exited non-zero, timed out, or left no readable result."""


def venv_candidates(venv: str | None = None) -> list[str]:
    if venv:
        return [venv]
    found = [os.environ.get("DPSERVE_VLLM_VENV"), DEFAULT_VLLM_VENV]
    return [v for v in dict.fromkeys(found) if v]


def find_vllm(venv: str | None = None) -> str:
    """The `vllm` executable of the first candidate venv that has one, else VllmBenchUnavailable."""
    tried = venv_candidates(venv)
    for v in tried:
        exe = os.path.join(v, "bin", "vllm")
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return exe
    raise VllmBenchUnavailable(f"vllm bench serve: no vLLM venv (no executable bin/vllm in {', '.join(tried)}); "
                               f"build one with `make setup-vllm` or benchmarks/setup_vllm.sh DIR, or pass --vllm-venv")


def available(venv: str | None = None) -> bool:
    try:
        find_vllm(venv)
        return True
    except VllmBenchUnavailable:
        return False


def build_command(exe: str, base_url: str, model: str, tokenizer: str, *, input_len: int, output_len: int,
                  concurrency: int, num_prompts: int, result_dir: str, result_filename: str,
                  backend: str = "openai", request_rate: float = math.inf, num_warmups: int = 0, seed: int = 0,
                  extra_args: Sequence[str] = ()) -> list[str]:
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    return [exe, "bench", "serve", "--backend", backend, "--base-url", base_url.rstrip("/"), "--endpoint", endpoint,
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf" if math.isinf(request_rate) else str(request_rate),
            "--num-warmups", str(num_warmups), "--seed", str(seed), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--result-dir", result_dir, "--result-filename", result_filename, "--disable-tqdm",
            *extra_args]


def _metric(data: dict, name: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{p}": data.get(f"p{p}_{name}_ms") for p in PERCENTILES}
    if out["p50"] is None:
        out["p50"] = data.get(f"median_{name}_ms")
    out["mean"] = data.get(f"mean_{name}_ms")
    return {k: (None if v is None else round(float(v), 3)) for k, v in out.items()}


def parse_result(data: dict) -> LoadResult:
    """A `vllm bench serve --save-result` JSON object as a LoadResult (the fields load.py also fills)."""
    if "completed" not in data or "duration" not in data:
        raise VllmBenchFailed(f"not a vllm bench serve result (keys: {sorted(data)[:12]})")
    completed, failed = int(data["completed"]), int(data.get("failed", 0) or 0)
    duration = float(data["duration"])
    errors = {"failed": failed} if failed else {}
    samples = [e for e in data.get("errors") or [] if e][:3]
    return LoadResult(
        model=str(data.get("model_id", "")),
        endpoint="chat" if data.get("backend") == "openai-chat" else "completions",
        stream=True,
        concurrency=int(data.get("max_concurrency") or 0),
        window_s=round(duration, 3),
        stopped_by="num_prompts",
        requests=completed + failed,
        ok=completed,
        errors=errors,
        error_samples={"failed": " | ".join(map(str, samples))[:500]} if samples else {},
        output_tokens=int(data.get("total_output_tokens", 0) or 0),
        prompt_tokens=int(data.get("total_input_tokens", 0) or 0),
        req_per_s=float(data.get("request_throughput", 0.0) or 0.0),
        output_tok_per_s=float(data.get("output_throughput", 0.0) or 0.0),
        latency_ms=_metric(data, "e2el"),
        ttft_ms=_metric(data, "ttft"),
        itl_ms=_metric(data, "itl"),
        tpot_ms=_metric(data, "tpot"),
    )


def load_result_file(path: str | os.PathLike) -> LoadResult:
    text = Path(path).read_text()
    try:
        return parse_result(json.loads(text.strip().splitlines()[-1] if text.strip() else "{}"))
    except json.JSONDecodeError as exc:
        raise VllmBenchFailed(f"{path}: not JSON: {exc}") from exc


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it after 10 s; reap."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    else:  # the leader is gone; anything it left in its group goes too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _tail(path: str, n: int = 2000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_vllm_bench(base_url: str, model: str, tokenizer: str, *, input_len: int, output_len: int,
                   concurrency: int, num_prompts: int, venv: str | None = None, backend: str = "openai",
                   request_rate: float = math.inf, num_warmups: int = 0, seed: int = 0, timeout: float = 900.0,
                   result_dir: str | None = None, env: dict[str, str] | None = None,
                   extra_args: Sequence[str] = (), log: Callable[[str], None] | None = None) -> LoadResult:
    """Run `vllm bench serve` once (see the module docstring) and return its figures as a LoadResult.

    The raw result JSON is kept in `result_dir` when given (else a temporary folder, removed).
    Raises VllmBenchUnavailable without a vLLM venv, VllmBenchFailed on a non-zero exit,
    a timeout (the process group is killed) or an unreadable result."""
    exe = find_vllm(venv)
    if not os.path.isdir(tokenizer):
        raise VllmBenchFailed(f"tokenizer {tokenizer!r} is not a local folder (nothing may be downloaded)")
    with tempfile.TemporaryDirectory(prefix="dpserve-vllm-bench-") as tmp:
        out_dir = result_dir or tmp
        os.makedirs(out_dir, exist_ok=True)
        name = f"vllm-bench-c{concurrency}-n{num_prompts}-{int(time.time() * 1000)}.json"
        cmd = build_command(exe, base_url, model, os.path.abspath(tokenizer), input_len=input_len,
                            output_len=output_len, concurrency=concurrency, num_prompts=num_prompts,
                            result_dir=out_dir, result_filename=name, backend=backend, request_rate=request_rate,
                            num_warmups=num_warmups, seed=seed, extra_args=extra_args)
        full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            full_env.pop(k, None)  # loopback servers; vLLM's aiohttp session trusts the environment
        log_path = os.path.join(tmp, "vllm-bench.log")
        if log:
            log(f"vllm bench serve: {base_url} model {model}, {num_prompts} prompts at concurrency {concurrency}, "
                f"input {input_len} / output {output_len} tokens")
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=full_env, cwd=tmp, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise VllmBenchFailed(f"vllm bench serve: no result after {timeout:.0f} s (killed); "
                                      f"log tail:\n{_tail(log_path)}") from None
            finally:  # also on KeyboardInterrupt / SystemExit (SIGTERM via common.exit_on_sigterm)
                _kill_group(proc)
        path = os.path.join(out_dir, name)
        if rc != 0 or not os.path.isfile(path):
            raise VllmBenchFailed(f"vllm bench serve exited {rc}{'' if os.path.isfile(path) else ', no result file'}; "
                                  f"log tail:\n{_tail(log_path)}")
        return load_result_file(path)


if __name__ == "__main__":
    from benchmarks.common import parser

    parser(__doc__, prog="benchmarks/vllm_bench.py").parse_args()
    print(__doc__)
