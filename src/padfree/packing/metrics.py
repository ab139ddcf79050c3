"""SeqPacker's views of a plan: one :class:`Pack` per bin and the :class:`PackMetrics` of the whole plan.

Both are read-only and derived from a :class:`~padfree.PackResult`'s flat arrays on first access
(``PackResult.packs``, ``PackResult.metrics``); the plan itself stays two CSR arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Pack", "PackMetrics", "build_metrics", "build_packs"]


class Pack:
    """One bin of a plan, as SeqPacker shows it: the sequences in it, their lengths and the tokens used.

    Attributes:
        sequence_ids: ``list[int]`` — the sequence of every piece in the bin, in row order.
        lengths: ``list[int]`` — tokens of every piece (the whole sequence unless it was split or truncated).
        used: real tokens in the bin; ``capacity``: tokens per bin.

    ``len(pack)`` is the number of pieces in the bin.

    >>> from padfree import pack_sequences
    >>> pack = pack_sequences([5, 3, 4, 2, 6], capacity=8).packs[0]
    >>> pack.sequence_ids, pack.lengths, pack.used, len(pack), pack.padding_tokens
    ([4, 3], [6, 2], 8, 2, 0)
    """

    __slots__ = ("_ids", "_lengths", "capacity", "used")

    def __init__(self, ids: np.ndarray, lengths: np.ndarray, used: int, capacity: int) -> None:
        self._ids = ids
        self._lengths = lengths
        self.used = used
        self.capacity = capacity

    @property
    def sequence_ids(self) -> list[int]:
        return self._ids.tolist()

    @property
    def lengths(self) -> list[int]:
        return self._lengths.tolist()

    @property
    def padding_tokens(self) -> int:
        """Empty slots of the bin: ``capacity - used``."""
        return self.capacity - self.used

    @property
    def utilisation(self) -> float:
        """``used / capacity``."""
        return self.used / self.capacity

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def __repr__(self) -> str:
        return f"Pack(sequence_ids={self.sequence_ids}, lengths={self.lengths}, used={self.used}/{self.capacity})"


def build_packs(order: np.ndarray, placed: np.ndarray, offsets: np.ndarray, fill: np.ndarray,
                capacity: int) -> list[Pack]:
    """One :class:`Pack` per bin: ``order``/``placed`` ``(num_pieces,)`` cut at ``offsets (num_bins + 1,)``, with
    ``fill (num_bins,)`` the tokens of each bin. Two splits into views; one small object per bin."""
    if offsets.shape[0] <= 1:
        return []
    cuts = offsets[1:-1]
    return [
        Pack(ids, lengths, used, capacity)
        for ids, lengths, used in zip(np.split(order, cuts), np.split(placed, cuts), fill.tolist(), strict=True)
    ]


@dataclass(frozen=True)
class PackMetrics:
    """The quality of a plan, with SeqPacker's field names.

    Attributes:
        num_sequences: input sequences; ``total_tokens``: tokens placed in bins; ``num_packs``: bins.
        padding_tokens: empty slots, ``num_packs * capacity - total_tokens``.
        efficiency: ``total_tokens / (num_packs * capacity)`` (1.0 for no bins, as ``PackResult.efficiency``).
        padding_ratio: ``padding_tokens / (num_packs * capacity)`` (0.0 for no bins): ``1 - efficiency``.
        avg_utilisation, utilisation_std, min_utilisation, max_utilisation: over the bins' ``fill / capacity``
            (population standard deviation; all 0.0 for no bins).
        avg_sequences_per_pack: pieces per bin on average (0.0 for no bins).
        packing_time_ms: measured time of the pack call that made the plan (None for a plan made by hand).
        throughput: sequences per second of that call, ``num_sequences / (packing_time_ms / 1000)`` (None
            without a time, ``inf`` for a time of 0).
    """

    num_sequences: int
    total_tokens: int
    num_packs: int
    padding_tokens: int
    efficiency: float
    padding_ratio: float
    avg_utilisation: float
    utilisation_std: float
    min_utilisation: float
    max_utilisation: float
    avg_sequences_per_pack: float
    packing_time_ms: float | None

    @property
    def throughput(self) -> float | None:
        if self.packing_time_ms is None:
            return None
        if self.packing_time_ms == 0:
            return math.inf
        return self.num_sequences / (self.packing_time_ms / 1000.0)

    def __repr__(self) -> str:
        time = "n/a" if self.packing_time_ms is None else f"{self.packing_time_ms:.2f}ms"
        return f"PackMetrics(bins={self.num_packs}, efficiency={100 * self.efficiency:.2f}%, time={time})"


def build_metrics(num_sequences: int, fill: np.ndarray, num_pieces: int, capacity: int, efficiency: float,
                  packing_time_ms: float | None) -> PackMetrics:
    """:class:`PackMetrics` from the bins' fills ``(num_bins,) int64``; numpy reductions only."""
    num_bins = int(fill.shape[0])
    total = int(fill.sum())
    padding = num_bins * capacity - total
    if num_bins:
        util = fill / capacity
        stats = (float(util.mean()), float(util.std()), float(util.min()), float(util.max()))
    else:
        stats = (0.0, 0.0, 0.0, 0.0)
    return PackMetrics(
        num_sequences=num_sequences,
        total_tokens=total,
        num_packs=num_bins,
        padding_tokens=padding,
        efficiency=efficiency,
        padding_ratio=padding / (num_bins * capacity) if num_bins else 0.0,
        avg_utilisation=stats[0],
        utilisation_std=stats[1],
        min_utilisation=stats[2],
        max_utilisation=stats[3],
        avg_sequences_per_pack=num_pieces / num_bins if num_bins else 0.0,
        packing_time_ms=packing_time_ms,
    )
