"""What packing would buy on a dataset, from its sequence lengths alone.

:func:`analyze_lengths` compares the naive way of batching — fixed-size batches of sequences in random order,
each padded to its longest sequence (or to the capacity) — with packing the same sequences into rows of
``capacity`` tokens, for every strategy of the packing engine and for a few candidate capacities, and picks a
capacity to recommend. It only computes: the ``padfree analyze`` command renders the result.

Every number is a whole-array numpy expression over the lengths (per-batch maxima come from one
``np.maximum.reduceat``), so a million sequences take well under a second plus the packing itself.

Conventions, shared by every number here:

- a sequence longer than the capacity is *truncated* to it, in the padded batches and in the packed rows alike,
  so both sides hold the same real tokens and the ratio of their positions is the ratio of their costs;
- the random order is ``np.random.default_rng(seed).permutation(n)``; batch ``b`` holds the sequences at
  positions ``[b * batch_size, (b + 1) * batch_size)`` of that order, and the last batch may be smaller;
- attention cost counts score entries: ``rows * width**2`` for a padded batch, ``sum(len**2)`` for packed rows
  (block-diagonal attention, as varlen kernels compute it). Causal masking halves both sides alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, InvalidLengthsError
from padfree.packing import DEFAULT_STRATEGY, STRATEGIES, pack_sequences
from padfree.packing.inputs import as_lengths, as_positive_int, as_seed

__all__ = [
    "MAX_OVERLONG_FRACTION",
    "MIN_EFFICIENCY",
    "CapacityCandidate",
    "LengthAnalysis",
    "LengthStats",
    "PaddedBatches",
    "StrategyTiming",
    "analyze_lengths",
    "candidate_capacities",
    "padded_batches",
]

logger = logging.getLogger("padfree")

#: A capacity is recommended only if it truncates at most this fraction of the sequences ...
MAX_OVERLONG_FRACTION = 0.01
#: ... and packs at least this fraction of its row positions with real tokens.
MIN_EFFICIENCY = 0.95


@dataclass(frozen=True)
class LengthStats:
    """Summary statistics of ``count`` sequence lengths (percentiles use numpy's linear interpolation)."""

    count: int
    total_tokens: int
    min: int
    mean: float
    median: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, lengths: np.ndarray) -> LengthStats:
        """The statistics of ``lengths: (n,) int64``, ``n >= 1``."""
        median, p90, p99 = np.percentile(lengths, [50, 90, 99])
        return cls(
            count=int(lengths.shape[0]),
            total_tokens=int(lengths.sum()),
            min=int(lengths.min()),
            mean=float(lengths.mean()),
            median=float(median),
            p90=float(p90),
            p99=float(p99),
            max=int(lengths.max()),
        )


@dataclass(frozen=True)
class PaddedBatches:
    """Naive batching: ``batch_size`` sequences per batch in random order, each row padded.

    Attributes:
        batch_size, capacity: the batching; sequences longer than ``capacity`` are truncated to it.
        num_sequences, num_batches: ``num_batches = ceil(num_sequences / batch_size)``.
        real_tokens: tokens left after truncation, ``sum(min(len, capacity))``.
        truncated_sequences, truncated_tokens: sequences longer than ``capacity``, and the tokens cut from them.
        positions_longest: ``sum over batches of rows * min(longest, capacity)`` — every batch padded to its
            longest sequence.
        positions_capacity: ``num_sequences * capacity`` — every row padded to the capacity.
        attention_longest: ``sum over batches of rows * min(longest, capacity)**2`` (float: it can pass 2**63).
    """

    batch_size: int
    capacity: int
    num_sequences: int
    num_batches: int
    real_tokens: int
    truncated_sequences: int
    truncated_tokens: int
    positions_longest: int
    positions_capacity: int
    attention_longest: float

    @property
    def waste_longest(self) -> float:
        """Fraction of positions that are padding when each batch is padded to its longest sequence."""
        return 1.0 - self.real_tokens / self.positions_longest

    @property
    def waste_capacity(self) -> float:
        """Fraction of positions that are padding when every row is padded to the capacity."""
        return 1.0 - self.real_tokens / self.positions_capacity


@dataclass(frozen=True)
class StrategyTiming:
    """One packing strategy at the requested capacity.

    ``time_ms`` is the median wall time of ``pack_sequences`` over a few runs after a warm-up run (which
    compiles the numba kernels, or loads them from numba's on-disk cache).
    """

    name: str
    online: bool
    num_bins: int
    lower_bound: int
    efficiency: float
    padding_tokens: int
    time_ms: float


@dataclass(frozen=True)
class CapacityCandidate:
    """Packing with :data:`DEFAULT_STRATEGY` (or the analysis' ``candidate_strategy``) at one capacity.

    Attributes:
        capacity: tokens per packed row; ``requested``: whether it is the capacity that was asked for.
        overlong, truncated_tokens: sequences longer than ``capacity`` and the tokens truncation removes.
        num_bins, efficiency: packed rows and the fraction of their positions holding real tokens.
        padded_positions: positions of the naive padded batches at this capacity (padded to the longest).
        packed_positions: ``num_bins * capacity``.
        speedup: ``padded_positions / packed_positions`` — real tokens per second, packed over padded, when a
            step's cost is proportional to its positions.
        attention_padded, attention_packed: attention score entries, padded batches vs block-diagonal packed.
        attention_ratio: ``attention_padded / attention_packed``.
    """

    capacity: int
    requested: bool
    overlong: int
    truncated_tokens: int
    num_bins: int
    efficiency: float
    padded_positions: int
    packed_positions: int
    speedup: float
    attention_padded: float
    attention_packed: float
    attention_ratio: float


@dataclass(frozen=True)
class LengthAnalysis:
    """The result of :func:`analyze_lengths`; see there for the meaning of every part."""

    stats: LengthStats
    capacity: int
    batch_size: int
    seed: int | None
    padded: PaddedBatches
    strategies: tuple[StrategyTiming, ...]
    candidate_strategy: str
    candidates: tuple[CapacityCandidate, ...]
    recommended: int
    reason: str

    @property
    def overlong(self) -> int:
        """Sequences longer than the requested capacity (truncated in every comparison)."""
        return self.padded.truncated_sequences

    def strategy(self, name: str) -> StrategyTiming:
        """The row of strategy ``name``."""
        for row in self.strategies:
            if row.name == name:
                return row
        raise KeyError(f"strategy {name!r} was not analyzed; analyzed: {', '.join(r.name for r in self.strategies)}")

    def candidate(self, capacity: int) -> CapacityCandidate:
        """The row of candidate ``capacity``."""
        for row in self.candidates:
            if row.capacity == capacity:
                return row
        raise KeyError(f"capacity {capacity} was not analyzed; analyzed: {[r.capacity for r in self.candidates]}")


def padded_batches(lengths: Any, capacity: int, batch_size: int, seed: int | None = 0) -> PaddedBatches:
    """The positions and padding of naive fixed-size batches in random order (see the module docstring).

    Args:
        lengths: ``(n,)`` positive integers.
        capacity: row limit; longer sequences are truncated to it.
        batch_size: sequences per batch (the last batch may hold fewer).
        seed: seed of the order ``np.random.default_rng(seed).permutation(n)``.

    >>> p = padded_batches([1, 7, 1, 7, 3], capacity=8, batch_size=5)
    >>> p.positions_longest, p.real_tokens, f"{p.waste_longest:.3f}", p.positions_capacity
    (35, 19, '0.457', 40)
    """
    lengths = as_lengths(lengths)
    capacity = as_positive_int(capacity, "capacity")
    batch_size = as_positive_int(batch_size, "batch_size")
    order = np.random.default_rng(as_seed(seed)).permutation(lengths.shape[0])
    return _padded(lengths[order], capacity, batch_size)


def _padded(shuffled: np.ndarray, capacity: int, batch_size: int) -> PaddedBatches:
    n = shuffled.shape[0]
    kept = np.minimum(shuffled, capacity)
    starts = np.arange(0, n, batch_size)
    # one reduceat gives every batch's longest sequence; rows per batch only differ for the last one
    width = np.maximum.reduceat(kept, starts)
    rows = np.diff(np.append(starts, n))
    over = shuffled > capacity
    return PaddedBatches(
        batch_size=batch_size,
        capacity=capacity,
        num_sequences=n,
        num_batches=int(starts.shape[0]),
        real_tokens=int(kept.sum()),
        truncated_sequences=int(over.sum()),
        truncated_tokens=int((shuffled[over] - capacity).sum()),
        positions_longest=int((rows * width).sum()),
        positions_capacity=n * capacity,
        attention_longest=float((rows * np.square(width.astype(np.float64))).sum()),
    )


def candidate_capacities(p99: float, requested: int) -> list[int]:
    """Powers of two around the 99th-percentile length, plus the requested capacity, sorted.

    With ``P`` the smallest power of two ``>= p99``: ``P/4, P/2, P, 2P`` — the smallest rows that keep 99% of the
    sequences whole, two smaller ones that trade truncation for memory, and one larger one.

    >>> candidate_capacities(1500.0, 2048)
    [512, 1024, 2048, 4096]
    >>> candidate_capacities(30000.5, 2048)
    [2048, 8192, 16384, 32768, 65536]
    """
    top = 1 << (max(1, int(np.ceil(p99))) - 1).bit_length()
    return sorted({c for c in (top // 4, top // 2, top, 2 * top) if c >= 1} | {requested})


def _validate_strategies(strategies: Iterable[str] | None) -> list[str]:
    if strategies is None:
        return list(STRATEGIES)
    names = [strategies] if isinstance(strategies, str) else list(strategies)
    if not names:
        raise InvalidArgumentError(f"strategies must name at least one of {', '.join(STRATEGIES)}; got none")
    for name in names:
        if name not in STRATEGIES:
            raise InvalidArgumentError(
                f"strategies: unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}"
            )
    return list(dict.fromkeys(names))  # drop repeats, keep the order given


def _time_strategy(lengths: np.ndarray, capacity: int, name: str, seed: int | None, repeats: int) -> StrategyTiming:
    # overlong="truncate" is a no-op when nothing is longer than capacity, and otherwise matches the
    # truncation the padded batches get, so both sides hold the same tokens
    # a strategy that cuts at the rows' edges would keep every token rather than truncate: it gets the tokens the
    # others keep, so that every row of the table packs the same tokens
    overlong = "truncate"
    if STRATEGIES[name].cuts_at_row_edges:
        lengths, overlong = np.minimum(lengths, capacity), "error"
    result = pack_sequences(lengths, capacity, name, seed, overlong=overlong)  # warm-up: JIT or cache load
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pack_sequences(lengths, capacity, name, seed, overlong=overlong)
        times.append(time.perf_counter() - start)
    time_ms = 1e3 * float(np.median(times))
    logger.debug("strategy %s: %d bins in %.3f ms", name, result.num_bins, time_ms)
    return StrategyTiming(
        name=name,
        online=STRATEGIES[name].input_order,
        num_bins=result.num_bins,
        lower_bound=result.lower_bound,
        efficiency=result.efficiency,
        padding_tokens=result.padding_tokens,
        time_ms=time_ms,
    )


def _candidate(lengths: np.ndarray, shuffled: np.ndarray, capacity: int, requested: bool, batch_size: int,
               strategy: str, seed: int | None) -> CapacityCandidate:
    padded = _padded(shuffled, capacity, batch_size)
    # the input order, as in the strategy table, so that both report the same plan at the requested capacity
    packed = pack_sequences(lengths, capacity, strategy, seed, overlong="truncate")
    packed_positions = packed.num_bins * capacity
    attention_packed = float(np.square(np.minimum(lengths, capacity).astype(np.float64)).sum())
    return CapacityCandidate(
        capacity=capacity,
        requested=requested,
        overlong=padded.truncated_sequences,
        truncated_tokens=padded.truncated_tokens,
        num_bins=packed.num_bins,
        efficiency=packed.efficiency,
        padded_positions=padded.positions_longest,
        packed_positions=packed_positions,
        speedup=padded.positions_longest / packed_positions,
        attention_padded=padded.attention_longest,
        attention_packed=attention_packed,
        attention_ratio=padded.attention_longest / attention_packed,
    )


def _recommend(candidates: Sequence[CapacityCandidate], requested: int, count: int) -> tuple[int, str]:
    by_capacity = sorted(candidates, key=lambda c: c.capacity)
    whole = [c for c in by_capacity if c.overlong <= MAX_OVERLONG_FRACTION * count]
    good = [c for c in whole if c.efficiency >= MIN_EFFICIENCY]
    rule = (f"at most {MAX_OVERLONG_FRACTION:.0%} of the sequences truncated and at least "
            f"{MIN_EFFICIENCY:.0%} packing efficiency")
    asked = next(c for c in candidates if c.requested)
    if asked in good:
        text = (f"the requested capacity already meets the bar ({rule}): {asked.overlong:,} truncated, "
                f"{asked.efficiency:.1%} efficiency, {asked.speedup:.2f}x the real tokens per step of padded batches")
        if good[0] is not asked:
            # worth knowing when memory is tight: shorter rows give the same tokens per step with more rows
            text += (f"; {good[0].capacity:,} would meet it too with shorter rows "
                     f"({good[0].efficiency:.1%} efficiency)")
        return requested, text
    if good:
        # the shortest row that meets the bar: same throughput per token, least activation memory per row
        best = good[0]
        why = f"the smallest candidate with {rule}"
    elif whole:
        best = max(whole, key=lambda c: (c.efficiency, -c.capacity))
        why = (f"no candidate reaches {MIN_EFFICIENCY:.0%} efficiency with at most {MAX_OVERLONG_FRACTION:.0%} "
               f"of the sequences truncated; this one packs best among those that keep "
               f"{1 - MAX_OVERLONG_FRACTION:.0%} whole")
    else:
        best = min(by_capacity, key=lambda c: (c.overlong, c.capacity))
        why = "every candidate truncates more than 1% of the sequences; this one truncates the fewest"
    text = (f"{why}: {best.overlong:,} truncated ({best.overlong / count:.1%}), {best.efficiency:.1%} efficiency, "
            f"{best.speedup:.2f}x the real tokens per step of padded batches")
    if asked is not best:
        text += (f"; the requested {requested:,} truncates {asked.overlong:,} ({asked.overlong / count:.1%}) "
                 f"at {asked.efficiency:.1%} efficiency")
    return best.capacity, text


def analyze_lengths(
    lengths: Any,
    capacity: int,
    *,
    batch_size: int = 8,
    strategies: Iterable[str] | None = None,
    capacities: Iterable[int] | None = None,
    seed: int | None = 0,
    repeats: int = 3,
) -> LengthAnalysis:
    """Compare padded batching with packing for these sequence lengths, and recommend a capacity.

    Args:
        lengths: ``(n,)`` positive integers, ``n >= 1`` — a list, numpy array, CPU tensor or pyarrow array.
        capacity: the packed row length to evaluate (also the padding/truncation limit of the naive batches).
        batch_size: sequences per naive padded batch.
        strategies: names from ``padfree.packing.STRATEGIES`` to time (default: all of them, in registry order).
        capacities: the candidate capacities (default: :func:`candidate_capacities`); the requested
            ``capacity`` is always one of them.
        seed: seed of the random order of the padded batches and of randomized strategies (``ffs``).
        repeats: timed runs per strategy, after one warm-up run; the median is reported.

    Returns:
        A :class:`LengthAnalysis` with

        - ``stats``: :class:`LengthStats` of the untruncated lengths;
        - ``padded``: :class:`PaddedBatches` at ``capacity`` (waste when padding to the longest in each batch or
          to the capacity; sequences over ``capacity`` truncated and counted);
        - ``strategies``: one :class:`StrategyTiming` per strategy at ``capacity``, packed with
          ``overlong="truncate"`` (``analysis.overlong`` says how many sequences that truncates);
        - ``candidates``: one :class:`CapacityCandidate` per candidate capacity, packed with
          ``candidate_strategy`` (:data:`DEFAULT_STRATEGY`, or the first of ``strategies`` if it is not there);
        - ``recommended`` and ``reason``: the requested capacity if it truncates at most
          :data:`MAX_OVERLONG_FRACTION` of the sequences and packs at :data:`MIN_EFFICIENCY` or better, else the
          smallest candidate that does (less memory per row at the same throughput), else the most efficient
          among those that truncate little, else the one that truncates least.

    >>> a = analyze_lengths([100, 900, 300, 700, 500, 500, 50, 950, 2000], capacity=1024, batch_size=3)
    >>> a.stats.count, a.stats.total_tokens, a.stats.max, a.overlong
    (9, 6000, 2000, 1)
    >>> a.padded.real_tokens, a.padded.positions_longest, a.padded.positions_capacity
    (5024, 7422, 9216)
    >>> r = a.strategy("obfd")
    >>> r.num_bins, r.lower_bound, round(r.efficiency, 3)
    (5, 5, 0.981)
    >>> [c.capacity for c in a.candidates], a.recommended
    ([512, 1024, 2048, 4096], 2048)
    >>> c = a.candidate(1024)
    >>> round(c.speedup, 3), round(c.attention_ratio, 3)
    (1.45, 1.714)
    """
    lengths = as_lengths(lengths)
    if lengths.shape[0] == 0:
        raise InvalidLengthsError("lengths is empty: there is nothing to analyze")
    capacity = as_positive_int(capacity, "capacity")
    batch_size = as_positive_int(batch_size, "batch_size")
    repeats = as_positive_int(repeats, "repeats")
    seed = as_seed(seed)
    names = _validate_strategies(strategies)
    candidate_strategy = DEFAULT_STRATEGY if DEFAULT_STRATEGY in names else names[0]

    stats = LengthStats.of(lengths)
    if capacities is None:
        sizes = candidate_capacities(stats.p99, capacity)
    else:
        sizes = sorted({as_positive_int(c, "capacities[]") for c in capacities} | {capacity})

    shuffled = lengths[np.random.default_rng(seed).permutation(lengths.shape[0])]
    padded = _padded(shuffled, capacity, batch_size)
    timings = tuple(_time_strategy(lengths, capacity, name, seed, repeats) for name in names)
    candidates = tuple(
        _candidate(lengths, shuffled, size, size == capacity, batch_size, candidate_strategy, seed) for size in sizes
    )
    recommended, reason = _recommend(candidates, capacity, stats.count)
    return LengthAnalysis(
        stats=stats,
        capacity=capacity,
        batch_size=batch_size,
        seed=seed,
        padded=padded,
        strategies=timings,
        candidate_strategy=candidate_strategy,
        candidates=candidates,
        recommended=recommended,
        reason=reason,
    )
