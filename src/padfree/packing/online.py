"""Truly online packing: a bin leaves the moment next fit or harmonic-k closes it (``StreamPacker``'s online mode).

Next fit keeps one open bin: an item that does not fit closes it. Harmonic-k keeps one open bin per size class —
an item of more than ``C / (j + 1)`` and at most ``C / j`` tokens is of class ``j`` (``j < k``), and a bin of class
``j`` closes with its ``j``-th item; the items of at most ``C / k`` tokens share next-fit bins. Memory is bounded by
the open bins (one, or ``k``), whatever the length of the stream; nothing waits for a buffer to fill.

The placement runs in one compiled pass per call over the lengths added; the state between calls is a handful of
integers, so the bins depend only on the sequence of lengths, never on how the calls were chunked.

>>> state = OnlineState(capacity=8, strategy="nf", k=8, max_per_bin=None)
>>> state.place(np.array([5, 2, 4, 6]))  # (bin of every item, bins closed by this call in closing order)
([0, 0, 1, 2], [0, 1])
>>> state.close_all()
[2]
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["OnlineState"]


@njit(cache=True)
def _next_fit(lengths, capacity, max_per_bin, state, out_bin, out_closed):  # pragma: no cover - compiled
    """state: [open bin id (-1: none), its fill, its count, next bin id]; returns the number of bins closed."""
    closed = 0
    for i in range(lengths.shape[0]):
        n = lengths[i]
        if state[0] >= 0 and (state[1] + n > capacity or state[2] >= max_per_bin):
            out_closed[closed] = state[0]
            closed += 1
            state[0] = -1
        if state[0] < 0:
            state[0], state[1], state[2] = state[3], 0, 0
            state[3] += 1
        out_bin[i] = state[0]
        state[1] += n
        state[2] += 1
    return closed


@njit(cache=True)
def _harmonic(lengths, capacity, k, max_per_bin, state, out_bin, out_closed):  # pragma: no cover - compiled
    """state: rows 0..k-1 = [open bin id (-1: none), fill, count] per class (class j + 1 at row j), and state[k, 0] =
    the next bin id; returns the number of bins closed."""
    closed = 0
    for i in range(lengths.shape[0]):
        n = lengths[i]
        j = k  # class k: at most C / k tokens, next fit
        for c in range(1, k):
            if n * (c + 1) > capacity:  # n > C / (c + 1): class c (n <= C / c holds: classes are tried upwards)
                j = c
                break
        row = j - 1
        if state[row, 0] >= 0 and j == k and (state[row, 1] + n > capacity or state[row, 2] >= max_per_bin):
            out_closed[closed] = state[row, 0]
            closed += 1
            state[row, 0] = -1
        if state[row, 0] < 0:
            state[row, 0], state[row, 1], state[row, 2] = state[k, 0], 0, 0
            state[k, 0] += 1
        out_bin[i] = state[row, 0]
        state[row, 1] += n
        state[row, 2] += 1
        if j < k and state[row, 2] >= min(j, max_per_bin):  # a class-j bin is full with j items
            out_closed[closed] = state[row, 0]
            closed += 1
            state[row, 0] = -1
    return closed


class OnlineState:
    """The open bins of an online packer: ``place`` assigns items to bins and says which bins closed."""

    def __init__(self, capacity: int, strategy: str, k: int, max_per_bin: int | None) -> None:
        self.capacity, self.strategy, self.k = capacity, strategy, k
        self.max_per_bin = max_per_bin if max_per_bin is not None else np.iinfo(np.int64).max
        if strategy == "nf":
            self._state = np.array([-1, 0, 0, 0], np.int64)
        else:
            self._state = np.zeros((k + 1, 3), np.int64)
            self._state[:k, 0] = -1

    def place(self, lengths: np.ndarray) -> tuple[list[int], list[int]]:
        """``(bin id of every item, ids of the bins these items closed, in closing order)``."""
        out_bin = np.empty(lengths.shape[0], np.int64)
        out_closed = np.empty(lengths.shape[0] + 1, np.int64)
        if self.strategy == "nf":
            closed = _next_fit(lengths, self.capacity, self.max_per_bin, self._state, out_bin, out_closed)
        else:
            closed = _harmonic(lengths, self.capacity, self.k, self.max_per_bin, self._state, out_bin, out_closed)
        return out_bin.tolist(), out_closed[:closed].tolist()

    def close_all(self) -> list[int]:
        """Close every open bin (the end of the stream); their ids, oldest first."""
        if self.strategy == "nf":
            ids = [int(self._state[0])] if self._state[0] >= 0 else []
            self._state[0] = -1
        else:
            ids = sorted(int(b) for b in self._state[: self.k, 0] if b >= 0)
            self._state[: self.k, 0] = -1
        return ids
