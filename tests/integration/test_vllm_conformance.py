"""vLLM's own OpenAI-entrypoint tests (vLLM 0.32.0's tests/entrypoints/openai, vendored in
tests/data/vllm_openai) against dpserve nodes on the demo chat model.

tests/data/vllm_openai/run.py starts a node for each of vLLM's server fixtures in place of
`vllm serve` and runs the tests unedited in the vLLM venv. expected.json holds the outcome of
each test on `vllm serve` with the same model (run.py --target vllm) and on dpserve: every test
that passes on vLLM must pass here, except the recorded gaps (each with its reason, see
tests/data/vllm_openai/RESULTS.md); a gap that starts to pass fails too, so the record follows.
A test recorded as "luck" on dpserve may go either way: its outcome is a sampled draw's (each says why).
Skips without the vLLM venv (DPSERVE_REQUIRE_VLLM=1 makes that a failure, as in CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import VLLM_REQUIRE_ENV, vllm_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm_openai"
# The files the suite runs (about 5 minutes on a 2-core machine); run.py runs them all by default.
FILES = [
    "chat_completion/test_chat.py",
    "chat_completion/test_chat_echo.py",
    "chat_completion/test_chat_logit_bias_validation.py",
    "chat_completion/test_enable_force_include_usage.py",
    "chat_completion/test_include_reasoning.py",
    "chat_completion/test_logprob_token_ids.py",
    "completion/test_completion.py",
    "models/test_models.py",
    "test_return_token_ids.py",
    "test_return_tokens_as_ids.py",
]


@pytest.fixture(scope="module")
def venv() -> str:
    venv = vllm_venv()
    probe = subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import pytest, pytest_asyncio"], capture_output=True)
    if probe.returncode != 0:
        reason = f"the vLLM venv {venv} lacks pytest / pytest-asyncio, which vLLM's tests need"
        if os.environ.get(VLLM_REQUIRE_ENV, "") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return venv


def test_vllm_openai_entrypoint_tests_pass_on_dpserve(venv):
    expected = json.loads((DATA / "expected.json").read_text())
    with tempfile.TemporaryDirectory(prefix="vllm-conformance-report-") as tmp:
        report = os.path.join(tmp, "dpserve.json")
        cmd = [sys.executable, str(DATA / "run.py"), "--target", "dpserve", "--venv", venv, "--report", report,
               "--timeout", "1100", *FILES]
        subprocess.run(cmd, check=False, timeout=1150)
        results = json.loads(Path(report).read_text())
    chosen = {k: v for k, v in expected.items() if any(f"/openai/{f}::" in k for f in FILES)}
    assert set(results) == set(chosen), f"tests ran that the record lacks, or the reverse: {set(results) ^ set(chosen)}"
    regressions, fixed = [], []
    for nodeid, record in sorted(chosen.items()):
        if record["vllm"] != "passed" or record["dpserve"] == "luck":
            continue
        outcome = results[nodeid]["outcome"]
        if record["dpserve"] == "passed" and outcome != "passed":
            regressions.append(f"{nodeid}: {outcome}: {results[nodeid]['reason']}")
        elif record["dpserve"] != "passed" and outcome == "passed":
            fixed.append(nodeid)
    assert not regressions, "passing on vllm serve, failing on dpserve:\n" + "\n".join(regressions)
    assert not fixed, "recorded gaps that pass now (update expected.json and RESULTS.md):\n" + "\n".join(fixed)
