"""``padfree.packing.wrapped``: the stream cut into full rows, every piece of a cut sequence a sequence of its own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import InvalidArgumentError, InvalidLengthsError, PackResult
from padfree.packing.wrapped import wrap_sequences


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=40), st.integers(1, 64))
def test_every_token_once_in_order_and_every_row_full_but_the_last(lengths, capacity):
    plan = wrap_sequences(lengths, capacity)
    # the plan passes PackResult's own checks (no overlap, pieces inside their sequences, fills within capacity)
    PackResult(lengths=plan.lengths, capacity=capacity, order=plan.order, bin_offsets=plan.bin_offsets,
               piece_starts=plan.piece_starts, piece_lengths=plan.piece_lengths, strategy="wrapped")
    fill = plan.bin_fill
    assert fill.sum() == sum(lengths) and (fill[:-1] == capacity).all()
    # read back in order, the pieces are the input stream: (sequence, token) pairs in input order, each once
    stream = np.concatenate([np.stack([np.full(n, s), np.arange(b, b + n)])
                             for s, b, n in zip(plan.order, plan.piece_starts, plan.placed_lengths, strict=True)],
                            axis=1) if lengths else np.zeros((2, 0), np.int64)
    want = np.concatenate([np.stack([np.full(n, i), np.arange(n)]) for i, n in enumerate(lengths)],
                          axis=1) if lengths else np.zeros((2, 0), np.int64)
    assert np.array_equal(stream, want)
    # a piece is cut only at a row's edge
    ends = plan.piece_starts + plan.placed_lengths
    cut = ends < plan.lengths[plan.order]
    row_end = np.repeat(np.cumsum(fill), np.diff(plan.bin_offsets))
    assert np.array_equal(np.cumsum(plan.placed_lengths)[cut], row_end[cut])


def test_bad_input_is_refused_by_name():
    with pytest.raises(InvalidLengthsError, match=r"lengths\[1\] = 0"):
        wrap_sequences([3, 0], 4)
    with pytest.raises(InvalidArgumentError, match="capacity"):
        wrap_sequences([3], 0)


# ---- a registered strategy, through every route ---------------------------------------------------------------------


def test_wrapped_is_a_registered_strategy_that_cuts_at_the_rows_edges():
    from padfree import Packer, PackingSpec, pack_sequences
    from padfree.packing import STRATEGIES, as_strategy

    assert STRATEGIES["wrapped"].cuts_at_row_edges and STRATEGIES["wrapped"].input_order
    assert not any(s.cuts_at_row_edges for name, s in STRATEGIES.items() if name != "wrapped")
    assert as_strategy("Wrapped") == "wrapped"
    lengths = [5, 3, 6, 11, 1]
    want = wrap_sequences(lengths, 4)
    for plan in (pack_sequences(lengths, 4, "wrapped"), Packer(spec=PackingSpec(4, "wrapped")).pack(lengths),
                 pack_sequences(lengths, spec=PackingSpec(4, "wrapped", overlong="split"))):
        assert plan.strategy == "wrapped" and plan.time_ms is not None
        assert plan.bins == want.bins
        assert plan.piece_starts.tolist() == want.piece_starts.tolist()
        assert plan.placed_lengths.tolist() == want.placed_lengths.tolist()


def test_wrapped_refuses_what_does_not_apply_to_it_by_name():
    from padfree import IterablePackingDataset, PackingSpec, pack_sequences
    from padfree.packing import StreamPacker

    for overlong in ("truncate", "drop"):
        with pytest.raises(InvalidArgumentError, match=f"overlong='{overlong}' does not apply to strategy='wrapped'"):
            pack_sequences([5, 3], 4, "wrapped", overlong=overlong)
    with pytest.raises(InvalidArgumentError, match="max_sequences_per_bin does not apply to strategy='wrapped'"):
        PackingSpec(4, "wrapped", max_sequences_per_bin=2)
    with pytest.raises(InvalidArgumentError, match="StreamPacker: strategy='wrapped' cuts the sequences"):
        StreamPacker(4, strategy="wrapped")
    with pytest.raises(InvalidArgumentError, match="IterablePackingDataset: strategy='wrapped' cuts the sequences"):
        IterablePackingDataset([[1, 2, 3]], 4, strategy="wrapped")


def _rows_of(batch_like) -> list[tuple[list[int], list[int], list[int]]]:
    """Every row as ``(input_ids, position_ids, labels)`` lists, padding cut off (``seq_lens`` says where)."""
    return [(list(ids[:sum(lens)]), list(pos[:sum(lens)]), list(lab[:sum(lens)]))
            for ids, pos, lab, lens in batch_like]


def test_every_map_style_route_lays_out_the_same_wrapped_rows():
    from padfree import PackingDataset, PackingSpec, pack_dataset, packed_collate_fn
    from zoo import sequences

    samples = [{"input_ids": s, "labels": [-100] * 2 + s[2:]} for s in sequences([7, 12, 5, 9, 3, 16])]
    spec = PackingSpec(capacity=10, strategy="wrapped")
    table = pack_dataset({k: [s[k] for s in samples] for k in ("input_ids", "labels")}, spec=spec)[:]
    by_table = _rows_of(zip(table["input_ids"], table["position_ids"], table["labels"], table["seq_lens"],
                            strict=True))
    ds = PackingDataset(samples, spec=spec, shuffle=False)
    by_dataset = _rows_of((r["input_ids"].tolist(), r["position_ids"].tolist(), r["labels"].tolist(),
                           r["seq_lens"].tolist()) for r in (ds[i] for i in range(len(ds))))
    batch = packed_collate_fn(spec=spec)(samples)
    lens = np.split(batch.seq_lens.numpy(), np.cumsum(batch.seqs_per_row.numpy())[:-1])
    by_collator = _rows_of(zip(batch.input_ids.tolist(), batch.position_ids.tolist(), batch.labels.tolist(),
                               [x.tolist() for x in lens], strict=True))
    assert by_table == by_dataset == by_collator
    assert [len(ids) for ids, _, _ in by_table] == [10] * 5 + [2]
    # every cut piece is a sequence of its own: positions restart and its first token is no target
    for _, pos, lab in by_table:
        assert all(lab[i] == -100 for i, p in enumerate(pos) if p == 0)


def test_a_wrapped_row_computes_each_piece_alone_logits_loss_and_gradients():
    import torch

    from padfree import PackingSpec, configure_packing, packed_collate_fn
    from zoo import grad_diff, loss_of, max_diff, run_packed, run_separately, sequences, tiny_model

    model = tiny_model("llama")
    configure_packing(model)
    samples = [torch.tensor(s) for s in sequences([7, 12, 5, 9])]
    batch = packed_collate_fn(spec=PackingSpec(capacity=10, strategy="wrapped"))(samples)
    ids, pos = batch.input_ids, batch.position_ids
    seqs, piece = [], 0
    for row, count in enumerate(batch.seqs_per_row.tolist()):
        start = 0
        for n in batch.seq_lens[piece:piece + count].tolist():
            seqs.append((row, start, ids[row, start:start + n]))
            start += n
        piece += count
    assert len(seqs) > len(samples)  # sequences were cut at the rows' edges
    packed, g_packed = run_packed(model, ids, pos, seqs)
    alone, g_alone = run_separately(model, seqs)
    total = sum(len(s) - 1 for _, _, s in seqs)
    assert max_diff(packed, alone) <= 1e-5 and grad_diff(g_packed, g_alone) <= 1e-5
    assert abs(float(loss_of(packed, seqs, total)) - float(loss_of(alone, seqs, total))) <= 1e-5
    # the control: the same rows read as one stream each (TRL's wrapped rows, positions running on across cuts)
    glued_pos = torch.arange(ids.shape[1]).expand_as(ids)
    glued, _ = run_packed(model, ids, glued_pos, seqs, grad=False)
    assert max_diff(glued, alone) > 1e-3
