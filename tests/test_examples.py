"""The scripts under examples/ run as a user would run them (small sizes) and say what they claim.

Each script runs as ``__main__`` in a process of its own, forked from the test's process so that it starts with
torch, transformers and TRL already imported (a fresh interpreter spends ~14 s of this machine's time importing them,
a dozen times per suite); its output is read from its file descriptors, as a shell would.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT = 600

# what every example imports, imported once here so that the forked scripts start warm
pytest.importorskip("trl")
import padfree.integrations.sft  # noqa: E402, F401

# one torch thread in this process before it forks: a child of a process whose OpenMP pool has run stalls in it
pytestmark = pytest.mark.usefixtures("one_thread")


def _child(script: Path, args: tuple[str, ...], out: int, err: int) -> None:
    """In the forked process: the script as ``__main__`` with its argv, stdout / stderr to the given files."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process ends with os._exit
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh interpreter
    sys.argv = [str(script), *args]
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(script: str, *args: str) -> str:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            _child(EXAMPLES / script, args, out.fileno(), err.fileno())
        end = time.monotonic() + TIMEOUT
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > end:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail(f"examples/{script} did not finish within {TIMEOUT} s")
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    assert os.waitstatus_to_exitcode(status) == 0, stderr[-3000:]
    return stdout


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
    out = run("sft_trainer.py", "--steps", "1", "--max-length", "256")  # the LM head over 32k words: 4x fewer
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
