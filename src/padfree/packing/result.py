"""PackResult: the packing plan — which sequence (or piece of one) goes in which bin — as flat CSR arrays."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, InvalidLengthsError, OutOfRangeError, PadfreeError, describe
from padfree.packing.inputs import INT64_MAX, as_capacity, as_int, as_seed, exact_sum
from padfree.packing.metrics import Pack, PackMetrics, build_metrics, build_packs

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
        packing_time_ms: measured wall time of the pack call that made the plan, in milliseconds (None for a
            plan made by hand); see :attr:`metrics`.

    A plan made by hand is checked when it is built, so that whatever reads it may index without checks; each
    rule broken raises an :class:`~padfree.InvalidArgumentError` (:class:`~padfree.InvalidLengthsError` for
    ``lengths``) naming the field, the value and the rule:

    - the arrays are 1-D and of any integer dtype (stored as int64); floats, booleans and objects are refused;
    - ``capacity`` is an integer in ``[1, 2**26]``, as for :func:`~padfree.pack_sequences`; ``lengths`` are
      ``>= 0`` and add up to at most ``2**63 - 1`` tokens, so that every total is an exact int64 sum;
    - ``order`` holds sequence ids ``0 <= id < num_sequences``, none of them in ``dropped`` (itself distinct ids);
    - ``bin_offsets`` starts at 0, never decreases and ends at ``len(order)`` (an empty bin is allowed);
    - every piece holds at least one token and lies inside its sequence: ``piece_starts >= 0``,
      ``piece_lengths >= 1`` and ``start + length <= lengths[order]``. ``piece_starts`` needs ``piece_lengths``;
      without ``piece_lengths`` every piece is its whole sequence;
    - a sequence is placed once, or as pieces that do not overlap; no bin holds more than ``capacity`` tokens;
    - ``truncated_tokens``, ``num_truncated`` are integers ``>= 0``, and placed + truncated + dropped tokens do
      not exceed the input's; ``packing_time_ms`` is None or a finite number ``>= 0``.

    A plan need not place every sequence (:meth:`take_bins` keeps some bins). The arrays are not copied: do not
    write into them afterwards.

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
    packing_time_ms: float | None = None

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def _trusted(cls, **values: Any) -> PackResult:
        """A plan built without the checks of ``__post_init__``, for plans that padfree computes valid by
        construction (the strategies' and :meth:`take_bins`'): on 1M lengths the checks cost about as much as the
        pack itself (80-135%: gathers and scatters at random ids), where skipping them costs nothing. The property
        tests rebuild such plans through the checks, so a strategy that broke a rule would still be caught."""
        plan = object.__new__(cls)
        for f in fields(cls):
            default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
            object.__setattr__(plan, f.name, values.pop(f.name, default))
        if values:
            raise TypeError(f"PackResult has no field {next(iter(values))!r}")  # a bug of padfree, not of input
        return plan

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

    @cached_property
    def packs(self) -> list[Pack]:
        """SeqPacker's view of the bins: one :class:`~padfree.packing.metrics.Pack` per bin, with its
        ``sequence_ids``, ``lengths`` and ``used`` tokens (built on first access, one small object per bin).

        >>> from padfree import pack_sequences
        >>> [(p.sequence_ids, p.lengths, p.used) for p in pack_sequences([5, 3, 4, 2, 6], capacity=8).packs]
        [([4, 3], [6, 2], 8), ([0, 1], [5, 3], 8), ([2], [4], 4)]
        """
        return build_packs(self.order, self.placed_lengths, self.bin_offsets, self.bin_fill, self.capacity)

    def bin(self, b: int) -> np.ndarray:
        """``(pieces in bin b,) int64`` — the sequence ids in bin ``b``, without building the list view."""
        b = as_int(b, "b")  # type: ignore[assignment]
        if not -self.num_bins <= b < self.num_bins:
            raise OutOfRangeError(f"b = {b} is not a bin of this plan: it has {self.num_bins} bins (b in "
                                  f"[{-self.num_bins}, {self.num_bins - 1}], negative counting from the end)")
        b %= self.num_bins
        return self.order[self.bin_offsets[b] : self.bin_offsets[b + 1]]

    def take_bins(self, bins: np.ndarray) -> PackResult:
        """The plan made of ``bins`` (``(k,)`` bin indices, negative ones counting from the end), in that order: one
        gather, pieces carried along.

        A bin listed twice is taken twice: that is a schedule repeating rows (as ``balance_bins(...,
        remainder="repeat")`` makes), whose pieces are placed twice and counted twice in its totals — the one
        plan the constructor would refuse, built here on purpose. Every other rule of a plan still holds.

        >>> from padfree import pack_sequences
        >>> r = pack_sequences([5, 3, 4, 2, 6], capacity=8)
        >>> r.take_bins(np.array([2, 0])).bins
        [[2], [4, 3]]
        """
        bins = _bin_ids(bins, self.num_bins)
        starts = self.bin_offsets[bins]
        sizes = self.bin_offsets[bins + 1] - starts
        offsets = np.zeros(bins.size + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        src = np.repeat(starts - offsets[:-1], sizes) + np.arange(int(offsets[-1]), dtype=np.int64)
        # bins of a valid plan make a valid plan (but for the repeats asked for): nothing to check again
        return PackResult._trusted(
            lengths=self.lengths, capacity=self.capacity, order=self.order[src], bin_offsets=offsets,
            piece_starts=None if self.piece_starts is None else self.piece_starts[src],
            piece_lengths=None if self.piece_lengths is None else self.piece_lengths[src],
            dropped=self.dropped, truncated_tokens=self.truncated_tokens, num_truncated=self.num_truncated,
            strategy=self.strategy, seed=self.seed, packing_time_ms=self.packing_time_ms,
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

    @cached_property
    def metrics(self) -> PackMetrics:
        """SeqPacker's :class:`~padfree.packing.metrics.PackMetrics` of the plan: efficiency, padding ratio,
        utilisation of the bins (mean, std, min, max), sequences per bin, the pack call's time and throughput.

        >>> from padfree import pack_sequences
        >>> m = pack_sequences([5, 3, 4, 2, 6], capacity=8).metrics
        >>> m.num_packs, m.padding_tokens, round(m.padding_ratio, 4), round(m.min_utilisation, 2), m.max_utilisation
        (3, 4, 0.1667, 0.5, 1.0)
        >>> m.packing_time_ms > 0 and m.throughput > 0  # measured: sequences per second of the pack call
        True
        """
        return build_metrics(self.num_sequences, self.bin_fill, self.num_pieces, self.capacity, self.efficiency,
                             self.packing_time_ms)

    @property
    def time_ms(self) -> float | None:
        """SeqPacker's shortcut for :attr:`packing_time_ms`."""
        return self.packing_time_ms

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


# --------------------------------------------------------------------------------------------------
# The checks of a plan: O(num_sequences + num_pieces) numpy passes, a sort only for split sequences
# --------------------------------------------------------------------------------------------------


def _ints(value: Any, name: str, error: type[PadfreeError] = InvalidArgumentError) -> np.ndarray:
    """``value`` as a 1-D int64 array: any integer dtype passes; floats, booleans and objects are refused."""
    accepted = f"{name} must be a 1-D array of integers"
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise error(f"{accepted}, got {describe(value)}, which could not be read as one ({exc})") from None
    if arr.ndim != 1:
        shape = f" of shape {arr.shape}" if arr.ndim else ""
        raise error(f"{accepted}, got {describe(value)}{shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)  # [] reads as float64: an empty list is still an empty list of ids
    if arr.dtype.kind not in "iu":
        raise error(f"{accepted} (any integer dtype), got dtype {arr.dtype} (first value {describe(arr[0])})")
    if arr.dtype == np.uint64 and int(arr.max()) > INT64_MAX:
        i = int(np.argmax(arr > INT64_MAX))
        raise error(f"{name}[{i}] = {arr[i]} does not fit in int64")
    return arr.astype(np.int64, copy=False)


def _time(value: Any) -> float | None:
    """``PackResult.packing_time_ms`` as None or a finite float >= 0."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(
            f"PackResult.packing_time_ms must be None or a number of milliseconds >= 0, got {describe(value)}"
        )
    number = float(value)
    if not 0.0 <= number < float("inf"):  # nan fails both comparisons
        raise InvalidArgumentError(
            f"PackResult.packing_time_ms must be None or a number of milliseconds >= 0, got {describe(value)}"
        )
    return number


def _first(bad: np.ndarray) -> int:
    return int(np.argmax(bad))


def _check(plan: PackResult) -> None:
    """Validate and normalise the fields of ``plan`` in place (the dataclass is frozen: fields are set through
    ``object.__setattr__``); the per-piece lengths and the bin fills it computes are kept as the caches."""
    store = object.__setattr__
    store(plan, "capacity", as_capacity(plan.capacity, "PackResult.capacity"))
    capacity = plan.capacity
    if not isinstance(plan.strategy, str):
        raise InvalidArgumentError(
            f"PackResult.strategy must be a string (the name of what made the plan), got {describe(plan.strategy)}"
        )
    store(plan, "seed", as_seed(plan.seed, "PackResult.seed"))
    store(plan, "packing_time_ms", _time(plan.packing_time_ms))

    lengths = _ints(plan.lengths, "PackResult.lengths", InvalidLengthsError)
    n = lengths.shape[0]
    if n and lengths.min() < 0:
        i = _first(lengths < 0)
        raise InvalidLengthsError(f"PackResult.lengths[{i}] = {lengths[i]}, but lengths are token counts (>= 0)")
    input_tokens = exact_sum(lengths)
    if input_tokens > INT64_MAX:
        raise InvalidLengthsError(
            f"PackResult.lengths add up to {input_tokens} tokens, more than an int64 count can hold ({INT64_MAX})"
        )
    ids = f"lengths has {n} sequences" + (f" (ids 0..{n - 1})" if n else "")

    order = _ints(plan.order, "PackResult.order")
    m = order.shape[0]
    if m and (order.min() < 0 or order.max() >= n):
        i = _first((order < 0) | (order >= n))
        raise InvalidArgumentError(f"PackResult.order[{i}] = {order[i]} is not a sequence id: {ids}")

    offsets = _ints(plan.bin_offsets, "PackResult.bin_offsets")
    if offsets.shape[0] == 0 or offsets[0] != 0 or offsets[-1] != m:
        raise InvalidArgumentError(
            f"PackResult.bin_offsets must start at 0 and end at len(order) = {m} (the bins' CSR offsets into "
            f"order), got {describe(offsets)}"
        )
    steps = np.diff(offsets)
    if steps.size and steps.min() < 0:
        b = _first(steps < 0)
        raise InvalidArgumentError(
            f"PackResult.bin_offsets must not decrease, but bin_offsets[{b + 1}] = {offsets[b + 1]} < "
            f"bin_offsets[{b}] = {offsets[b]}"
        )

    dropped = _ints(plan.dropped, "PackResult.dropped")
    if dropped.size:
        if dropped.min() < 0 or dropped.max() >= n:
            i = _first((dropped < 0) | (dropped >= n))
            raise InvalidArgumentError(f"PackResult.dropped[{i}] = {dropped[i]} is not a sequence id: {ids}")
        is_dropped = np.zeros(n, bool)
        is_dropped[dropped] = True
        if np.count_nonzero(is_dropped) < dropped.size:
            twice = np.sort(dropped)
            s = twice[_first(np.diff(twice) == 0)]
            raise InvalidArgumentError(f"PackResult.dropped lists sequence {s} twice; dropped ids are distinct")
        if m and is_dropped[order].any():
            i = _first(is_dropped[order])
            raise InvalidArgumentError(
                f"PackResult.order[{i}] = {order[i]} places a sequence that PackResult.dropped lists as dropped"
            )

    starts, placed = _pieces(plan, lengths, order)
    _disjoint(order, starts, placed, n)
    if plan.piece_lengths is not None:
        store(plan, "piece_lengths", placed)
        store(plan, "piece_starts", starts)

    # pieces are disjoint spans of sequences whose total fits in int64: these sums cannot wrap
    ends = np.zeros(m + 1, np.int64)
    np.cumsum(placed, out=ends[1:])
    fill = ends[offsets[1:]] - ends[offsets[:-1]]
    if fill.size and fill.max() > capacity:
        b = _first(fill > capacity)
        raise InvalidArgumentError(f"PackResult bin {b} holds {fill[b]} tokens, more than capacity={capacity}")

    truncated = as_int(plan.truncated_tokens, "PackResult.truncated_tokens", minimum=0)
    num_truncated = as_int(plan.num_truncated, "PackResult.num_truncated", minimum=0)
    if num_truncated > n:  # type: ignore[operator]
        raise InvalidArgumentError(f"PackResult.num_truncated = {num_truncated} is more than the {n} sequences")
    accounted = int(ends[-1]) + truncated + exact_sum(lengths[dropped])  # type: ignore[operator]
    if accounted > input_tokens:
        raise InvalidArgumentError(
            f"PackResult accounts for {accounted} tokens (placed + truncated_tokens + dropped) but lengths hold "
            f"{input_tokens}: truncated_tokens = {truncated} is too large"
        )
    for name, value in (("lengths", lengths), ("order", order), ("bin_offsets", offsets), ("dropped", dropped),
                        ("truncated_tokens", truncated), ("num_truncated", num_truncated)):
        store(plan, name, value)
    plan.__dict__["placed_lengths"] = placed  # the cached properties, already computed
    plan.__dict__["bin_fill"] = fill


def _pieces(plan: PackResult, lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """``(starts, placed)``: the checked ``piece_starts`` (None: every piece starts at token 0) and the tokens of
    every piece, ``(num_pieces,) int64``, each piece at least one token and inside its sequence."""
    m = order.shape[0]
    pieces = plan.piece_lengths
    starts = None if plan.piece_starts is None else _ints(plan.piece_starts, "PackResult.piece_starts")
    if starts is not None and pieces is None:
        raise InvalidArgumentError(
            f"PackResult.piece_starts = {describe(plan.piece_starts)} needs piece_lengths: a piece that starts "
            f"inside its sequence must say how many tokens it takes (pass both, or piece_lengths alone when every "
            f"piece starts at token 0)"
        )
    whole = lengths[order]
    if pieces is None:
        if m and whole.min() < 1:
            i = _first(whole < 1)
            raise InvalidArgumentError(
                f"PackResult.order[{i}] = {order[i]} places a sequence of 0 tokens; a placed piece holds >= 1 token"
            )
        return None, whole
    placed = _ints(pieces, "PackResult.piece_lengths")
    for name, arr in (("piece_lengths", placed), ("piece_starts", starts)):
        if arr is not None and arr.shape[0] != m:
            raise InvalidArgumentError(
                f"PackResult.{name} must have one entry per piece of order ({m}), got {arr.shape[0]} entries"
            )
    if m and placed.min() < 1:
        i = _first(placed < 1)
        raise InvalidArgumentError(f"PackResult.piece_lengths[{i}] = {placed[i]}, but a placed piece holds >= 1 token")
    room = whole
    if starts is not None:
        if m and starts.min() < 0:
            i = _first(starts < 0)
            raise InvalidArgumentError(
                f"PackResult.piece_starts[{i}] = {starts[i]}, but a piece starts at a token of its sequence (>= 0)"
            )
        room = whole - starts  # both in [0, 2**63): no wrap
    if (placed > room).any():
        i = _first(placed > room)
        first = 0 if starts is None else int(starts[i])
        raise InvalidArgumentError(
            f"PackResult piece {i} takes tokens [{first}, {first + int(placed[i])}) of sequence "
            f"order[{i}] = {order[i]}, which has lengths[{order[i]}] = {whole[i]}: a piece lies inside its sequence"
        )
    return starts, placed


def _disjoint(order: np.ndarray, starts: np.ndarray | None, placed: np.ndarray, n: int) -> None:
    """No token placed twice: a sequence appears once in ``order``, or as pieces whose spans do not overlap."""
    if order.shape[0] == 0:
        return
    count = np.bincount(order, minlength=n)
    if count.max() <= 1:
        return
    if starts is None:  # every piece starts at token 0: two pieces of one sequence overlap
        s = _first(count > 1)
        i, j = np.flatnonzero(order == s)[:2].tolist()
        raise InvalidArgumentError(
            f"PackResult.order places sequence {s} twice (order[{i}] and order[{j}]); a sequence is placed once, "
            f"or as pieces that do not overlap (piece_starts / piece_lengths)"
        )
    # only the pieces of sequences placed more than once are sorted, by (sequence, start); neighbours must not
    # overlap
    split = np.flatnonzero(count[order] > 1)
    split = split[np.lexsort((starts[split], order[split]))]
    a, b = split[:-1], split[1:]
    clash = (order[a] == order[b]) & (starts[a] + placed[a] > starts[b])
    if clash.any():
        k = _first(clash)
        i, j = int(a[k]), int(b[k])
        raise InvalidArgumentError(
            f"PackResult pieces {i} and {j} of sequence {order[i]} overlap: tokens [{starts[i]}, "
            f"{starts[i] + placed[i]}) and [{starts[j]}, {starts[j] + placed[j]}); the pieces of a sequence are "
            f"disjoint"
        )


def _bin_ids(bins: Any, num_bins: int) -> np.ndarray:
    """``bins`` as bin indices in ``[0, num_bins)`` (negative ones count from the end), or an error."""
    bins = _ints(bins, "bins")
    if bins.size and (bins.min() < -num_bins or bins.max() >= num_bins):
        i = _first((bins < -num_bins) | (bins >= num_bins))
        raise InvalidArgumentError(
            f"bins[{i}] = {bins[i]} is not a bin of this plan, which has {num_bins} bins (indices "
            f"{-num_bins}..{num_bins - 1})"
        )
    return bins % max(num_bins, 1)
