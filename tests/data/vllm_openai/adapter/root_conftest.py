"""Root conftest of the laid-out vLLM test tree (run.py copies it there as conftest.py): each test's
outcome goes to $VLLM_CONFORMANCE_REPORT as JSON (nodeid -> outcome, its first error lines)."""

from __future__ import annotations

import json
import os

_results: dict[str, dict] = {}


def pytest_configure(config):
    config.option.asyncio_mode = "strict"


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "reason": ""})
    if report.failed and entry["outcome"] != "failed":
        text = str(report.longrepr) if report.longrepr else ""
        lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-1:]
        entry.update(outcome="failed" if report.when == "call" else "error", reason=" | ".join(lines[:3])[:400])
    elif report.skipped:
        entry.update(outcome="skipped", reason=str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "")


def pytest_sessionfinish(session):
    path = os.environ.get("VLLM_CONFORMANCE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
