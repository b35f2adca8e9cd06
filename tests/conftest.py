"""Fixtures shared by every test directory: the demo model, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    """A freshly built demo model (never the user's cache)."""
    from dpserve.engine.testing.demo_model import create_demo_model

    return create_demo_model(str(tmp_path_factory.mktemp("demo-model") / "model"))


@pytest.fixture(scope="session")
def metaspace_model_dir(tmp_path_factory) -> str:
    """The demo model with its SentencePiece-style (Metaspace) tokenizer, for the text
    paths that differ between tokenizer families (a decoder that drops a leading space)."""
    from dpserve.engine.testing.demo_model import create_demo_model

    return create_demo_model(str(tmp_path_factory.mktemp("metaspace-model") / "model"), tokenizer="metaspace")


# Lines of a server's log shown with a failing test: the last ones, and earlier ones that look like trouble.
_LOG_TAIL_LINES = 40
_LOG_TROUBLE = ("error", "exception", "traceback", "dead", "killed", "restart", "timed out")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the log tails of the servers it left running
    (a module-scoped server's log is gone once its fixture stops it)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from tests.server import DpServer, notable_lines

    for server in list(DpServer.running):
        lines = server.log(None).splitlines()
        head, tail = lines[:-_LOG_TAIL_LINES], lines[-_LOG_TAIL_LINES:]
        trouble = notable_lines("\n".join(head), _LOG_TROUBLE, _LOG_TAIL_LINES)
        text = "\n".join([*trouble, "...", *tail] if trouble else tail)
        report.sections.append((f"log of the server in {server.tmp}", text))
