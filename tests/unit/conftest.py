"""Unit-test fixtures: the demo model loaded once per session.

`demo_model_dir` (the freshly built demo model) comes from tests/conftest.py.
Imports of torch and transformers stay inside the fixture, so test modules
that never ask for a model do not pay for them.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def loaded_demo_model(demo_model_dir):
    """The demo model loaded once on CPU in float32; engines in tests share it."""
    import torch
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.loader import load_model

    # One intra-op thread (the loader honours OMP_NUM_THREADS): the demo model's
    # matrices are too small to gain from more, and on a busy CI machine OpenMP
    # barriers across contended cores made each forward up to 100x slower.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        loaded = load_model(EngineConfig(model=demo_model_dir, device="cpu", dtype="float32"))
    assert torch.get_num_threads() == 1
    return loaded
