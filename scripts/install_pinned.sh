#!/usr/bin/env bash
# Install packages into one venv at pinned versions, fast: uv when it can be had, pip otherwise.
#
#   scripts/install_pinned.sh VENV_PYTHON CONSTRAINTS BUILD_PINS REQUIREMENT...
#
# uv resolves and installs the ~90 packages of `.[all,dev]` in ~20 s where pip takes ~5 minutes on a 2-core
# machine (downloads in parallel, no per-package subprocesses). uv itself comes from the same pins (BUILD_PINS holds
# `uv==`), installed into the venv by pip. Torch is never installed here: the caller installs it first with pip (pip
# finds the local CPU wheel that uv does not look for) and puts its version in CONSTRAINTS, so uv keeps it. Where uv
# cannot be installed (an index without it) or fails, pip does the same job with the same constraints.
set -euo pipefail
PY=$1 CONSTRAINTS=$2 BUILD_PINS=$3
shift 3
UV="$(dirname "$PY")/uv"
if [ "${PADFREE_NO_UV:-0}" != 1 ] && { [ -x "$UV" ] || "$PY" -m pip install --quiet -c "$BUILD_PINS" uv >/dev/null 2>&1; }; then
    if "$UV" pip install --python "$PY" --quiet -c "$CONSTRAINTS" --build-constraints "$BUILD_PINS" "$@"; then
        exit 0
    fi
    echo "install_pinned: uv failed; installing with pip instead" >&2
fi
"$PY" -m pip install --quiet -c "$CONSTRAINTS" --build-constraint "$BUILD_PINS" "$@"
