"""One shared DP=2 / api-server-count=2 server per test module that asks for it (stopped
when the module ends, so it does not sit on the 2 cores through later suites)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.server import DpServer

API_KEY = "test-key-123"
MAX_MODEL_LEN = 256
MAX_BODY = 65536

# One OpenMP thread per rank in the servers these tests start (they inherit it; the supervisor leaves an
# operator's OMP_NUM_THREADS alone): a DP 1 node's rank now takes every core (plan.rank_threads), and
# the demo model's matrices gain nothing from more threads, while on a busy 2-core CI machine OpenMP
# barriers across contended cores made forwards up to 100x slower (tests/unit/conftest.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def server(demo_model_dir):
    srv = DpServer(
        demo_model_dir,
        "--data-parallel-size", "2",
        "--api-server-count", "2",
        "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-body-bytes", str(MAX_BODY),
        "--max-num-seqs", "64",
        # Answers and logprobs are compared with transformers in float32; --dtype auto would
        # serve this float32 checkpoint in bfloat16 on CPUs with avx512_bf16 (as vLLM does).
        "--dtype", "float32",
        # The API tests run on exec'd API servers; the fault tests cover the default (prefork).
        "--api-server-launch", "exec",
    )
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def openai_schema():
    """OpenAI's published schemas (subset; see tests/data/NOTICE)."""
    import jsonschema

    schema = json.loads((Path(__file__).parent.parent / "data" / "openai-api-subset.schema.json").read_text())

    def validate(instance: dict, definition: str) -> None:
        ref = {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": f"#/$defs/{definition}"}
        jsonschema.validate(instance, ref, cls=jsonschema.Draft202012Validator)

    return validate
