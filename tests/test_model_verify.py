"""``padfree.verify`` refuses token ids its model cannot embed — by sample, position and vocabulary size — before it
runs anything (torch would stop inside the embedding with an IndexError, or a device-side assert on CUDA)."""

from __future__ import annotations

import pytest
import torch
import transformers

from padfree import pack_result_to_tensors, pack_sequences, verify
from padfree.errors import InvalidTokensError

VOCAB = 64


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).train()


def untouched(model: torch.nn.Module) -> bool:
    return model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("data", "message"), [
    ([[5, 6, 7], [8, VOCAB]], f"data[1][1] = {VOCAB} is not below the vocabulary size {VOCAB}"),
    ([[5, 6, 7], [8, 9, 10_000]], f"data[1][2] = 10000 is not below the vocabulary size {VOCAB}"),
    ([[5, 6, -1], [8, 9]], "data[0][2] = -1 is negative; token ids are integers >= 0"),
    ([torch.tensor([5, 6]), torch.tensor([7, 8, VOCAB + 3])],
     f"data[1][2] = {VOCAB + 3} is not below the vocabulary size {VOCAB}"),
])
def test_an_id_outside_the_vocabulary_is_named_by_sample_and_position(model, data, message):
    with pytest.raises(InvalidTokensError) as caught:
        verify(model, data)
    assert str(caught.value) == message
    assert untouched(model)


def test_a_packed_batch_is_checked_slot_by_slot(model):
    seqs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    batch = pack_result_to_tensors(pack_sequences([len(s) for s in seqs], 8), seqs, pad_to="longest")
    batch.input_ids[0, 3] = VOCAB
    with pytest.raises(InvalidTokensError, match=rf"^data\.input_ids\[0\]\[3\] = {VOCAB} is not below the "
                                                 rf"vocabulary size {VOCAB}$"):
        verify(model, batch)
    assert untouched(model)


def test_the_vocabulary_is_what_the_embedding_holds_not_what_the_config_says(model):
    # a config edited by hand (or a model resized without updating it) must not let an id past the embedding
    model.config.vocab_size = 10 * VOCAB
    try:
        with pytest.raises(InvalidTokensError, match=f"is not below the vocabulary size {VOCAB}$"):
            verify(model, [[1, 2, 3], [4, VOCAB + 1]])
    finally:
        model.config.vocab_size = VOCAB
    assert verify(model, [[1, 2, 3], [4, VOCAB - 1]]).num_sequences == 2  # the last id of the vocabulary is fine
