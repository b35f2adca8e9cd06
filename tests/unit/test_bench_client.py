"""benchmarks/vllm_bench.py: reading `vllm bench serve` results, the missing-venv error, the subprocess's
time bound. No network and no vLLM: `bin/vllm` is a fake shell script where one is needed.

tests/data/vllm_bench_result.json is a real `vllm bench serve --save-result` file (vLLM 0.x CPU build,
32 prompts, concurrency 4, random 32 input / 16 output tokens, --ignore-eos, against a dpserve node
serving the demo model on loopback)."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import vllm_bench  # noqa: E402
from benchmarks.vllm_bench import (  # noqa: E402
    VllmBenchFailed,
    VllmBenchUnavailable,
    build_command,
    find_vllm,
    load_result_file,
    parse_result,
    run_vllm_bench,
)

DATA = ROOT / "tests" / "data" / "vllm_bench_result.json"


def test_parse_saved_result():
    r = load_result_file(DATA)
    raw = json.loads(DATA.read_text())
    assert (r.ok, r.error_count, r.requests) == (32, 0, 32)
    assert r.output_tokens == 32 * 16  # --ignore-eos: every answer is full length
    assert r.output_tok_per_s == pytest.approx(raw["output_throughput"])
    assert r.req_per_s == pytest.approx(raw["request_throughput"])
    assert r.window_s == pytest.approx(raw["duration"], abs=1e-3)
    assert r.concurrency == 4 and r.stream and r.endpoint == "completions" and r.model == "demo"
    for name, d in (("ttft", r.ttft_ms), ("itl", r.itl_ms), ("tpot", r.tpot_ms), ("e2el", r.latency_ms)):
        assert d["p50"] == pytest.approx(raw[f"p50_{name}_ms"], abs=1e-3)
        assert d["p99"] == pytest.approx(raw[f"p99_{name}_ms"], abs=1e-3)
        assert 0 < d["p50"] <= d["p99"]
    assert r.tpot_ms["p50"] < r.latency_ms["p50"]
    json.dumps(r.to_dict())  # as callers put it in their JSON


def test_parse_failures_and_fallbacks():
    raw = json.loads(DATA.read_text())
    raw.update(completed=30, failed=2, errors=["", "HTTP 500", None, "timeout"])
    del raw["p50_ttft_ms"]  # --metric-percentiles without 50: the median stands in
    r = parse_result(raw)
    assert (r.ok, r.errors, r.requests) == (30, {"failed": 2}, 32)
    assert r.error_samples == {"failed": "HTTP 500 | timeout"}
    assert r.ttft_ms["p50"] == pytest.approx(raw["median_ttft_ms"], abs=1e-3)
    with pytest.raises(VllmBenchFailed):
        parse_result({"some": "thing"})


def test_missing_venv_raises_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSERVE_VLLM_VENV", str(tmp_path / "nope"))
    with pytest.raises(VllmBenchUnavailable, match="no vLLM venv"):
        find_vllm(str(tmp_path / "absent"))
    assert not vllm_bench.available(str(tmp_path / "absent"))
    with pytest.raises(VllmBenchUnavailable):
        run_vllm_bench("http://127.0.0.1:1", "demo", str(tmp_path), input_len=8, output_len=8, concurrency=1,
                       num_prompts=1, venv=str(tmp_path / "absent"))


def test_command_is_offline_and_complete():
    cmd = build_command("/v/bin/vllm", "http://127.0.0.1:8000/", "demo", "/m", input_len=32, output_len=16,
                        concurrency=4, num_prompts=32, result_dir="/r", result_filename="x.json")
    assert cmd[:3] == ["/v/bin/vllm", "bench", "serve"]
    opts = dict(zip(cmd[3::1], cmd[4::1]))
    assert opts["--base-url"] == "http://127.0.0.1:8000" and opts["--tokenizer"] == "/m"
    assert opts["--random-input-len"] == "32" and opts["--random-output-len"] == "16"
    assert opts["--max-concurrency"] == "4" and opts["--num-prompts"] == "32" and opts["--request-rate"] == "inf"
    assert "--ignore-eos" in cmd and "--save-result" in cmd and opts["--endpoint"] == "/v1/completions"
    chat = build_command("v", "u", "m", "t", input_len=1, output_len=1, concurrency=1, num_prompts=1,
                         result_dir="r", result_filename="f", backend="openai-chat")
    assert chat[chat.index("--endpoint") + 1] == "/v1/chat/completions"


def _fake_venv(tmp_path: Path, body: str) -> str:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "vllm"
    exe.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    exe.chmod(0o755)
    return str(venv)


def test_runs_fake_vllm_and_reads_its_result(tmp_path):
    venv = _fake_venv(tmp_path, f"""\
        while [ $# -gt 0 ]; do case "$1" in --result-dir) d=$2;; --result-filename) f=$2;; esac; shift; done
        [ "$HF_HUB_OFFLINE" = 1 ] && [ "$TRANSFORMERS_OFFLINE" = 1 ] || exit 3
        cp {DATA} "$d/$f"
        """)
    keep = tmp_path / "results"
    r = run_vllm_bench("http://127.0.0.1:1", "demo", str(tmp_path), input_len=32, output_len=16, concurrency=4,
                       num_prompts=32, venv=venv, timeout=60, result_dir=str(keep))
    assert r.ok == 32 and len(list(keep.glob("*.json"))) == 1


def test_failure_and_timeout_kill_the_process_group(tmp_path):
    venv = _fake_venv(tmp_path, f"""\
        echo boom
        if [ -e {tmp_path}/fail ]; then exit 2; fi
        sleep 300 &
        echo $! > {tmp_path}/child.pid
        wait
        """)
    (tmp_path / "fail").touch()
    with pytest.raises(VllmBenchFailed, match="(?s)exited 2.*boom"):
        run_vllm_bench("http://127.0.0.1:1", "demo", str(tmp_path), input_len=8, output_len=8, concurrency=1,
                       num_prompts=1, venv=venv, timeout=60)
    (tmp_path / "fail").unlink()
    t0 = time.monotonic()
    with pytest.raises(VllmBenchFailed, match="no result after"):
        run_vllm_bench("http://127.0.0.1:1", "demo", str(tmp_path), input_len=8, output_len=8, concurrency=1,
                       num_prompts=1, venv=venv, timeout=1)
    assert time.monotonic() - t0 < 30
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):
        try:  # gone, or a zombie waiting for a reaper that is not ours
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the fake vllm's child outlived the timeout")
