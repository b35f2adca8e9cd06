"""Runs vLLM's own OpenAI-entrypoint tests (the vendored dist/tests, vLLM 0.32.0) against a server.

    python tests/data/vllm_openai/run.py --target dpserve|vllm [--report OUT.json] [FILE ...]

FILE is a path under tests/entrypoints/openai (all vendored files by default). The tree
is laid out in a temporary folder with adapter/utils.py as tests/utils.py (the
RemoteOpenAIServer that starts the target) and adapter/root_conftest.py as its root
conftest.py. The tree sits under dist/, a folder pytest does not recurse into, and has
no conftest.py of its own here: in this project's run, vLLM's `tests` package would shadow
this project's (which is a namespace package). The demo
model (tools chat template) is put in an offline Hugging Face cache under every model
name the tests ask for, so their tokenizer and config look-ups find it. pytest runs in
the vLLM venv (the tests import vLLM); dpserve runs from this interpreter's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
MODELS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen2-1.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "facebook/opt-125m",
          "HuggingFaceH4/zephyr-7b-beta")
# LoRA adapters the fixtures "download": empty snapshots (LoRA is left out on both servers).
ADAPTERS = ("charent/self_cognition_Alice", "Jackmin108/Qwen3-0.6B-Meow-LoRA", "Jackmin108/Qwen3-0.6B-Woof-LoRA",
            "peft-internal-testing/opt-125m-dummy-lora", "typeof/zephyr-7b-beta-lora")
SNAPSHOT = "0" * 40


def vendored_files() -> list[str]:
    base = HERE / "dist" / "tests" / "entrypoints" / "openai"
    return sorted(str(p.relative_to(base)) for p in base.rglob("test_*.py"))


def lay_out(work: Path) -> dict[str, str]:
    """The test tree, the demo model in an offline hub cache; returns the environment for pytest."""
    from dpserve.engine.testing.demo_model import MAX_POSITIONS, create_demo_model

    shutil.copytree(HERE / "dist" / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__", "ruff.toml"))
    shutil.copy(HERE / "adapter" / "utils.py", work / "tests" / "utils.py")
    shutil.copy(HERE / "adapter" / "root_conftest.py", work / "conftest.py")
    (work / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                                     "markers =\n    skip_global_cleanup\n    slow_test\n    cpu_test\n")
    model = Path(create_demo_model(str(work / "model"), chat="tools"))
    hub = work / "hf" / "hub"
    for name in MODELS + ADAPTERS:
        repo = hub / ("models--" + name.replace("/", "--"))
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
        snap = repo / "snapshots" / SNAPSHOT
        snap.mkdir(parents=True)
        for f in model.iterdir() if name in MODELS else ():
            (snap / f.name).symlink_to(f)
    return {"HF_HOME": str(work / "hf"), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CONFORMANCE_MAX_LEN": str(MAX_POSITIONS), "DPSERVE_PYTHON": sys.executable, "PYTHONPATH": str(work)}


def run(target: str, venv: str, files: list[str], report: str, timeout: float, logs: str | None = None) -> dict:
    """pytest on the files against the target; returns {nodeid: {outcome, reason}}."""
    with tempfile.TemporaryDirectory(prefix="vllm-conformance-") as tmp:
        work = Path(tmp)
        env = {**os.environ, **lay_out(work), "VLLM_CONFORMANCE_TARGET": target, "VLLM_CONFORMANCE_REPORT": report}
        if logs:
            os.makedirs(logs, exist_ok=True)
            env["VLLM_CONFORMANCE_LOGS"] = logs
        paths = [str(Path("tests/entrypoints/openai") / f) for f in files]
        cmd = [os.path.join(venv, "bin", "python"), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN",
               "--rootdir", str(work), "-c", str(work / "pytest.ini"), *paths]
        subprocess.run(cmd, cwd=work, env=env, timeout=timeout, check=False)
        return json.loads(Path(report).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("dpserve", "vllm"), required=True)
    parser.add_argument("--venv", default=os.environ.get("DPSERVE_VLLM_VENV") or str(REPO / ".venv-vllm"))
    parser.add_argument("--report", default=None)
    parser.add_argument("--logs", default=None, help="a folder to keep each server's log in")
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    report = args.report or f"vllm-openai-{args.target}.json"
    results = run(args.target, args.venv, args.files or vendored_files(), os.path.abspath(report), args.timeout, args.logs)
    counts: dict[str, int] = {}
    for entry in results.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    print(args.target, counts)


if __name__ == "__main__":
    main()
