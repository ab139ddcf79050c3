"""What the support sweep (tests/proof/test_model_sweep.py) does not run: the leaking controls.

The sweep proves every causal-LM type on ``sdpa`` and ``eager`` in fp32, ``autocast_bf16`` and ``bf16``; this module
shows that the comparison catches a leak: an unconfigured model with its default cache, and a model that builds its
masks without positions. (flex_attention: refused on the CPU, proven on CUDA, in tests/model/test_model_flex.py.)
"""

from __future__ import annotations

import pytest
import torch

import padfree
from padfree import verify
from zoo import (
    CAPACITY,
    LENGTHS,
    sequences,
    tiny_model,
)

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def test_negative_control_unconfigured_model_with_cache_leaks():
    """The packed-vs-separate comparison without configure_packing, with the config's default use_cache=True,
    fails: the comparison can see a leak."""
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
