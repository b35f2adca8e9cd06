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
