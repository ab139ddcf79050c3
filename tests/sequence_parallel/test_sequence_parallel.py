"""The slices of a batch under sequence parallelism (``split_rows`` / ``split_for_sequence_parallel``) and the group
argument, in one process: every token lands in exactly one slice, the row's positions and boundaries survive the
cut, labels are shifted once across the slice edges, every boundary spelling gives the same slices, and bad input is
refused by name. (The exchanges and the model run on real gloo ranks: ``test_model_sharded.py``.)
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from padfree.errors import InvalidArgumentError, InvalidLayoutError  # noqa: E402
from padfree.layout import lengths_to_position_ids  # noqa: E402
from padfree.sequence_parallel import (  # noqa: E402
    SequenceParallelSlice,
    sequence_parallel_group,
    split_for_sequence_parallel,
)
from padfree.sequence_parallel.split import split_rows  # noqa: E402


def _row_batch(rows: list[list[int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of sequences of these lengths (each row filled to the widest with a filler sequence), random tokens,
    HF labels with -100 at every sequence start."""
    width = max(sum(r) for r in rows)
    lengths = [[*r, width - sum(r)] if sum(r) < width else r for r in rows]
    pos = torch.stack([torch.as_tensor(lengths_to_position_ids(torch.tensor(r), check=False)).reshape(-1)
                       for r in lengths])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, pos.shape, generator=g)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}


def _join(parts: list[dict], key: str) -> torch.Tensor:
    return torch.cat([p[key] for p in parts], dim=1)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=5), min_size=1, max_size=3),
       size=st.integers(1, 5))
def test_the_slices_hold_every_token_once_with_the_rows_positions_and_labels_shifted_once(rows, size):
    batch = _row_batch(rows)
    width = batch["input_ids"].shape[1]
    parts = [split_rows(batch, size=size, rank=r) for r in range(size)]
    padded = -(-width // size) * size
    assert all(p["input_ids"].shape == (len(rows), padded // size) for p in parts)
    assert all(isinstance(p, SequenceParallelSlice) and p.padding == padded - width for p in parts)
    ids, pos, shift = (_join(parts, k) for k in ("input_ids", "position_ids", "shift_labels"))
    # every token once, in order; the padding tail is extra, never a token of the batch
    assert torch.equal(ids[:, :width], batch["input_ids"]) and bool((ids[:, width:] == 0).all())
    assert torch.equal(pos[:, :width], batch["position_ids"])
    if padded > width:  # the padding is a sequence of its own, never a target
        assert torch.equal(pos[:, width:], torch.arange(padded - width).expand(len(rows), -1))
        assert bool((shift[:, width - 1:] == -100).all())
    # the target of position t is the label of t + 1, across slice edges; the row's last position has none
    assert torch.equal(shift[:, :width - 1], batch["labels"][:, 1:])
    assert "labels" not in parts[0] and "attention_mask" not in parts[0]
    # split again: a slice is never cut twice
    assert split_rows(parts[0], size=size, rank=0) is parts[0]


def _per_sequence_total(losses: torch.Tensor, batch: dict) -> tuple[float, int]:
    """Σ over the batch's sequences of their mean target loss, and how many sequences have a target, written out
    sequence by sequence (``losses`` aligned with ``labels``: the loss of predicting token t at t)."""
    total, count = 0.0, 0
    for b in range(batch["input_ids"].shape[0]):
        starts = [*torch.nonzero(batch["position_ids"][b] == 0).flatten().tolist(), batch["input_ids"].shape[1]]
        for lo, hi in itertools.pairwise(starts):
            scored = batch["labels"][b, lo:hi] != -100
            if scored.any():
                total += float(losses[b, lo:hi][scored].double().mean())
                count += 1
    return total, count


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=5), min_size=1, max_size=3),
       size=st.integers(2, 5), seed=st.integers(0, 3))
def test_the_per_sequence_loss_of_the_slices_adds_up_to_the_rows(rows, size, seed):
    """The per-sequence rule on slices: each slice weighs its token losses by its sequences' targets over the whole
    row (``target_weights``), its share of the sequences is the sum of its weights, and over the slices both add up
    to the rows' sum of sequence means and their sequence count. A plain copy of a slice (no whole-row weights)
    counts each slice's part of a sequence as a sequence of its own."""
    from padfree.step_loss import count_loss_items, loss_count, reduce_loss, sequence_weights

    batch = _row_batch(rows, seed)
    batch["labels"][torch.rand(batch["labels"].shape, generator=torch.Generator().manual_seed(seed)) < 0.2] = -100
    losses = torch.rand(batch["labels"].shape, generator=torch.Generator().manual_seed(seed + 1)) + 0.1
    want, sequences = _per_sequence_total(losses, batch)
    assert count_loss_items(batch)[1] == sequences
    width = batch["input_ids"].shape[1]
    padded = -(-width // size) * size
    shifted = torch.nn.functional.pad(losses[:, 1:], (0, padded - width + 1))  # the loss of t's target, at t
    parts = [split_rows(batch, size=size, rank=r) for r in range(size)]
    got, share, copied = 0.0, 0.0, 0.0
    for r, part in enumerate(parts):
        mine = shifted[:, r * (padded // size):(r + 1) * (padded // size)]
        mask = part["shift_labels"] != -100
        count = loss_count(part, "sequence")
        got += float(reduce_loss(mine * mask, mask, part, "sequence", None, shifted=False)) * float(count)
        share += float(count)
        copied += float(loss_count(dict(part), "sequence"))  # a plain copy: its own sequences, counted locally
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert share == pytest.approx(sequences, rel=1e-6)
    whole = torch.nn.functional.pad(sequence_weights(batch)[:, 1:], (0, padded - width + 1))
    assert torch.allclose(_join([{"w": sequence_weights(p)} for p in parts], "w"), whole)
    # control: where a sequence has targets on two slices, counting each slice's part as a sequence overcounts
    seq = (batch["position_ids"] == 0).cumsum(1)
    target = batch["labels"][:, 1:] != -100  # the target of token t, at t
    slices = {(b, int(seq[b, t])): set() for b, t in zip(*torch.nonzero(target).T.tolist(), strict=True)}
    for b, t in zip(*torch.nonzero(target).T.tolist(), strict=True):
        slices[b, int(seq[b, t])].add(t // (padded // size))
    parts_of_sequences = sum(len(v) for v in slices.values())
    assert copied == parts_of_sequences and (parts_of_sequences > sequences) == any(len(v) > 1 for v in
                                                                                      slices.values())


def test_a_target_never_crosses_a_sequence_boundary():
    """Labels that do not mask a sequence's first token: the slice's shifted labels still give the previous
    sequence's last token no target (its next token is another sequence's)."""
    batch = _row_batch([[3, 4, 2]])
    batch["labels"] = batch["input_ids"].clone()  # every token a label, first tokens included
    parts = [split_rows(batch, size=2, rank=r) for r in range(2)]
    shift = _join(parts, "shift_labels")[0]
    assert shift.tolist() == [*batch["input_ids"][0, 1:3].tolist(), -100, *batch["input_ids"][0, 4:7].tolist(), -100,
                              batch["input_ids"][0, 8].tolist(), -100, -100]  # the last: the row's padding


def test_every_boundary_spelling_gives_the_same_slices():
    batch = _row_batch([[3, 4, 2], [9]])  # widths 9: segment ids [1,1,1,2,2,2,2,3,3] and [1]*9
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3, 3], [1] * 9])
    flat = torch.tensor([0, 3, 7, 9, 18], dtype=torch.int32)
    idx = seg - 1
    want = split_rows(batch, size=3, rank=1)
    base = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    for spelling in ({"attention_mask": seg}, {"cu_seq_lens_q": flat}, {"seq_idx": idx},
                     {"position_ids": batch["position_ids"], "cu_seq_lens_q": flat, "seq_idx": idx,
                      "attention_mask": seg}):
        got = split_rows({**base, **spelling}, size=3, rank=1)
        assert sorted(got) == ["input_ids", "position_ids", "shift_labels"]
        assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(InvalidLayoutError, match=r"inputs\['position_ids'\] and inputs\['cu_seq_lens_q'\] disagree"):
        split_rows({**base, "position_ids": batch["position_ids"],
                    "cu_seq_lens_q": torch.tensor([0, 4, 7, 9, 18])}, size=3, rank=1)


def test_a_right_padded_batch_becomes_sequences_and_a_padding_run_of_their_own():
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    parts = [split_rows({"input_ids": ids, "attention_mask": mask, "labels": ids}, size=2, rank=r) for r in (0, 1)]
    assert _join(parts, "position_ids").tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 0]]  # one padding run
    # the labels stay as given (the model would have trained them too): only the shift and the added tail change
    assert _join(parts, "shift_labels").tolist() == [[6, 7, 0, 0, -100, -100], [9, 10, 11, 12, -100, -100]]
    with pytest.raises(InvalidLayoutError):  # left padding: the real tokens would not start a row at position 0
        split_rows({"input_ids": ids, "attention_mask": mask.flip(1)}, size=2, rank=0)


def test_other_per_token_inputs_are_sliced_and_the_rest_passed_on():
    batch = _row_batch([[4, 3]])
    extra = {"inputs_embeds": torch.randn(1, 7, 5), "token_type_ids": torch.ones(1, 7, dtype=torch.long),
             "num_items_in_batch": torch.tensor(6), "use_cache": False}
    del batch["input_ids"]
    part = split_rows({**batch, **extra}, size=2, rank=1)
    assert part["inputs_embeds"].shape == (1, 4, 5) and torch.equal(part["inputs_embeds"][0, :3],
                                                                      extra["inputs_embeds"][0, 4:])
    assert bool((part["inputs_embeds"][0, 3] == 0).all())  # the padding tail's embedding
    assert part["token_type_ids"].tolist() == [[1, 1, 1, 0]]
    assert part["num_items_in_batch"] is extra["num_items_in_batch"] and part["use_cache"] is False


def test_bad_inputs_and_groups_are_refused_by_name():
    batch = _row_batch([[4, 3]])
    with pytest.raises(InvalidArgumentError, match="inputs must be a mapping"):
        split_rows([1, 2, 3], size=2, rank=0)
    with pytest.raises(InvalidArgumentError, match=r"needs input_ids \(B, T\)"):
        split_rows({"labels": batch["labels"]}, size=2, rank=0)
    with pytest.raises(InvalidArgumentError, match="pad_token_id must be an int"):
        split_rows(batch, size=2, rank=0, pad_token_id=0.5)
    with pytest.raises(InvalidLayoutError, match="must hold integers"):
        split_rows({**batch, "position_ids": batch["position_ids"].float()}, size=2, rank=0)
    with pytest.raises(InvalidLayoutError, match=r"inputs\['labels'\] has shape \(1, 6\)"):
        split_rows({**batch, "labels": batch["labels"][:, :6]}, size=2, rank=0)
    with pytest.raises(InvalidLayoutError, match=r"position_ids\[0, 3\] = 4 follows 2"):
        split_rows({**batch, "position_ids": torch.tensor([[0, 1, 2, 4, 0, 1, 2]])}, size=2, rank=0)
    for bad in (0, -2, "2", 2.0, True):
        with pytest.raises(InvalidArgumentError, match=r"sequence_parallel must be an int >= 1"):
            sequence_parallel_group(bad)
    assert sequence_parallel_group(None) is None and sequence_parallel_group(1) is None
    with pytest.raises(InvalidArgumentError, match=r"needs torch\.distributed initialised"):
        split_for_sequence_parallel(batch, 2)
    # no process group needed for a group of one: the whole row, labels shifted
    whole = split_for_sequence_parallel(batch, 1)
    assert torch.equal(whole["input_ids"], batch["input_ids"])
    assert whole["shift_labels"][0, :-1].tolist() == batch["labels"][0, 1:].tolist()
