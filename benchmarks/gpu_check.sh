#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU (written for an H200); run by hand:
#
#   benchmarks/gpu_check.sh fetch-wheels     here, with a package index: the wheels of dpserve's
#                                            dependencies that a bare CUDA image lacks, into .whl/
#   benchmarks/gpu_check.sh [--out DIR] [--keep] [extra gpu_check.py options]   on the GPU machine
#
# Builds a random-weight ~1B-parameter Llama (bf16) locally, measures engine
# tok/s at batch 1 and 64 against transformers' generate(), runs a short
# frontend benchmark at DP=1, then engine_realistic's 16-client throughput with
# dpserve's CUDA graphs, --enforce-eager and (when importable) vLLM on CUDA
# (see benchmarks/gpu_check.py). Python: $PYTHON, else the project venv with a
# CUDA torch (`make setup TORCH_SPEC=torch`), else the machine's python3 with
# its torch and transformers, .whl/'s wheels installed under /tmp and dpserve
# from this checkout (no install needed). The whole check is capped at
# 7 min 50 s, so it always ends within 8 minutes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIMIT_S="${DPSERVE_GPU_CHECK_LIMIT_S:-470}"
# What the CUDA image (torch, transformers, aiohttp, psutil, click, ... already there) lacks.
WHEELS=(pyzmq==27.3.0 msgspec==0.23.0 structlog==26.1.0 sdnotify==0.3.2)
WHEEL_DIR="$ROOT/.whl"

if [[ "${1:-}" == fetch-wheels ]]; then
    mkdir -p "$WHEEL_DIR"
    exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude)"
    [[ "$exclude" = /* ]] || exclude="$ROOT/$exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    # cp312 manylinux: the device image's Python is 3.12; sdnotify is a pure-Python sdist, built here.
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEEL_DIR" "${WHEELS[@]:0:3}"
    python3 -m pip wheel --no-deps -w "$WHEEL_DIR" "${WHEELS[3]}"
    ls -la "$WHEEL_DIR"
    echo "carry .whl with the device run (run's carry: [\".whl\"])"
    exit 0
fi

cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; }

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]] && cuda_torch "$ROOT/.venv/bin/python"; then
    PY="$ROOT/.venv/bin/python"
else
    PY="$(command -v python3 || true)"
fi
if [[ -z "$PY" ]]; then
    echo "no Python: set PYTHON, or run 'make setup TORCH_SPEC=torch'" >&2
    exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi not found: this check needs an NVIDIA GPU" >&2
    exit 2
fi

# dpserve from this checkout when the interpreter has none installed: "dpserve" is a namespace
# package of engine/ and daemons/ (pyproject's package-dir), so a folder of two links is enough.
if ! "$PY" -c 'import dpserve.engine' 2>/dev/null; then
    shim="$(mktemp -d /tmp/dpserve-shim.XXXXXX)"
    mkdir -p "$shim/dpserve"
    ln -s "$ROOT/engine" "$shim/dpserve/engine"
    ln -s "$ROOT/daemons" "$shim/dpserve/daemons"
    export PYTHONPATH="$shim:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -d "$WHEEL_DIR" ]] && ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
    site=/tmp/dpserve-gpu-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEEL_DIR"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
missing="$("$PY" -c '
import importlib.util
mods = ["torch", "transformers", "tokenizers", "safetensors", "jinja2", "aiohttp", "zmq", "msgspec", "click",
        "structlog", "psutil", "sdnotify", "prometheus_client"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))')"
if [[ -n "$missing" ]]; then
    echo "missing Python packages: $missing (run 'benchmarks/gpu_check.sh fetch-wheels' where an index is reachable, and carry .whl)" >&2
    exit 2
fi

echo "== $(date -Is) $(hostname): $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)' \
    || { echo "torch cannot see the GPU (a CPU-only torch build?)" >&2; exit 2; }

cd "$ROOT"
export PYTHONUNBUFFERED=1
# --kill-after: a stuck child (a server that ignores SIGTERM) is killed 10 s later.
status=0
timeout --kill-after=10 "$LIMIT_S" "$PY" benchmarks/gpu_check.py "$@" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "gpu check: stopped at the ${LIMIT_S} s limit" >&2
fi
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader || true
exit "$status"
