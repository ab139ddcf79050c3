#!/usr/bin/env bash
# The package a user installs, checked as a user gets it:
#   1. the sdist from this checkout, then the wheel from the unpacked sdist (what `python -m build` does), through
#      setuptools' own build hooks with the pinned setuptools of the build venv (no download, no build isolation);
#   2. the wheel holds every file of src/padfree that git tracks (code and the data the library reads at run time);
#   3. a venv of its own (no system site-packages, the checkout nowhere on the path; build/wheel-check-venv, made
#      afresh when pyproject.toml or the pins change) gets the wheel with every extra: torch==2.13.0 as
#      scripts/bootstrap.sh installs it where there is no torch, every other package at the versions of
#      constraints/ci.txt;
#   4. there, from an empty directory: the README's example (a doctest) and `padfree --help`.
# PADFREE_BUILD_PYTHON: the interpreter with setuptools (default .venv/bin/python, made by `make setup`);
# PYTHON: the interpreter of the fresh venv (default python3); PADFREE_CONSTRAINTS: the pins (default constraints/ci.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_PY=${PADFREE_BUILD_PYTHON:-.venv/bin/python}
BUILD_PY="$(cd "$(dirname "$BUILD_PY")" && pwd)/$(basename "$BUILD_PY")"  # absolute, the venv's link kept
PYTHON=${PYTHON:-python3}
PINS=${PADFREE_CONSTRAINTS:-constraints/ci.txt}
PINNED_TORCH=2.13.0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS
step() { echo "check_wheel: $1 ($((SECONDS - start)) s)"; }

# 1. sdist, then the wheel built from it: a file the sdist forgets is missing from the wheel too
mkdir "$WORK/dist" "$WORK/sdist"
"$BUILD_PY" -c 'import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))' "$WORK/dist" \
    > "$WORK/sdist.name"
tar -xzf "$WORK/dist/$(tail -n 1 "$WORK/sdist.name")" -C "$WORK/sdist"
(cd "$WORK"/sdist/padfree-* &&
 "$BUILD_PY" -c 'import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))' \
     "$WORK/dist" > "$WORK/wheel.name")
WHEEL="$WORK/dist/$(tail -n 1 "$WORK/wheel.name")"
step "built $(basename "$WORK"/dist/*.tar.gz) and $(basename "$WHEEL")"

# 2. every tracked file under src/padfree is in the wheel (compiled caches aside)
git ls-files src/padfree | sed 's|^src/||' | sort > "$WORK/tracked"
"$BUILD_PY" -c 'import sys, zipfile; print("\n".join(sorted(zipfile.ZipFile(sys.argv[1]).namelist())))' "$WHEEL" \
    > "$WORK/shipped"
missing=$(comm -23 "$WORK/tracked" "$WORK/shipped")
if [ -n "$missing" ]; then
    echo "check_wheel: the wheel lacks files the library ships:" >&2
    echo "$missing" >&2
    exit 1
fi
step "the wheel holds all $(wc -l < "$WORK/tracked") files of src/padfree"

# 3. a venv that sees neither the checkout nor the system's packages, made afresh whenever what it was made from
#    changes (pyproject.toml, the pins; on a clean clone: every time) and otherwise kept, with only
#    padfree reinstalled from the new wheel
VENV="$ROOT/build/wheel-check-venv"
VPY="$VENV/bin/python"
STAMP="$VENV/.made-from"
INPUTS="$(cat pyproject.toml "$PINS" | sha256sum | cut -d' ' -f1) $PYTHON"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$INPUTS" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    fresh="a fresh venv"
else
    fresh="the kept venv"
fi
{ echo "torch==${PINNED_TORCH}"; grep -v '^torch==' "$PINS"; } > "$WORK/constraints.txt"
"$VPY" -m pip install --quiet -c "$PINS" pip
"$VPY" -m pip install --quiet --force-reinstall --no-deps "$WHEEL"
"$VPY" -m pip install --quiet -c "$WORK/constraints.txt" "torch==${PINNED_TORCH}"  # pip finds the local CPU wheel
bash "$ROOT/scripts/install_pinned.sh" "$VPY" "$WORK/constraints.txt" "$PINS" "${WHEEL}[all]"
"$VPY" -m pip check > "$WORK/pip-check.txt" || { cat "$WORK/pip-check.txt" >&2; exit 1; }
echo "$INPUTS" > "$STAMP"
step "installed the wheel with every extra into $fresh"

# 4. as a user runs it: from an empty directory, nothing of the checkout importable
mkdir "$WORK/run" "$WORK/cache"
cp README.md "$WORK/run/"
cd "$WORK/run"
export PADFREE_CACHE_DIR="$WORK/cache" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset PYTHONPATH
"$VPY" - "$ROOT" <<'PYEOF'
import sys
import padfree
root = sys.argv[1]
assert padfree.__file__.startswith(sys.prefix) and not any(p.startswith(root + "/src") for p in sys.path), (
    f"padfree was not imported from the installed wheel: {padfree.__file__}")
from padfree.proof import registry, versions
assert registry.load()["types"] and all(versions.version_span("transformers")), "the package data did not ship"
print(f"check_wheel: padfree {padfree.__version__} from {padfree.__file__}")
PYEOF
"$VPY" -m doctest -o ELLIPSIS -o NORMALIZE_WHITESPACE README.md
step "the README's example ran against the installed wheel"
"$VENV/bin/padfree" --help > "$WORK/help.txt"
grep -q "^usage: padfree" "$WORK/help.txt" || { cat "$WORK/help.txt" >&2; exit 1; }
step "padfree --help answered; done"
