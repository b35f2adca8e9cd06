"""Shared unit-test fixtures: the demo model, built once per session in a temp dir.

Imports of torch and transformers stay inside the fixtures, so test modules
that never ask for a model do not pay for them.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    """A freshly built demo model (never the user's cache)."""
    from dpserve.engine.demo_model import create_demo_model

    return create_demo_model(str(tmp_path_factory.mktemp("demo-model") / "model"))


@pytest.fixture(scope="session")
def loaded_demo_model(demo_model_dir):
    """The demo model loaded once on CPU in float32; engines in tests share it."""
    from dpserve.engine.config import EngineConfig
    from dpserve.engine.loader import load_model

    return load_model(EngineConfig(model=demo_model_dir, device="cpu", dtype="float32"))
