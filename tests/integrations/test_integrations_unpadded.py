"""``Unpadded``: a padded batch as one packed row and back, checked against a row-by-row reference on every padding
layout (right, left, both sides, empty rows), and ``unpadded_forwards`` on a real model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import padfree  # noqa: E402
from padfree.errors import InvalidArgumentError  # noqa: E402
from padfree.integrations.unpadded import Unpadded, unpadded_forwards  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402


@st.composite
def padded_batches(draw):
    """A ``(N, L)`` 0/1 mask whose rows are each one run of real tokens anywhere in the row (or empty)."""
    width = draw(st.integers(1, 12))
    rows = draw(st.integers(1, 6))
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        start = draw(st.integers(0, width))
        mask[r, start: start + draw(st.integers(0, width - start))] = 1
    return mask


def _rows(mask):
    """Each row's real positions, by a plain per-row loop (the reference)."""
    return [torch.nonzero(row).flatten().tolist() for row in mask]


@settings(max_examples=200, deadline=None)
@given(padded_batches())
def test_pack_unpack_and_shift_agree_with_a_row_by_row_reference(mask):
    u = Unpadded.from_attention_mask(mask)
    values = torch.arange(mask.numel()).view(mask.shape) + 100
    rows = _rows(mask)
    packed = [int(values[r, c]) for r, cols in enumerate(rows) for c in cols]
    assert u.pack(values).tolist() == [packed]  # every real token once, row after row, nothing else
    assert u.position_ids.tolist() == [[i for cols in rows for i in range(len(cols))]]
    assert u.seq_lens.tolist() == [len(cols) for cols in rows]
    back = u.unpack(u.pack(values), fill=-1)
    assert torch.equal(back, values.masked_fill(mask == 0, -1))
    # a next-token score at packed position t belongs to token t + 1; padded place (r, c) holds the score of
    # token (r, c + 1) of the same row, fill elsewhere
    scores = torch.arange(max(u.num_tokens - 1, 0), dtype=torch.float).unsqueeze(0) + 0.5
    shifted = u.unpack_shifted(scores, fill=-1.0)
    assert shifted.shape == (mask.shape[0], mask.shape[1] - 1)
    flat = 0
    for r, cols in enumerate(rows):
        for i, c in enumerate(cols):
            want = float(flat + i) + 0.5 if i + 1 < len(cols) else None
            if want is not None:
                assert shifted[r, c] == want
        flat += len(cols)
    real_pairs = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    assert bool((shifted[~real_pairs] == -1.0).all())
    labels = u.labels(values)
    firsts = [sum(len(c) for c in rows[:r]) for r, cols in enumerate(rows) if cols]
    assert all(int(labels[0, f]) == -100 for f in firsts)
    assert int((labels == -100).sum()) == len(firsts)


@pytest.mark.parametrize(("mask", "match"), [
    (torch.ones(2, 3, 4), "2-D"),
    (torch.ones(2, 3), "0/1 integers"),
    (torch.tensor([[1, 1, 2, 2]]), "segment-id"),
    (torch.tensor([[1, 0, 1, 0]]), "padding between real tokens"),
    ([[1, 1]], "2-D"),
])
def test_bad_masks_are_refused_by_name(mask, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Unpadded.from_attention_mask(mask)


def test_unpadded_forwards_gives_the_padded_logits_of_a_configured_model_and_only_inside_the_block():
    torch.manual_seed(0)
    model = build_tiny("qwen3_5_text").float().eval()
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]])
    ids = torch.randint(1, model.config.vocab_size, mask.shape) * mask
    with torch.no_grad():
        alone = [model(input_ids=ids[r: r + 1, mask[r].bool()]).logits[0] for r in range(3)]
        padfree.configure_packing(model)
        with unpadded_forwards(model):
            inside = model(input_ids=ids, attention_mask=mask).logits
        outside = model(input_ids=ids, attention_mask=mask).logits  # the model's own padded forward
        padfree.unconfigure_packing(model)
        with unpadded_forwards(model):
            leaking = model(input_ids=ids, attention_mask=mask).logits
    for r in range(3):
        assert torch.allclose(inside[r, mask[r].bool()], alone[r], atol=1e-5, rtol=1e-5)
        assert bool((inside[r, ~mask[r].bool()] == 0).all())
    assert outside.shape == inside.shape and bool((outside[0, 5:] != 0).any())  # padded positions computed
    # the unconfigured hybrid carries GatedDeltaNet state from one sequence into the next
    assert (leaking[1, mask[1].bool()] - alone[1]).abs().max() > 1e-3
