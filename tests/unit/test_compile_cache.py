"""compile_cache.settle_vec_isa: inductor's vector-ISA probe runs once per machine, and its record is trusted
only for the same CPU, compiler and torch, only when every ISA passed, never over the user's setting.

inductor's list function is replaced by a fake that answers like it (probing, counted, when
config.cpp.vec_isa_ok is None; from the CPU flags when True), so no probe runs here.
"""

from __future__ import annotations

import json

import pytest
from dpserve.engine import compile_cache
from torch._inductor import config, cpu_vec_isa


class FakeIsaList:
    def __init__(self, probed: list[str], flagged: list[str]) -> None:
        self.probed, self.flagged, self.num_probes = probed, flagged, 0

    def __call__(self):
        if config.cpp.vec_isa_ok is None:
            self.num_probes += 1
            return list(self.probed)
        return list(self.flagged)

    def cache_clear(self) -> None:
        pass


@pytest.fixture
def isa(monkeypatch):
    fake = FakeIsaList(["avx512", "avx2"], ["avx512", "avx2"])
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", fake)
    with config.patch({"cpp.vec_isa_ok": None}):  # restored after the test
        yield fake


def test_probe_once_then_trust_the_record(isa, tmp_path):
    assert compile_cache.settle_vec_isa(str(tmp_path)) == "probed"
    assert isa.num_probes == 1 and config.cpp.vec_isa_ok is True  # the compile sees the same setting as later starts
    record = json.loads((tmp_path / compile_cache.RECORD_NAME).read_text())
    assert record["valid"] == ["avx512", "avx2"] and record["key"] == compile_cache.machine_key()
    config.cpp.vec_isa_ok = None  # a new process
    assert compile_cache.settle_vec_isa(str(tmp_path)) == "recorded"
    assert isa.num_probes == 1 and config.cpp.vec_isa_ok is True


def test_a_record_of_another_machine_is_probed_again(isa, tmp_path, monkeypatch):
    compile_cache.settle_vec_isa(str(tmp_path))
    config.cpp.vec_isa_ok = None
    monkeypatch.setattr(compile_cache, "machine_key", lambda: "another cpu or compiler")
    assert compile_cache.settle_vec_isa(str(tmp_path)) == "probed"
    assert isa.num_probes == 2


def test_an_isa_that_fails_its_probe_keeps_inductor_probing(isa, tmp_path):
    isa.probed = ["avx2"]  # the compiler cannot build AVX-512 code, though the CPU has it
    assert compile_cache.settle_vec_isa(str(tmp_path)) == "unsettled"
    assert config.cpp.vec_isa_ok is None and not (tmp_path / compile_cache.RECORD_NAME).exists()


def test_a_stale_record_is_not_trusted(isa, tmp_path):
    (tmp_path / compile_cache.RECORD_NAME).write_text(json.dumps({"key": compile_cache.machine_key(), "valid": ["avx2"]}))
    assert compile_cache.settle_vec_isa(str(tmp_path)) == "probed"
    assert isa.num_probes == 1


def test_the_users_setting_wins(isa, tmp_path):
    config.cpp.vec_isa_ok = False  # TORCHINDUCTOR_VEC_ISA_OK=0
    assert compile_cache.settle_vec_isa(str(tmp_path)) == "user"
    assert config.cpp.vec_isa_ok is False and isa.num_probes == 0
