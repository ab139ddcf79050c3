#!/usr/bin/env bash
# Create .venv (once) and install padfree with every extra at the pinned versions, keeping an installed torch.
#
# - every package but torch: the exact versions of constraints/ci.txt (PADFREE_CONSTRAINTS picks another file:
#   `make test-floor` uses constraints/floor.txt), so a release tomorrow cannot change what CI installs today.
# - torch already importable (system site-packages or the venv): kept exactly as it is; when it is not the torch the
#   pins were resolved with, the pins of torch's own requirements (sympy, networkx, ...) give way to it.
# - no torch and no NVIDIA GPU: the CPU wheel torch==2.13.0 (an unpinned torch pulls GBs of CUDA packages).
# - no torch and an NVIDIA GPU: the default (CUDA) wheel of the same version, torch==2.13.0 from PyPI.
# The install re-runs whenever pyproject.toml, this script, the constraints file or the extras change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${PADFREE_VENV:-.venv}
PINS=${PADFREE_CONSTRAINTS:-constraints/ci.txt}
EXTRAS=${PADFREE_EXTRAS:-all,dev}
PINNED_TORCH=2.13.0
STAMP="$VENV/.padfree-installed"

INPUTS="$(cat pyproject.toml scripts/bootstrap.sh "$PINS" | sha256sum | cut -d' ' -f1) $PINS [$EXTRAS]"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INPUTS" ]; then
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    # system site-packages stay visible so that a torch installed there is reused, not downloaded again;
    # PADFREE_SYSTEM_SITE=0 hides them (test-floor: only the pinned versions, no system scipy or pytest plugin)
    if [ "${PADFREE_SYSTEM_SITE:-1}" = 0 ]; then
        "$PYTHON" -m venv "$VENV"
    else
        "$PYTHON" -m venv --system-site-packages "$VENV"
    fi
fi
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/constraints.txt"  # torch's line, then the pins
if installed=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    echo "torch==${installed}" > "$CONSTRAINTS"
    if [ "${installed%%+*}" = "$PINNED_TORCH" ]; then
        cat "$PINS" >> "$CONSTRAINTS"
    else
        "$PY" - "$PINS" >> "$CONSTRAINTS" <<'PYEOF'
import importlib.metadata as md, re, sys
torch_needs = {re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0].lower().replace("_", "-") for r in md.requires("torch") or []}
for line in open(sys.argv[1]):
    name = re.split(r"[ ;<>=!~\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
    if name not in torch_needs:
        sys.stdout.write(line)
PYEOF
    fi
    TORCH=()
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    cat "$PINS" > "$CONSTRAINTS"
    TORCH=("torch==${PINNED_TORCH}")
else
    { echo "torch==${PINNED_TORCH}"; cat "$PINS"; } > "$CONSTRAINTS"
    TORCH=("torch==${PINNED_TORCH}")
fi
"$PY" -m pip install --quiet -c "$PINS" pip
if [ ${#TORCH[@]} -gt 0 ]; then  # pip alone finds the local CPU wheel
    "$PY" -m pip install --quiet -c "$CONSTRAINTS" "${TORCH[@]}"
fi
bash scripts/install_pinned.sh "$PY" "$CONSTRAINTS" "$PINS" -e ".[${EXTRAS}]"
echo "$INPUTS" > "$STAMP"
