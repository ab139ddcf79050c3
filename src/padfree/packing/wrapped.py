"""``strategy="wrapped"`` done exactly: the sequences back to back, cut into full rows, every piece its own sequence.

TRL's ``pack_dataset(..., strategy="wrapped")`` concatenates every sequence and cuts the stream into rows of
``seq_length`` tokens; the piece of a sequence that a cut leaves in the next row keeps counting its positions and is
attended across the cut as if it continued. Here every piece of a cut sequence is a sequence of its own — its
positions restart and its first token is not a target, exactly as with ``overlong="split"`` — so a wrapped row
computes what each of its pieces computes alone. Every row but the last is full: no padding, no sorting, the input
order kept.

>>> plan = wrap_sequences([5, 3, 6], capacity=4)
>>> plan.bins  # sequence ids per row, in input order: 0 is cut after 4 tokens, 2 across two cuts
[[0], [0, 1], [2], [2]]
>>> plan.piece_starts.tolist(), plan.placed_lengths.tolist(), plan.bin_fill.tolist()
([0, 4, 0, 0, 4], [4, 1, 3, 4, 2], [4, 4, 4, 2])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from padfree.packing.inputs import as_capacity, as_lengths
from padfree.packing.result import PackResult

__all__ = ["wrap_sequences"]


def wrap_sequences(lengths: Any, capacity: int) -> PackResult:
    """Plan rows of exactly ``capacity`` tokens (the last one what is left) from the sequences in input order.

    Args:
        lengths: ``(n,)`` integers >= 1, the tokens of every sequence.
        capacity: tokens per row.

    Returns:
        A :class:`PackResult` with ``strategy="wrapped"``: a sequence that crosses a row boundary is placed as
        pieces (``piece_starts`` / ``piece_lengths``), each laid out as a sequence of its own. Nothing is dropped
        or truncated.
    """
    lengths = as_lengths(lengths)
    capacity = as_capacity(capacity)
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    num_rows = -(-total // capacity)
    # every place the stream is cut: a sequence starts, or a row starts (as_lengths refuses empty sequences)
    cuts = np.union1d(offsets[:-1], np.arange(num_rows, dtype=np.int64) * capacity)
    ends = np.append(cuts[1:], total)
    seq = np.searchsorted(offsets, cuts, side="right") - 1
    rows = cuts // capacity
    bin_offsets = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=bin_offsets[1:])
    return PackResult(
        lengths=lengths,
        capacity=capacity,
        order=seq.astype(np.int64),
        bin_offsets=bin_offsets,
        piece_starts=cuts - offsets[seq],
        piece_lengths=ends - cuts,
        strategy="wrapped",
    )
