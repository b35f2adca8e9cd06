"""DPSERVE_REQUIRE_SYSTEM_TESTS turns a system test's missing prerequisite from a skip
into a failure (tests/support.py), run through pytest itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("value", "outcome"), [("", "1 skipped"), ("0", "1 skipped"), ("1", "1 failed")])
def test_missing_prerequisite_skips_or_fails(tmp_path, value, outcome):
    (tmp_path / "test_needs_root.py").write_text(
        "from tests.support import skip_unless_required\n\n"
        "def test_it():\n    skip_unless_required('needs a thing this machine lacks')\n")
    env = {**os.environ, "DPSERVE_REQUIRE_SYSTEM_TESTS": value, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rsf", str(tmp_path)],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert outcome in result.stdout, result.stdout
    assert "needs a thing this machine lacks" in result.stdout


def test_a_stopped_test_server_leaves_no_temporary_folder_and_keeps_its_log(tmp_path):
    """tests/server.py's DpServer, around a stand-in for `dpserve serve` that
    writes the ports file, logs a line and waits for SIGTERM."""
    from tests.server import DpServer

    fake = tmp_path / "fake-python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, signal, sys, time\n"
        "path = sys.argv[sys.argv.index('--ports-file') + 1]\n"
        "print('fake node serving', flush=True)\n"
        "json.dump({'port': 1, 'supervisor_port': 2}, open(path, 'w'))\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "time.sleep(60)\n"
    )
    fake.chmod(0o755)
    srv = DpServer(str(tmp_path), python=str(fake))
    assert os.path.isdir(srv.tmp)
    srv.start(wait_ready=False)
    assert srv.port == 1 and "fake node serving" in Path(srv.log_path).read_text()
    assert srv.stop() == 0
    assert not os.path.exists(srv.tmp)
    assert "fake node serving" in srv.log()  # still readable after the folder went
    never = DpServer(str(tmp_path))
    never.stop()
    assert not os.path.exists(never.tmp)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py"))
def test_every_benchmark_answers_help(script):
    """Run as the README says (the venv's Python, from the repository root)."""
    result = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:500]
