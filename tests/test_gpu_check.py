"""``scripts/gpu_check.sh`` stays runnable where CI runs (no GPU): its shell syntax, and its CPU dry run end to end —
every step's setup at the smallest sizes, the section rendered into a temporary file, BENCHMARKS.md untouched — and a
step past its time limit recorded in the section instead of losing the others."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
OTHER = "<!-- other:start -->\nkept as it was\n<!-- other:end -->"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)


def test_the_script_parses():
    shell = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    driver = subprocess.run([sys.executable, "-m", "py_compile", str(REPO / "scripts" / "gpu_check.py")],
                            capture_output=True, text=True)
    assert shell.returncode == 0, shell.stderr
    assert driver.returncode == 0, driver.stderr


@pytest.mark.slow
def test_the_dry_run_renders_every_step_into_a_temporary_file(tmp_path):
    benchmarks = (REPO / "BENCHMARKS.md").read_bytes()
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(f"# Benchmarks\n\n{OTHER}\n", encoding="utf-8")

    done = _run("--dry-run", "--output", str(out))

    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    text = out.read_text(encoding="utf-8")
    assert OTHER in text
    assert text.count("<!-- gpu_check:start -->") == text.count("<!-- gpu_check:end -->") == 1
    section = text[text.index("<!-- gpu_check:start -->"):]
    assert "a dry run on the CPU at the smallest sizes: no GPU figure" in section
    # the matrix: a proven row, the refused CUDA-only backends, the variant with the mixer kernels hidden
    assert "| `llama` | — | `padfree_sdpa` | fp32 |" in section
    assert "- `varlen` for `llama` (" in section and "backend='varlen' runs on cuda only" in section
    assert "| `mamba2` | kernels hidden | `none` | fp32 |" in section
    # the packed step: padfree.verify in three precisions, then the padfree verify command
    for run in ("| fp32 weights |", "| fp32 weights, bf16 autocast |", "| bf16 weights |"):
        assert run in section
    assert "`padfree verify --model DIR --device cpu --json` (exit status 0" in section
    # the benchmark's own section, inside this one without its markers
    assert "| `packed+fused` |" in section and "<!-- bench_training" not in section
    assert "gpu_check summary (DRY RUN on the CPU)" in done.stdout
    assert (REPO / "BENCHMARKS.md").read_bytes() == benchmarks


def test_a_step_past_its_time_limit_is_recorded_and_the_run_fails(tmp_path):
    out = tmp_path / "BENCHMARKS.md"

    done = _run("--dry-run", "--steps", "verify", "--budget", "verify=2", "--output", str(out))

    assert done.returncode == 1
    section = out.read_text(encoding="utf-8")
    assert "### 2. A packed step" in section
    assert "the process timed out after 2 s" in section
    assert "verify  timed out after 2 s" in done.stdout
