"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny models on one torch thread and give the setting back afterwards: they gain nothing from
    intra-op threads, and on a shared 2-core machine OpenMP barriers turn into multi-second stalls (and a parent
    that forks workers with two threads stalls them too)."""
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
