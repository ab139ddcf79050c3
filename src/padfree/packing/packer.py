"""``pack_sequences`` and ``Packer``: lengths and a :class:`~padfree.PackingSpec` in, a plan out."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from padfree.packing.inputs import apply_overlong, as_lengths, as_seed
from padfree.packing.result import PackResult
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES, place
from padfree.packing.wrapped import wrap_sequences

__all__ = ["Packer", "pack_sequences"]


def pack_sequences(
    lengths: Any,
    capacity: int | None = None,
    strategy: str = DEFAULT_STRATEGY,
    seed: int | None = None,
    *,
    overlong: str = "error",
    max_sequences_per_bin: int | None = None,
    spec: PackingSpec | None = None,
) -> PackResult:
    """Pack sequences of the given lengths into bins of ``capacity`` tokens.

    Args:
        lengths: ``(num_sequences,)`` positive integers — a list, numpy array, CPU tensor or pyarrow array.
        capacity: tokens per bin (the packed row length), ``>= 1``.
        strategy: a short name of :data:`STRATEGIES` (see ``STRATEGIES[name].doc``), case-insensitive, or one of
            SeqPacker's names for it (:meth:`Packer.strategies`). The default ``obfd`` gives best-fit-decreasing
            bins in milliseconds for millions of sequences.
        seed: seeds the shuffle of randomized strategies (``ffs``); ``None`` draws fresh entropy. The other
            strategies are deterministic and ignore it.
        overlong: what to do with sequences longer than ``capacity``: ``"error"`` (raise, naming the first one),
            ``"truncate"`` (keep the first ``capacity`` tokens), ``"split"`` (cut into pieces of at most
            ``capacity`` tokens, each placed as its own sequence) or ``"drop"``. Truncated tokens and dropped
            sequences are counted in the result.
        max_sequences_per_bin: at most this many pieces per bin (``None``: no limit).
        spec: the five settings above as one :class:`~padfree.PackingSpec`, in place of them (a keyword given too
            is refused, naming both).

    ``strategy="wrapped"`` (TRL's name) keeps the input order and cuts the sequences, back to back, into full rows:
    every piece of a cut sequence is a sequence of its own (:attr:`Strategy.cuts_at_row_edges`).

    Returns:
        A :class:`PackResult`.

    >>> result = pack_sequences([900, 100, 500, 400, 600, 1500], capacity=1024, overlong="split")
    >>> result.bins  # sequence 5 (1500 tokens) was split into 1024 + 476
    [[5], [0, 1], [4, 3], [2, 5]]
    >>> result.piece_starts.tolist(), result.piece_lengths.tolist()
    ([0, 0, 0, 0, 0, 0, 1024], [1024, 900, 100, 600, 400, 500, 476])
    >>> f"{result.efficiency:.3f}", result.lower_bound
    ('0.977', 4)
    >>> pack_sequences([5, 3, 6], 4, "wrapped").bins  # full rows in input order, cut sequences in pieces
    [[0], [0, 1], [2], [2]]
    """
    return Packer(
        capacity, strategy, seed, overlong=overlong, max_sequences_per_bin=max_sequences_per_bin, spec=spec
    ).pack(lengths)


class Packer:
    """A reusable, validated packing configuration: ``Packer(capacity, ...).pack(lengths)``.

    Arguments are those of :func:`pack_sequences` and are checked once, here, into :attr:`spec`.

    >>> packer = Packer(4096, strategy="ffs", seed=0)
    >>> lengths = [1000, 3000, 2000, 2000, 96, 3000, 1000]
    >>> packer.pack(lengths).bins
    [[2, 4, 3], [6, 5], [0, 1]]
    >>> packer.pack(lengths, seed=1).bins  # another epoch, other rows
    [[5, 0, 4], [1, 6], [2, 3]]
    """

    def __init__(
        self,
        capacity: int | None = None,
        strategy: str = DEFAULT_STRATEGY,
        seed: int | None = None,
        *,
        overlong: str = "error",
        max_sequences_per_bin: int | None = None,
        spec: PackingSpec | None = None,
    ) -> None:
        self.spec = PackingSpec.resolve(spec, {"capacity": capacity, "strategy": strategy, "seed": seed,
                                               "overlong": overlong, "max_sequences_per_bin": max_sequences_per_bin})
        self.capacity = self.spec.capacity
        self.strategy: str = self.spec.strategy
        self.seed = self.spec.seed
        self.overlong = self.spec.overlong
        self.max_sequences_per_bin = self.spec.max_sequences_per_bin

    def pack(self, lengths: Any, *, seed: int | None = None) -> PackResult:
        """Pack ``lengths``; ``seed`` (if given) overrides the packer's seed for this call.

        An int64 array is kept by the plan as it is, not copied (a copy would cost ~15% of an ``obfd`` pack):
        do not write into it while the plan is in use.
        """
        began = time.perf_counter()
        seed = self.seed if seed is None else as_seed(seed)
        lengths = as_lengths(lengths)
        if self.spec.cuts_at_row_edges:  # whole sequences in: the strategy makes its own pieces
            plan = wrap_sequences(lengths, self.capacity)
            # a fresh plan of this call's own: its time is set in place rather than through another round of checks
            object.__setattr__(plan, "packing_time_ms", (time.perf_counter() - began) * 1000.0)
            return plan
        pieces = apply_overlong(lengths, self.capacity, self.overlong)
        spec = STRATEGIES[self.strategy]
        rng = np.random.default_rng(seed) if spec.randomized else None
        piece_order, offsets = place(pieces.length, self.capacity, self.strategy, self.max_sequences_per_bin, rng)
        split = pieces.start is not None
        shortened = split or pieces.num_truncated > 0
        # valid by construction, so the checks of PackResult(...) are skipped (see PackResult._trusted)
        return PackResult._trusted(
            lengths=lengths,
            capacity=self.capacity,
            order=piece_order if pieces.seq is None else pieces.seq[piece_order],
            bin_offsets=offsets,
            piece_starts=pieces.start[piece_order] if split else None,
            piece_lengths=pieces.length[piece_order] if shortened else None,
            dropped=pieces.dropped,
            truncated_tokens=pieces.truncated_tokens,
            num_truncated=pieces.num_truncated,
            strategy=self.strategy,
            seed=seed if spec.randomized else None,
            packing_time_ms=(time.perf_counter() - began) * 1000.0,
        )

    def pack_flat(self, lengths: Any, *, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Pack ``lengths`` into two flat arrays, SeqPacker's fast path: ``(items, split_offsets)``, both int64.

        ``items: (num_pieces,)`` holds the sequence ids bin after bin (:attr:`PackResult.order`) and
        ``split_offsets: (num_bins - 1,)`` the positions where a new bin starts, so that ``np.split(items,
        split_offsets)`` gives the bins. With ``overlong="split"`` a sequence id appears once per piece; use
        :meth:`pack` for the pieces' spans. An empty input gives ``np.split``'s one empty array.

        >>> items, split_offsets = Packer(8).pack_flat([5, 3, 4, 2, 6])
        >>> [b.tolist() for b in np.split(items, split_offsets)]
        [[4, 3], [0, 1], [2]]
        """
        result = self.pack(lengths, seed=seed)
        return result.order, result.bin_offsets[1:-1]

    @staticmethod
    def strategies() -> list[tuple[str, str]]:
        """The available strategies as ``(short_name, full_name)`` pairs, in :data:`STRATEGIES` order.

        Either name (in any case) may be passed as ``strategy``; SeqPacker's other names for an algorithm are
        accepted too (:func:`as_strategy`).

        >>> Packer.strategies()[:2]
        [('nf', 'NextFit'), ('ff', 'FirstFit')]
        """
        return [(spec.name, spec.full_name) for spec in STRATEGIES.values()]

    def __repr__(self) -> str:
        return (
            f"Packer(capacity={self.capacity}, strategy={self.strategy!r}, seed={self.seed}, "
            f"overlong={self.overlong!r}, max_sequences_per_bin={self.max_sequences_per_bin})"
        )
