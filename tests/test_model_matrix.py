"""What the support sweep (tests/test_model_sweep.py) does not run: flex_attention, and the leaking controls.

The sweep proves every causal-LM type on ``sdpa`` and ``eager`` in fp32, ``autocast_bf16`` and ``bf16``; this module
adds the flex_attention forward (torch has no flex backward on the CPU) for a few types, and shows that the
comparison catches a leak: an unconfigured model with its default cache, and a model that builds its masks without
positions.
"""

from __future__ import annotations

import pytest
import torch

import padfree
from padfree import configure_packing, verify
from zoo import (
    CAPACITY,
    LENGTHS,
    sequences,
    tiny_model,
)

FLEX_TYPES = ("llama", "gemma2")  # flex compiles per shape on CPU (~50 s a type): GQA, a sliding window, softcapping
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model_type", FLEX_TYPES)
def test_flex_packed_equals_separate_forward(model_type):
    """flex_attention has no backward on the CPU (torch): its packed forward is checked against the SDPA runs."""
    model = tiny_model(model_type)
    seqs = sequences(LENGTHS)
    configure_packing(model, backend="sdpa")
    batch = padfree.pack_result_to_tensors(padfree.pack_sequences([len(s) for s in seqs], CAPACITY), seqs)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s])).logits[0] for s in seqs]
        configure_packing(model, backend="flex_attention")
        packed = model(**batch.model_inputs(include_labels=False)).logits
    starts = batch.cu_seqlens[:-1].tolist()
    rows = torch.repeat_interleave(torch.arange(batch.input_ids.shape[0]), batch.seqs_per_row).tolist()
    row_start = {r: starts[rows.index(r)] for r in set(rows)}
    for i, sid in enumerate(batch.sequence_ids.tolist()):
        r, c, n = rows[i], starts[i] - row_start[rows[i]], len(seqs[sid])
        assert (packed[r, c:c + n] - alone[sid]).abs().max() <= ATOL


def test_negative_control_unconfigured_model_with_cache_leaks():
    """The same comparison without configure_packing, with the config's default use_cache=True, fails: the test
    above can see a leak."""
    model = tiny_model("llama")
    assert model.config.use_cache
    seqs = sequences(LENGTHS)
    batch = padfree.pack_result_to_tensors(padfree.pack_sequences([len(s) for s in seqs], CAPACITY), seqs)
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        second = seqs[batch.sequence_ids[1]]
        c = int(batch.seq_lens[0])
        alone = model(input_ids=torch.tensor([second])).logits[0]
    assert (packed[0, c:c + len(second)] - alone).abs().max() > 1e-2
    with pytest.raises(padfree.errors.PackingMismatchError):
        verify(tiny_model("gpt_oss"), seqs, capacity=CAPACITY).raise_for_mismatch()  # builds masks without positions
