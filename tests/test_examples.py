"""The scripts under examples/ run as a user would run them (small sizes) and say what they claim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_pack_dataset():
    out = run("pack_dataset.py", "--capacity", "512")
    assert "rows of 512 tokens" in out and "efficiency" in out


def test_dataloader_training():
    out = run("dataloader_training.py", "--steps", "2", "--capacity", "256")
    assert "padfree_sdpa" in out and "step 1: loss" in out
    fused = run("dataloader_training.py", "--steps", "2", "--capacity", "256", "--fused")
    step0 = [next(line for line in text.splitlines() if line.startswith("step 0:")) for text in (out, fused)]
    assert step0[0] == step0[1]  # the same weights and batch: the same loss, to the printed digits


def test_configure_and_verify():
    out = run("configure_and_verify.py")
    assert "OK at atol=1e-05" in out and "GatedDeltaNet" in out


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_covered(script):
    assert f'"{script}"' in Path(__file__).read_text(), f"examples/{script} has no test here"


def test_sft_trainer():
    out = run("sft_trainer.py", "--steps", "1")
    assert "padfree: sample packing" in out and "padfree/real_token_fraction" in out


def test_hf_trainer():
    out = run("hf_trainer.py", "--steps", "1")
    assert "padfree: sample packing" in out and "padfree/sequences_per_row" in out


def test_dpo_trainer():
    out = run("dpo_trainer.py", "--steps", "1")
    assert "padfree: padding-free batching" in out and "'loss'" in out and "rewards/margins" in out


def test_dpo_trainer_packing():
    packed = run("dpo_trainer.py", "--steps", "1", "--mode", "packing")
    assert "padfree: sample packing" in packed and "pairs packed across the train set" in packed
    assert "padfree/sequences_per_row" in packed and "'loss'" in packed


def test_reward_trainer():
    out = run("reward_trainer.py", "--steps", "1")
    assert "padfree: padding-free batching" in out and "'loss'" in out and "'accuracy'" in out


def test_grpo_trainer():
    out = run("grpo_trainer.py", "--steps", "1")
    assert "padfree: padding-free batching" in out and "'loss'" in out and "'reward'" in out
    forwards = next(line for line in out.splitlines() if line.startswith("padfree forwards:"))
    assert "'rows': 0" not in forwards  # the completions were scored through the packed forward


def test_sequence_parallel():
    out = run("sequence_parallel.py", "--ranks", "2")
    assert "sequence par.   2 ranks" in out and "-> exact" in out
