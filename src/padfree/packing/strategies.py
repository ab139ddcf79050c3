"""Strategy registry, ``pack_sequences`` and ``Packer``.

A strategy is a function ``(lengths, capacity, max_items, rng) -> (proc, bin_of, num_bins)`` over pieces that
already fit (see :mod:`padfree.packing.placement` for the contract). Its docstring states its cost; the
registry maps the short names users type to these functions. Inside a bin, pieces are in placement order:
input order for the online strategies, decreasing length (ties in input order) for the sorted ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, describe
from padfree.packing import placement
from padfree.packing.inputs import (
    OVERLONG_POLICIES,
    apply_overlong,
    as_capacity,
    as_choice,
    as_lengths,
    as_positive_int,
    as_seed,
)
from padfree.packing.result import PackResult

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "Strategy",
    "as_strategy",
    "place",
]

DEFAULT_STRATEGY = "obfd"

HARMONIC_CLASSES = 8  # k of harmonic-k: asymptotic ratio ~1.69 already at k = 8, more classes buy little


_NO_RUNS = np.zeros(0, np.int64)  # best_fit: one item per value, in the order given


def _fold(name: str) -> str:
    """``name`` as the registry compares it: lower case, without ``_``, ``-`` or spaces."""
    return name.lower().replace("_", "").replace("-", "").replace(" ", "")


def _identity(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def _nf(lengths, capacity, max_items, rng):
    """Next fit: keep one bin open, open a new one when the item does not fit. O(n), online, ratio 2."""
    return (_identity(lengths.shape[0]), *placement.next_fit_by_class(lengths, capacity, max_items, 1))


def _ff(lengths, capacity, max_items, rng):
    """First fit: the lowest-numbered open bin with room. O(n log n) with a max segment tree, online."""
    return (_identity(lengths.shape[0]), *placement.tree_fit(lengths, capacity, max_items, False))


def _bf(lengths, capacity, max_items, rng):
    """Best fit: the open bin with the least room that still fits (ties: lowest bin). O(n log n), online."""
    return (_identity(lengths.shape[0]), *placement.best_fit(lengths, _NO_RUNS, capacity, max_items, True))


def _wf(lengths, capacity, max_items, rng):
    """Worst fit: the open bin with the most room (ties: lowest bin). O(n log n) with a max segment tree."""
    return (_identity(lengths.shape[0]), *placement.tree_fit(lengths, capacity, max_items, True))


def _ffd(lengths, capacity, max_items, rng):
    """First fit decreasing: stable sort by length, then first fit. O(n + C) sort + O(n log n) placement.

    At most 11/9 OPT + 6/9 bins (Dósa 2007).
    """
    proc, values, runs = placement.counting_sort_decreasing(lengths, capacity)
    return (proc, *placement.tree_fit(np.repeat(values, runs), capacity, max_items, False))


def _bfd(lengths, capacity, max_items, rng):
    """Best fit decreasing, textbook form: stable sort, then best fit with ties to the lowest bin.

    O(n + C) sort + O(n log n) placement (a skew heap of bins per amount of room).
    """
    proc, values, runs = placement.counting_sort_decreasing(lengths, capacity)
    return (proc, *placement.best_fit(values, runs, capacity, max_items, True))


def _obfd(lengths, capacity, max_items, rng):
    """Optimized best fit decreasing: same bins as ``bfd`` in O(n + C) sort + O(n log_64 C) placement.

    Counting sort replaces the comparison sort (lengths are bounded by the capacity), and bins with equal room
    share a stack instead of a heap. Bins with equal room are interchangeable for every later choice, so the
    number of bins and the multiset of fills equal ``bfd``'s; only which of two equal bins gets an item differs.
    Under ``max_sequences_per_bin`` two bins with equal room but different counts are not interchangeable, so
    there the buckets keep ``bfd``'s lowest-index tie-break and the bins are exactly ``bfd``'s.
    """
    proc, values, runs = placement.counting_sort_decreasing(lengths, capacity)
    exact_ties = max_items <= lengths.shape[0]
    return (proc, *placement.best_fit(values, runs, capacity, max_items, exact_ties))


def _mffd(lengths, capacity, max_items, rng):
    """Modified first fit decreasing (Johnson & Garey 1985): at most 71/60 OPT + 1 bins. O(n + C) sort + O(n log n).

    Items are large (> C/2), medium (> C/3), small (> C/6) or tiny. Each large item opens a bin (largest first);
    forward through those bins each takes the largest medium item that fits; backward through the bins without
    one, where the two smallest small items fit, a bin takes the smallest and then the largest small item that
    fits; forward again, each bin takes the largest remaining items that fit; the rest go by first fit
    decreasing into new bins. It pairs large items with medium ones where FFD would waste room: best on lengths
    that mix long and mid-length sequences.
    """
    proc, values, runs = placement.counting_sort_decreasing(lengths, capacity)
    ordered = np.repeat(values, runs)
    bin_of, num_large = placement.mffd_large_bins(ordered, capacity, max_items)
    rest = np.flatnonzero(bin_of < 0)
    rest_bin, num_rest = placement.tree_fit(ordered[rest], capacity, max_items, False)
    bin_of[rest] = rest_bin + num_large
    return proc, bin_of, num_large + num_rest


OBFDP_SHARD_ITEMS = 50_000  # items per shard of obfdp; below two shards' worth it is obfd
OBFDP_MAX_SHARDS = 16


def obfdp_shards(n: int) -> int:
    """The number of shards ``obfdp`` packs ``n`` items in: a function of ``n`` alone, never of the machine, so
    that a plan is the same on every machine (1 means plain ``obfd``)."""
    return max(1, min(OBFDP_MAX_SHARDS, n // OBFDP_SHARD_ITEMS))


def parallel_best_fit_decreasing(
    lengths: np.ndarray, capacity: int, max_items: int, shards: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """``obfdp``'s placement with a given number of shards (``obfdp`` picks it with :func:`obfdp_shards`): the
    strategy contract ``(proc, bin_of, num_bins)`` for ``lengths (n,)`` in ``[1, capacity]``.

    The decreasing order is dealt round-robin to ``shards`` shards, packed at once by best fit decreasing
    (:func:`~padfree.packing.placement.sharded_best_fit`); then every bin with room for the smallest item is
    emptied and its items are packed again together, by best fit decreasing. A shard's waste sits in such bins
    (the tail where its small items ran out), so the repack brings the count back to ``obfd``'s.
    """
    proc, values, runs = placement.counting_sort_decreasing(lengths, capacity)
    n = lengths.shape[0]
    exact_ties = max_items <= n
    bin_of, num_kept = placement.sharded_best_fit(values, runs, capacity, max_items, shards, exact_ties)
    again = np.flatnonzero(bin_of < 0)
    repacked, num_repacked = placement.best_fit(np.repeat(values, runs)[again], _NO_RUNS, capacity, max_items,
                                              exact_ties)
    bin_of[again] = repacked + num_kept
    return proc, bin_of, int(num_kept) + num_repacked


def _obfdp(lengths, capacity, max_items, rng):
    """Parallel obfd: interleaved shards packed at once by best fit decreasing (numba ``prange``), then the bins
    with room left are repacked together. O(n + C) sort + O(n/p log_64 C) placement on p threads; within 0.1% of
    ``obfd``'s bins on large inputs. Below 100,000 items it is ``obfd`` (the shards would not pay for themselves).
    """
    shards = obfdp_shards(lengths.shape[0])
    if shards == 1:
        return _obfd(lengths, capacity, max_items, rng)
    return parallel_best_fit_decreasing(lengths, capacity, max_items, shards)


def _ffs(lengths, capacity, max_items, rng):
    """First fit over a seeded shuffle: O(n log n); a different seed gives different rows (reshuffle per epoch)."""
    proc = rng.permutation(lengths.shape[0]).astype(np.int64)
    return (proc, *placement.tree_fit(lengths[proc], capacity, max_items, False))


def _hk(lengths, capacity, max_items, rng):
    """Harmonic-k (k = 8): items in (C/(j+1), C/j] are packed j per bin, small ones next-fit. O(n), online."""
    return (_identity(lengths.shape[0]), *placement.next_fit_by_class(lengths, capacity, max_items, HARMONIC_CLASSES))


@dataclass(frozen=True)
class Strategy:
    """A packing strategy: its short name, its full name, its function and what it is good for.

    ``aliases`` are the other names it answers to (SeqPacker's names); see :func:`as_strategy`.
    """

    name: str
    fn: Callable[..., tuple[np.ndarray, np.ndarray, int]]
    online: bool
    randomized: bool = False
    full_name: str = ""
    aliases: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        """The one-paragraph description, with the cost."""
        return " ".join((self.fn.__doc__ or "").split())


# read-only: the registry is the single list of valid names that every error message quotes. Aliases: the names
# SeqPacker documents for each algorithm (its enum names, its display names, its algorithm table's names).
STRATEGIES: Mapping[str, Strategy] = MappingProxyType({
    s.name: s
    for s in (
        Strategy("nf", _nf, online=True, full_name="NextFit"),
        Strategy("ff", _ff, online=True, full_name="FirstFit"),
        Strategy("bf", _bf, online=True, full_name="BestFit"),
        Strategy("wf", _wf, online=True, full_name="WorstFit"),
        Strategy("ffd", _ffd, online=False, full_name="FirstFitDecreasing"),
        Strategy("bfd", _bfd, online=False, full_name="BestFitDecreasing"),
        Strategy("obfd", _obfd, online=False, full_name="OptimizedBestFitDecreasing",
                 aliases=("OptimizedBFD", "OptimisedBestFitDecreasing", "OptimisedBFD")),
        Strategy("obfdp", _obfdp, online=False, full_name="ParallelOptimizedBestFitDecreasing",
                 aliases=("ParallelOBFD", "ParallelOptimisedBestFitDecreasing")),
        Strategy("mffd", _mffd, online=False, full_name="ModifiedFirstFitDecreasing", aliases=("ModifiedFFD",)),
        Strategy("ffs", _ffs, online=False, randomized=True, full_name="FirstFitShuffle"),
        Strategy("hk", _hk, online=True, full_name="Harmonic", aliases=("Harmonic-K",)),
    )
})

# every accepted spelling, folded (see _fold), -> the canonical short name
_NAMES: Mapping[str, str] = MappingProxyType({
    folded: spec.name
    for spec in STRATEGIES.values()
    for folded in {_fold(n) for n in (spec.name, spec.full_name, *spec.aliases) if n}
})


def as_strategy(value: Any, name: str = "strategy") -> str:
    """The canonical short name of strategy ``value``, else an :class:`~padfree.InvalidArgumentError`.

    Names are case-insensitive and ignore ``_``, ``-`` and spaces; SeqPacker's names for its algorithms
    (``"FirstFitDecreasing"``, ``"OBFD"``, ``"Harmonic-K"``, ...) are accepted as aliases of the same strategy.

    >>> as_strategy("OBFD"), as_strategy("FirstFitDecreasing"), as_strategy("best_fit_decreasing")
    ('obfd', 'ffd', 'bfd')
    >>> as_strategy("best")
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidArgumentError: strategy must be one of 'nf', 'ff', 'bf', 'wf', 'ffd', 'bfd', 'obfd', ...
    """
    canonical = _NAMES.get(_fold(value)) if isinstance(value, str) else None
    if canonical is None:
        raise InvalidArgumentError(
            f"{name} must be one of {', '.join(map(repr, STRATEGIES))} (case-insensitive; SeqPacker's names such "
            f"as 'FirstFitDecreasing' or 'OBFD' are accepted as aliases, see Packer.strategies()); "
            f"got {describe(value)}"
        )
    return canonical


def place(
    lengths: np.ndarray,
    capacity: int,
    strategy: str,
    max_items: int | None = None,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Place already-valid pieces: ``lengths (n,) int64`` in ``[1, capacity]`` -> ``(order (n,), offsets (bins + 1,))``.

    The engine's inner step, shared by :class:`Packer` and the streaming packer; no validation happens here.
    """
    # n + 1 means "no limit" to the kernels; a larger limit (any Python int) would not even fit their int64
    limit = lengths.shape[0] + 1 if max_items is None else min(max_items, lengths.shape[0] + 1)
    proc, bin_of, num_bins = STRATEGIES[strategy].fn(lengths, capacity, limit, rng)
    return placement.group_by_bin(proc, bin_of, num_bins)


def pack_sequences(
    lengths: Any,
    capacity: int,
    strategy: str = DEFAULT_STRATEGY,
    seed: int | None = None,
    *,
    overlong: str = "error",
    max_sequences_per_bin: int | None = None,
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

    Returns:
        A :class:`PackResult`.

    >>> result = pack_sequences([900, 100, 500, 400, 600, 1500], capacity=1024, overlong="split")
    >>> result.bins  # sequence 5 (1500 tokens) was split into 1024 + 476
    [[5], [0, 1], [4, 3], [2, 5]]
    >>> result.piece_starts.tolist(), result.piece_lengths.tolist()
    ([0, 0, 0, 0, 0, 0, 1024], [1024, 900, 100, 600, 400, 500, 476])
    >>> f"{result.efficiency:.3f}", result.lower_bound
    ('0.977', 4)
    """
    return Packer(
        capacity, strategy, seed, overlong=overlong, max_sequences_per_bin=max_sequences_per_bin
    ).pack(lengths)


class Packer:
    """A reusable, validated packing configuration: ``Packer(capacity, ...).pack(lengths)``.

    Arguments are those of :func:`pack_sequences` and are checked once, here.

    >>> packer = Packer(4096, strategy="ffs", seed=0)
    >>> lengths = [1000, 3000, 2000, 2000, 96, 3000, 1000]
    >>> packer.pack(lengths).bins
    [[2, 4, 3], [6, 5], [0, 1]]
    >>> packer.pack(lengths, seed=1).bins  # another epoch, other rows
    [[5, 0, 4], [1, 6], [2, 3]]
    """

    def __init__(
        self,
        capacity: int,
        strategy: str = DEFAULT_STRATEGY,
        seed: int | None = None,
        *,
        overlong: str = "error",
        max_sequences_per_bin: int | None = None,
    ) -> None:
        self.capacity = as_capacity(capacity)
        self.strategy: str = as_strategy(strategy)
        self.seed = as_seed(seed)
        self.overlong = as_choice(overlong, "overlong", OVERLONG_POLICIES)
        self.max_sequences_per_bin = as_positive_int(max_sequences_per_bin, "max_sequences_per_bin", allow_none=True)

    def pack(self, lengths: Any, *, seed: int | None = None) -> PackResult:
        """Pack ``lengths``; ``seed`` (if given) overrides the packer's seed for this call.

        An int64 array is kept by the plan as it is, not copied (a copy would cost ~15% of an ``obfd`` pack):
        do not write into it while the plan is in use.
        """
        began = time.perf_counter()
        seed = self.seed if seed is None else as_seed(seed)
        lengths = as_lengths(lengths)
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
