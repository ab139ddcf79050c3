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
