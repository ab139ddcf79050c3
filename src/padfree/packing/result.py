"""PackResult: the packing plan — which sequence (or piece of one) goes in which bin — as flat CSR arrays."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, describe

__all__ = ["PackResult", "as_pack_result"]


@dataclass(frozen=True, eq=False)
class PackResult:
    """A packing plan over ``num_sequences`` input sequences. A plan, not data: no token is stored here.

    Bin ``b`` holds the pieces ``order[bin_offsets[b]:bin_offsets[b + 1]]``, in the order they sit in the row.
    Without an overlong policy at work every piece is a whole sequence; after ``overlong="split"`` or
    ``"truncate"``, ``piece_starts``/``piece_lengths`` give the token span ``[start, start + length)`` each piece
    takes from its sequence (``piece_starts`` is None when every piece starts at token 0, as after truncation).

    Attributes:
        lengths: ``(num_sequences,) int64`` — the input lengths, untouched.
        capacity: tokens per bin.
        order: ``(num_pieces,) int64`` — sequence id of every placed piece, bin after bin.
        bin_offsets: ``(num_bins + 1,) int64`` — CSR offsets into ``order``; ``bin_offsets[0] == 0``.
        piece_starts: ``(num_pieces,) int64`` or None — first token of each piece within its sequence (None: 0).
        piece_lengths: ``(num_pieces,) int64`` or None — tokens of each piece (None: the whole sequence).
        dropped: ``(num_dropped,) int64`` — ids of sequences removed by ``overlong="drop"``.
        truncated_tokens: tokens cut off by ``overlong="truncate"``; ``num_truncated``: sequences that lost some.
        strategy: the strategy that made the plan; ``seed``: its seed, if it used one.

    >>> from padfree import pack_sequences
    >>> r = pack_sequences([5, 3, 4, 2, 6], capacity=8)
    >>> r.bins
    [[4, 3], [0, 1], [2]]
    >>> r.num_bins, r.lower_bound, r.padding_tokens, round(r.efficiency, 4)
    (3, 3, 4, 0.8333)
    >>> r.bin_fill
    array([8, 8, 4])
    """

    lengths: np.ndarray
    capacity: int
    order: np.ndarray
    bin_offsets: np.ndarray
    piece_starts: np.ndarray | None = None
    piece_lengths: np.ndarray | None = None
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    truncated_tokens: int = 0
    num_truncated: int = 0
    strategy: str = "obfd"
    seed: int | None = None

    # ---- sizes -----------------------------------------------------------------------------------

    @property
    def num_bins(self) -> int:
        """Number of bins (packed rows)."""
        return int(self.bin_offsets.shape[0] - 1)

    @property
    def num_sequences(self) -> int:
        """Number of input sequences, placed or not."""
        return int(self.lengths.shape[0])

    @property
    def num_pieces(self) -> int:
        """Number of placed pieces (sequences, or pieces of split sequences)."""
        return int(self.order.shape[0])

    def __len__(self) -> int:
        return self.num_bins

    # ---- per piece and per bin ---------------------------------------------------------------------

    @cached_property
    def placed_lengths(self) -> np.ndarray:
        """``(num_pieces,) int64`` — tokens of every placed piece, aligned with ``order``."""
        if self.piece_lengths is not None:
            return self.piece_lengths
        return self.lengths[self.order]

    @cached_property
    def bin_fill(self) -> np.ndarray:
        """``(num_bins,) int64`` — real tokens in each bin."""
        if self.num_bins == 0:
            return np.zeros(0, np.int64)
        csum = np.concatenate(([0], np.cumsum(self.placed_lengths)))
        return np.diff(csum[self.bin_offsets])

    @property
    def bin_sizes(self) -> np.ndarray:
        """``(num_bins,) int64`` — pieces in each bin."""
        return np.diff(self.bin_offsets)

    @cached_property
    def bins(self) -> list[list[int]]:
        """The plan as a list of bins, each a list of sequence ids (built on first access, O(num_pieces))."""
        return [chunk.tolist() for chunk in np.split(self.order, self.bin_offsets[1:-1])] if self.num_bins else []

    def bin(self, b: int) -> np.ndarray:
        """``(pieces in bin b,) int64`` — the sequence ids in bin ``b``, without building the list view."""
        if not -self.num_bins <= b < self.num_bins:
            raise IndexError(f"bin {b} out of range for {self.num_bins} bins")
        b %= self.num_bins
        return self.order[self.bin_offsets[b] : self.bin_offsets[b + 1]]

    def take_bins(self, bins: np.ndarray) -> PackResult:
        """The plan made of ``bins`` (``(k,)`` bin indices), in that order: one gather, pieces carried along.

        >>> from padfree import pack_sequences
        >>> r = pack_sequences([5, 3, 4, 2, 6], capacity=8)
        >>> r.take_bins(np.array([2, 0])).bins
        [[2], [4, 3]]
        """
        bins = np.asarray(bins, dtype=np.int64)
        starts = self.bin_offsets[bins]
        sizes = self.bin_offsets[bins + 1] - starts
        offsets = np.zeros(bins.size + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        src = np.repeat(starts - offsets[:-1], sizes) + np.arange(int(offsets[-1]), dtype=np.int64)
        return replace(
            self, order=self.order[src], bin_offsets=offsets,
            piece_starts=None if self.piece_starts is None else self.piece_starts[src],
            piece_lengths=None if self.piece_lengths is None else self.piece_lengths[src],
        )

    # ---- totals and quality ------------------------------------------------------------------------

    @cached_property
    def total_tokens(self) -> int:
        """Tokens placed in bins."""
        return int(self.placed_lengths.sum())

    @property
    def input_tokens(self) -> int:
        """Tokens in the input sequences (placed + truncated + dropped)."""
        return int(self.lengths.sum())

    @property
    def dropped_tokens(self) -> int:
        """Tokens of the sequences removed by ``overlong="drop"``."""
        return int(self.lengths[self.dropped].sum())

    @property
    def num_dropped(self) -> int:
        """Sequences removed by ``overlong="drop"``."""
        return int(self.dropped.shape[0])

    @property
    def lower_bound(self) -> int:
        """``ceil(total_tokens / capacity)``: no plan of these pieces can use fewer bins."""
        return -(-self.total_tokens // self.capacity)

    @property
    def padding_tokens(self) -> int:
        """Slots left empty: ``num_bins * capacity - total_tokens``."""
        return self.num_bins * self.capacity - self.total_tokens

    @property
    def efficiency(self) -> float:
        """Fraction of bin slots holding real tokens, ``total_tokens / (num_bins * capacity)`` (1.0 for no bins)."""
        return self.total_tokens / (self.num_bins * self.capacity) if self.num_bins else 1.0

    def summary(self) -> str:
        """A readable multi-line report of the plan.

        >>> from padfree import pack_sequences
        >>> print(pack_sequences([5, 3, 4, 2, 6, 11], capacity=8, overlong="split").summary())
        PackResult  strategy=obfd  capacity=8
          sequences        6 in, 7 pieces placed (1 split)
          tokens           31 placed of 31 (0 truncated in 0 sequences, 0 dropped in 0 sequences)
          bins             4 (lower bound 4)
          efficiency       96.88%  (1 padding tokens)
          fill per bin     min 7, median 8, max 8
          pieces per bin   min 1, median 2, max 2
        """
        split = self.num_pieces - (self.num_sequences - self.num_dropped)
        fill = self.bin_fill if self.num_bins else np.zeros(1, np.int64)
        sizes = self.bin_sizes if self.num_bins else np.zeros(1, np.int64)
        head = f"PackResult  strategy={self.strategy}  capacity={self.capacity}"
        if self.seed is not None:
            head += f"  seed={self.seed}"
        lines = [
            head,
            f"  sequences        {self.num_sequences} in, {self.num_pieces} pieces placed"
            + (f" ({split} split)" if split > 0 else ""),
            f"  tokens           {self.total_tokens} placed of {self.input_tokens} ({self.truncated_tokens} truncated"
            f" in {self.num_truncated} sequences,"
            f" {self.dropped_tokens} dropped in {self.num_dropped} sequences)",
            f"  bins             {self.num_bins} (lower bound {self.lower_bound})",
            f"  efficiency       {100 * self.efficiency:.2f}%  ({self.padding_tokens} padding tokens)",
            f"  fill per bin     min {fill.min()}, median {np.median(fill):g}, max {fill.max()}",
            f"  pieces per bin   min {sizes.min()}, median {np.median(sizes):g}, max {sizes.max()}",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"PackResult(strategy={self.strategy!r}, capacity={self.capacity}, num_sequences={self.num_sequences}, "
            f"num_bins={self.num_bins}, efficiency={self.efficiency:.4f})"
        )


def as_pack_result(value: Any, name: str = "result") -> PackResult:
    """``value`` if it is a :class:`PackResult`, else an :class:`InvalidArgumentError` naming ``name``.

    The one check of every function that takes a plan: a list of bins or a dict would otherwise fail later
    with an ``AttributeError`` that names neither the argument nor what was expected.

    >>> from padfree import pack_sequences
    >>> as_pack_result(pack_sequences([3, 2], 8)).bins
    [[0, 1]]
    >>> as_pack_result([[0, 1]], "plan")
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidArgumentError: plan must be a PackResult from pack_sequences / Packer.pack, got [[0, 1]] ...
    """
    if not isinstance(value, PackResult):
        raise InvalidArgumentError(
            f"{name} must be a PackResult from pack_sequences / Packer.pack, got {describe(value)}"
        )
    return value
