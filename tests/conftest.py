"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc
import os
import sys

import pytest

# One intra-op thread per test process, and per process a test starts (set before torch is imported, inherited by
# subprocesses; an OMP_NUM_THREADS given on the command line wins). `make test` runs two xdist workers on a 2-core
# machine: a second thread per worker only contends with the other worker (OpenMP barriers spin), and the tiny models
# gain nothing from it — the model configure and packed tests take a third less CPU time on one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# glibc gives every block above 32 MiB its own mmap and unmaps it when freed, so a trainer test's 32k-vocabulary
# logits (hundreds of MiB per step) are faulted in and zeroed by the kernel on every forward: freed memory kept in the
# worker's heap and reused instead takes a tenth of those tests' system time (set here, before the xdist workers
# and subprocesses start; the model sweep's small tensors are unaffected).
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 32))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 34))


# The modules whose single tests run longest (a compiled model's recompiles per family, the GPU script's dry run, the
# sequence-parallel sweep over every proven type, the bf16 trainer steps) run first: `make test`'s two workers share
# the suite by worksteal, and a minute-long test that starts last leaves the other core idle until it ends.
LONGEST_FIRST = ("tests/model/test_model_compile.py", "tests/test_gpu_check.py", "tests/model/test_model_sharded.py",
                 "tests/integrations/test_integrations_bf16.py")


def pytest_configure(config):
    if "torch" in sys.modules:  # imported before this file by a plugin: the variable came too late for it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    first = {path: rank for rank, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope="module")
def _settled_heap() -> None:
    """Collect what the last module left, then freeze what survives (imported modules, session fixtures, caches):
    the collector never walks those again. A worker's heap grows to millions of objects (the support sweep imports
    every model module of transformers), and accelerate calls ``gc.collect()`` for every trainer it frees: a full
    walk of that heap each time, seconds per test late in a worker's run. A cycle that dies after it was frozen is
    not collected: what a module creates is collected at the next module's start, before the freeze."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny models on one torch thread and give the setting back afterwards, whatever the session's
    setting (see OMP_NUM_THREADS above): they gain nothing from intra-op threads, and on a shared 2-core machine
    OpenMP barriers turn into multi-second stalls (and a parent that forks workers with two threads stalls them
    too)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """mistral-common's 32k SentencePiece tokenizer through transformers, offline (:func:`zoo.mistral_tokenizer`):
    one per test module, which may set its padding token as TRL's trainers do."""
    from zoo import mistral_tokenizer

    return mistral_tokenizer(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def shared_data():
    """The real data directory, ``../shared/data`` beside the repository (:mod:`realdata`)."""
    from realdata import DATA

    assert DATA.is_dir(), f"{DATA} is missing: the tests expect the shared/ data directory beside the repository"
    return DATA


@pytest.fixture(scope="session")
def gsm8k():
    """Every GSM8K training record (instruction, input, output), read once per session."""
    from realdata import gsm8k_records

    return gsm8k_records()
