"""Running a test's worker on several forked processes (gloo), with a deadline: a hang fails the test, never the
suite.

Forked, like DataLoader workers on Linux, so the children start with this process's imports (spawning fresh
interpreters that import torch and transformers costs ~20 s on 2 cores). Each worker is ``fn(rank, world, tmp,
*args)`` and writes what it measured to ``{tmp}/rank{rank}.pkl``; :func:`run_ranks` returns those, rank by rank.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp


def run_ranks(fn: Callable[..., None], tmp: Path, *args: Any, world: int = 2, deadline: float = 150) -> list[Any]:
    """Run ``fn(rank, world, str(tmp), *args)`` on ``world`` forked processes; fail if they are not done in time."""
    ctx = mp.start_processes(_run_then_wait, args=(fn, world, str(tmp), *args), nprocs=world, join=False,
                             start_method="fork")
    end = time.monotonic() + deadline
    while not ctx.join(timeout=0.5):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"the {world}-process gloo run did not finish within {deadline:.0f} s (a hang)")
    return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(world)]


def _run_then_wait(rank: int, fn: Callable[..., None], world: int, tmp: str, *args: Any) -> None:
    """``fn`` on this rank; then, if it set up a process group, wait for every rank before leaving it.

    A rank that left early took its end of the store with it (rank 0 hosts the TCP store) while another was still
    building a group of its own (a DeviceMesh's sub-groups): that rank then failed with 'connection reset by peer'.
    """
    import torch.distributed as dist

    fn(rank, world, tmp, *args)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this machine now, for ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_launched_rank(rank: int, world: int, port: int, **env: str) -> None:
    """Make this forked worker look like rank ``rank`` of ``world`` started by a launcher (torchrun): one torch
    thread, accelerate's state forgotten (a state made in the parent before the fork would say "one process"), and
    the variables from which the Trainer / accelerate set up the gloo process group (plus ``env``)."""
    import torch
    from accelerate.state import AcceleratorState

    torch.set_num_threads(1)
    AcceleratorState._reset_state(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **env)


class StepRecorder:
    """For a padfree trainer class (before it in the bases): notes in ``self.seen`` every micro-batch this rank
    trains — its tensors, the item count the Trainer hands the step and padfree's step counts it normalises by."""

    seen: list

    def training_step(self, model, inputs, num_items_in_batch=None):
        import torch

        self.seen.append({"batch": {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)},
                          "num_items": float(num_items_in_batch),
                          "step": tuple(float(c) for c in self._padfree_step)})
        return super().training_step(model, inputs, num_items_in_batch)
