#!/usr/bin/env bash
# What no CPU run can show, on one CUDA GPU in about 8 minutes: the exactness matrix on CUDA, a packed step on a
# ~0.5B model, bench_training.py --device cuda; written as the gpu_check section of BENCHMARKS.md.
#
#   scripts/gpu_check.sh                    # on a GPU machine: writes BENCHMARKS.md's gpu_check section
#   scripts/gpu_check.sh --dry-run          # anywhere: every step's setup on the CPU, smallest sizes, a temp file
#   scripts/gpu_check.sh --wheels DIR ...   # first install the wheels in DIR (no index) into a scratch site dir
#
# Without CUDA the run falls back to the dry run. Other options go to scripts/gpu_check.py (--steps, --budget
# STEP=SECONDS, --bench-args, --output). The environment: PYTHON (default: .venv/bin/python, else python3),
# PADFREE_DATA (bench_training's data directory), PADFREE_CACHE_DIR (where the converted tokenizer is cached).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

args=()
wheels=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) wheels="${2:-}"; shift 2 || { echo "gpu_check.sh: --wheels needs a directory" >&2; exit 2; } ;;
        *) args+=("$1"); shift ;;
    esac
done

py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

if [ -n "$wheels" ]; then
    site="${TMPDIR:-/tmp}/gpu_check_site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/*.whl || { echo "gpu_check.sh: installing the wheels of $wheels failed" >&2; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$py" scripts/gpu_check.py ${args[@]+"${args[@]}"}
