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
