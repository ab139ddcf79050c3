#!/usr/bin/env bash
# Create .venv (once) and install padfree with every extra, keeping an installed torch.
#
# - torch already importable (system site-packages or the venv): kept exactly as it is.
# - no torch and no NVIDIA GPU: the CPU wheel torch==2.13.0 (an unpinned torch pulls GBs of CUDA packages).
# - no torch and an NVIDIA GPU: the default (CUDA) torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${PADFREE_VENV:-.venv}
STAMP="$VENV/.padfree-installed"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/bootstrap.sh ]; then
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    # system site-packages stay visible so that a torch installed there is reused, not downloaded again
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/constraints.txt"
if installed=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    echo "torch==${installed}" > "$CONSTRAINTS"
    TORCH=()
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    : > "$CONSTRAINTS"
    TORCH=(torch)
else
    echo "torch==2.13.0" > "$CONSTRAINTS"
    TORCH=(torch==2.13.0)
fi
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "${TORCH[@]}" -e ".[${PADFREE_EXTRAS:-all,dev}]"
touch "$STAMP"
