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
