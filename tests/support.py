"""What a test does when this machine cannot run it: skip, or fail where it must.

System and multinode tests need root, network namespaces and systemd-nspawn, so on a
developer's laptop they skip. CI sets DPSERVE_REQUIRE_SYSTEM_TESTS=1 where it is root
and installed their packages (.ci/run): there a missing prerequisite is a failure, so
a broken CI image cannot turn the suite green by skipping what it was meant to run.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ENV = "DPSERVE_REQUIRE_SYSTEM_TESTS"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


def skip_unless_required(reason: str) -> None:
    """pytest.skip(reason), or pytest.fail when the system tests are required here."""
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: this machine must run the system tests)", pytrace=False)
    pytest.skip(reason)


# ---------------------------------------------------------------- vLLM's engine (--engine vllm)

VLLM_REQUIRE_ENV = "DPSERVE_REQUIRE_VLLM"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vllm_venv() -> str:
    """The venv that holds vLLM and dpserve (`make setup-vllm`): $DPSERVE_VLLM_VENV, else .venv-vllm in the repo.

    vLLM pins its own versions of torch, transformers and llguidance, so it lives
    in a venv of its own, as users of `dpserve[vllm]` have it; skips (or fails,
    with DPSERVE_REQUIRE_VLLM=1, as CI sets it) when that venv is not there.
    """
    venv = os.environ.get("DPSERVE_VLLM_VENV") or os.path.join(REPO, ".venv-vllm")
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        reason = f"no vLLM venv at {venv} (make setup-vllm creates it)"
        if os.environ.get(VLLM_REQUIRE_ENV, "") == "1":
            pytest.fail(f"{reason} ({VLLM_REQUIRE_ENV}=1: this machine must run the vLLM engine tests)", pytrace=False)
        pytest.skip(reason)
    return venv
