"""The strategy registry: the names users type, the functions that place pieces, and what each one promises.

A strategy is a function ``(lengths, capacity, max_items, rng) -> (proc, bin_of, num_bins)`` over pieces that
already fit (see :mod:`padfree.packing.placement` for the contract). Its docstring states its cost; the
registry maps the short names users type to these functions. Inside a bin, pieces are in placement order:
input order for the strategies that take items in input order, decreasing length (ties in input order) for the
sorted ones. One strategy, ``wrapped``, takes whole sequences instead and cuts them where rows end
(:attr:`Strategy.cuts_at_row_edges`); :class:`~padfree.Packer` runs it through
:func:`padfree.packing.wrapped.wrap_sequences`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, describe
from padfree.packing import placement
from padfree.packing.wrapped import wrap_sequences

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


def _wrapped(lengths, capacity, max_items, rng):
    """Wrapped (TRL's name): the sequences back to back in input order, cut into full rows; every piece of a cut
    sequence is a sequence of its own. O(n). Takes whole sequences, not pieces that fit (see
    :func:`~padfree.packing.wrapped.wrap_sequences`); ``max_items`` and ``rng`` do not apply."""
    plan = wrap_sequences(lengths, capacity)
    bin_of = np.repeat(np.arange(plan.num_bins, dtype=np.int64), np.diff(plan.bin_offsets))
    return np.arange(plan.order.shape[0], dtype=np.int64), bin_of, plan.num_bins


@dataclass(frozen=True)
class Strategy:
    """A packing strategy: its short name, its full name, its function and what it is good for.

    ``input_order``: it takes items in input order, never sorting them first (a classic online bin-packing
    algorithm: next fit, first fit, ...); not the same as :class:`~padfree.StreamPacker`'s online mode, where a bin
    goes out as soon as it closes. ``randomized``: it draws from the seed. ``cuts_at_row_edges``: it cuts sequences
    where rows end, every cut piece a sequence of its own (``wrapped``), so nothing is ever longer than a row and it
    is given whole sequences rather than pieces that fit. ``aliases`` are the other names it answers to (SeqPacker's
    names); see :func:`as_strategy`.

    >>> STRATEGIES["nf"].input_order, STRATEGIES["obfd"].input_order, STRATEGIES["wrapped"].cuts_at_row_edges
    (True, False, True)
    """

    name: str
    fn: Callable[..., tuple[np.ndarray, np.ndarray, int]]
    input_order: bool
    randomized: bool = False
    full_name: str = ""
    aliases: tuple[str, ...] = ()
    cuts_at_row_edges: bool = False

    @property
    def doc(self) -> str:
        """The one-paragraph description, with the cost."""
        return " ".join((self.fn.__doc__ or "").split())


# read-only: the registry is the single list of valid names that every error message quotes. Aliases: the names
# SeqPacker documents for each algorithm (its enum names, its display names, its algorithm table's names).
STRATEGIES: Mapping[str, Strategy] = MappingProxyType({
    s.name: s
    for s in (
        Strategy("nf", _nf, input_order=True, full_name="NextFit"),
        Strategy("ff", _ff, input_order=True, full_name="FirstFit"),
        Strategy("bf", _bf, input_order=True, full_name="BestFit"),
        Strategy("wf", _wf, input_order=True, full_name="WorstFit"),
        Strategy("ffd", _ffd, input_order=False, full_name="FirstFitDecreasing"),
        Strategy("bfd", _bfd, input_order=False, full_name="BestFitDecreasing"),
        Strategy("obfd", _obfd, input_order=False, full_name="OptimizedBestFitDecreasing",
                 aliases=("OptimizedBFD", "OptimisedBestFitDecreasing", "OptimisedBFD")),
        Strategy("obfdp", _obfdp, input_order=False, full_name="ParallelOptimizedBestFitDecreasing",
                 aliases=("ParallelOBFD", "ParallelOptimisedBestFitDecreasing")),
        Strategy("mffd", _mffd, input_order=False, full_name="ModifiedFirstFitDecreasing", aliases=("ModifiedFFD",)),
        Strategy("ffs", _ffs, input_order=False, randomized=True, full_name="FirstFitShuffle"),
        Strategy("hk", _hk, input_order=True, full_name="Harmonic", aliases=("Harmonic-K",)),
        Strategy("wrapped", _wrapped, input_order=True, full_name="Wrapped", cuts_at_row_edges=True),
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

    The engine's inner step, shared by :class:`~padfree.Packer` and the streaming packer; no validation happens
    here. ``wrapped`` places whole sequences, not pieces: its pieces are not these ``lengths`` (use ``Packer``).
    """
    # n + 1 means "no limit" to the kernels; a larger limit (any Python int) would not even fit their int64
    limit = lengths.shape[0] + 1 if max_items is None else min(max_items, lengths.shape[0] + 1)
    proc, bin_of, num_bins = STRATEGIES[strategy].fn(lengths, capacity, limit, rng)
    return placement.group_by_bin(proc, bin_of, num_bins)
