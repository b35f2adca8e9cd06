"""What a restarted rank reuses of its compile beyond inductor's cache: the CPU's vector-ISA probe.

Before inductor compiles or loads CPU code it probes which vector ISAs (AVX2,
AVX-512, AMX, ...) this machine can build and run: one C++ build and one child
Python that dlopens the result per ISA, ~2.9 s of a 5 s warm-cache start
(benchmarks/RESULTS.md). The answer only changes with the CPU, the compiler or
torch, so it is recorded under the compile cache dir once probed, and a later
start trusts the record (inductor's own switch, config.cpp.vec_isa_ok). Must
never trust a record written for another CPU, compiler or torch, nor override
a TORCHINDUCTOR_VEC_ISA_OK the user set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile

import torch

log = logging.getLogger(__name__)

RECORD_NAME = "dpserve-vec-isa.json"


def machine_key() -> str:
    """A digest of what the probe's answer depends on: torch, the C++ compiler inductor
    runs (its path, size and mtime) and the CPU's model and feature flags."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or ""
    parts = [torch.__version__, platform.machine(), compiler]
    if compiler:
        st = os.stat(os.path.realpath(compiler))
        parts += [str(st.st_size), str(st.st_mtime_ns)]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            parts += sorted({line.strip() for line in f if line.startswith(("flags", "model name", "Features"))})
    except OSError:
        parts.append("no /proc/cpuinfo")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _valid_isas(trust: bool | None) -> list[str]:
    """inductor's list of usable vector ISAs with its probe (trust None) or from the CPU flags alone (True)."""
    from torch._inductor import config, cpu_vec_isa

    config.cpp.vec_isa_ok = trust
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def settle_vec_isa(cache_dir: str) -> str:
    """Fix config.cpp.vec_isa_ok before the compile, the same way on every start of this machine
    (it is part of inductor's cache key): True when every ISA the CPU reports passed the probe,
    from the record when there is one for this machine, else by probing now and recording.
    Returns how: "user" (the environment set it), "recorded", "probed" or "unsettled"
    (some ISA failed its probe: inductor keeps probing at every start)."""
    from torch._inductor import config

    if config.cpp.vec_isa_ok is not None:
        return "user"
    path = os.path.join(cache_dir, RECORD_NAME)
    key = machine_key()
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}
    if record.get("key") == key and _valid_isas(True) == record.get("valid"):
        return "recorded"
    probed = _valid_isas(None)
    flagged = _valid_isas(True)
    if probed != flagged:
        log.info("vector ISAs %s passed inductor's probe of %s: it probes at every start", probed, flagged)
        _valid_isas(None)
        return "unsettled"
    _write_json(path, {"key": key, "valid": probed, "torch": torch.__version__})
    return "probed"


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".vec-isa-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not record the vector-ISA probe in %s: %s", path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def build_library(directory: str, name: str, source: str, march: tuple[str, ...] = ("-march=native",)) -> None:
    """Build a C++ operator library from `source` in `directory` (unless built there already from the same
    source) with torch.utils.cpp_extension and load it into this process (its TORCH_LIBRARY registers the
    ops). Raises when it cannot be built (no ninja, a compiler error): callers keep their PyTorch path."""
    from torch.utils import cpp_extension

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.cpp")
    built = os.path.join(directory, f"{name}.so")
    same = os.path.exists(path) and open(path, encoding="utf-8").read() == source
    if same and os.path.exists(built) and os.path.getmtime(built) >= os.path.getmtime(path):
        torch.ops.load_library(built)  # a restart: no ninja run (cpp_extension.load would check the build)
        return
    if not same:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(source)
        os.replace(tmp, path)
    cpp_extension.load(name=name, sources=[path], build_directory=directory,
                       extra_cflags=["-O3", *march, "-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)


def load_op_library(name: str, source: str, switch: str, fallback: str, cache_dir: str | None,
                    registered: bool = False) -> bool:
    """Build `source` once per machine (under the compile cache, keyed by machine_key: -march=native)
    and load it; False, logged, where it cannot be had: switched off (`switch`=0), no C++ compiler or
    ninja, a failed build. `fallback` says what runs instead; `registered`: its ops are in this process
    already (a test's load under another cache dir), nothing to build."""
    if os.environ.get(switch, "1") == "0":
        log.info("%s (%s=0)", fallback, switch)
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        log.warning("no C++ compiler on PATH: %s", fallback)
        return False
    if registered:
        return True
    if cache_dir is None:
        from dpserve.engine.compiled import compile_cache_dir

        cache_dir = compile_cache_dir()
    directory = os.path.join(cache_dir, "kernels", machine_key()[:16])
    try:
        build_library(directory, name, source)
    except Exception as exc:  # noqa: BLE001 - a missing ninja, a failed build: the caller's PyTorch path serves
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        why = next((line for line in lines if "error" in line.lower()), lines[-1])
        log.warning("%s could not be built in %s (%s): %s", name, directory, why.strip(), fallback)
        return False
    return True
