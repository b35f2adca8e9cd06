#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU (written for an H200); run by hand:
#
#   benchmarks/gpu_check.sh [--out DIR] [--keep] [extra gpu_check.py options]
#
# Builds a random-weight ~1B-parameter Llama (bf16) locally, measures engine
# tok/s at batch 1 and 64 against transformers' generate(), then runs a short
# frontend benchmark at DP=1 (see benchmarks/gpu_check.py). Needs the project
# venv with a CUDA build of torch (`make setup TORCH_SPEC=torch`). The whole
# check is capped at 7 min 50 s, so it always ends within 8 minutes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
LIMIT_S="${DPSERVE_GPU_CHECK_LIMIT_S:-470}"

if [[ ! -x "$PY" ]]; then
    echo "no Python at $PY: run 'make setup TORCH_SPEC=torch' first, or set PYTHON" >&2
    exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi not found: this check needs an NVIDIA GPU" >&2
    exit 2
fi

echo "== $(date -Is) $(hostname): $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)' \
    || { echo "torch cannot see the GPU (a CPU-only torch build?)" >&2; exit 2; }

cd "$ROOT"
# --kill-after: a stuck child (a server that ignores SIGTERM) is killed 10 s later.
status=0
timeout --kill-after=10 "$LIMIT_S" "$PY" benchmarks/gpu_check.py "$@" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "gpu check: stopped at the ${LIMIT_S} s limit" >&2
fi
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader || true
exit "$status"
