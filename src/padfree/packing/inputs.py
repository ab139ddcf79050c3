"""Validation of what users hand to the packing engine, and the overlong policy.

Everything here runs once per call on whole arrays; a Python loop only ever runs on the error path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, InvalidLengthsError, OverlongSequenceError, describe

OVERLONG_POLICIES = ("error", "truncate", "split", "drop")
# Sorting and best fit index arrays by token count (O(capacity) memory, 4-12 bytes per unit of capacity):
# 2**26 tokens (64 Mi, far beyond any context length) keeps that under a gigabyte.
MAX_CAPACITY = 2**26
# The placement kernels index pieces and bins with int32 (half the memory traffic of int64 on their hot loops),
# so one call can place at most 2**31 - 1 pieces; past that the indices would wrap and the plan would be wrong.
# The limit is checked before anything is allocated, which also stops a typo from turning into a split of
# absurd size: [2**40] at capacity 16 would be 2**36 pieces, ~4 TiB of index arrays. Below the limit a plan
# costs ~50 bytes per piece, a fraction of the token data the pieces stand for at any capacity worth training at.
MAX_PIECES = 2**31 - 1
INT64_MAX = int(np.iinfo(np.int64).max)


def as_lengths(lengths: Any, name: str = "lengths") -> np.ndarray:
    """``lengths`` as a 1-D int64 numpy array of positive integers, or an :class:`InvalidLengthsError`.

    Accepts a list or tuple, a numpy array, or anything with ``__array__`` (a CPU torch tensor, a pyarrow
    array) — torch is never imported. Floats are accepted only when every value is a whole number.

    >>> as_lengths([3, 1, 2])
    array([3, 1, 2])
    >>> as_lengths([3, 0])
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidLengthsError: lengths[1] = 0, but every length must be >= 1 (1 of 2 values are < 1)
    """
    accepted = "pass one length per sequence: a list, a numpy array or a CPU tensor of integers"
    if isinstance(lengths, np.ndarray):
        arr = lengths
    else:
        if lengths is None or isinstance(lengths, (str, bytes, dict)) or np.isscalar(lengths):
            raise InvalidLengthsError(f"{name} must be a 1-D sequence of integers, got {describe(lengths)}")
        try:
            arr = np.asarray(lengths)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidLengthsError(
                f"{name} must be a 1-D sequence of integers, got {describe(lengths)}, which could not be read as an "
                f"array ({exc}); {accepted}"
            ) from exc
    if arr.ndim == 0:
        raise InvalidLengthsError(f"{name} must be a 1-D sequence of integers, got {describe(lengths)}")
    if arr.ndim != 1:
        raise InvalidLengthsError(f"{name} must be 1-D, got an array of shape {arr.shape}; {accepted}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    kind = arr.dtype.kind
    if kind == "b":
        raise InvalidLengthsError(f"{name} must hold integers, got booleans (dtype {arr.dtype})")
    if kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidLengthsError(
                f"{name}[{i}] = {arr[i].item()!r} is not an integer; every length must be a whole number"
            )
        arr = arr.astype(np.int64)
    elif kind == "O":
        for i, value in enumerate(arr):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidLengthsError(f"{name}[{i}] = {describe(value)} is not an integer")
        try:
            arr = arr.astype(np.int64)
        except OverflowError:
            # Python ints beyond int64: name the first one (a loop on the error path only)
            i, value = next((i, v) for i, v in enumerate(arr) if not -(2**63) <= v <= INT64_MAX)
            raise InvalidLengthsError(
                f"{name}[{i}] = {value} does not fit in int64; a length is an integer in [1, {INT64_MAX}]"
            ) from None
    elif kind == "u":
        if arr.dtype.itemsize >= 8 and (arr > np.iinfo(np.int64).max).any():
            i = int(np.argmax(arr > np.iinfo(np.int64).max))
            raise InvalidLengthsError(
                f"{name}[{i}] = {arr[i]} does not fit in int64; a length is an integer in [1, {INT64_MAX}]"
            )
        arr = arr.astype(np.int64)
    elif kind == "i":
        arr = arr.astype(np.int64, copy=False)
        k = first_bool(lengths, arr) if isinstance(lengths, (list, tuple)) else None
        if k is not None:  # numpy reads [3, True] as [3, 1]
            raise InvalidLengthsError(f"{name}[{k}] = {describe(lengths[k])} is not an integer; a length is an integer "
                                      f">= 1, never a bool")
    else:
        raise InvalidLengthsError(
            f"{name} must hold integers, got dtype {arr.dtype} (first value {describe(arr.flat[0])})"
        )
    if arr.min() < 1:
        small = arr < 1
        i = int(np.argmax(small))
        raise InvalidLengthsError(
            f"{name}[{i}] = {arr[i]}, but every length must be >= 1 ({int(small.sum())} of {arr.size} values are < 1)"
        )
    # Every count derived from the lengths (placed, truncated, dropped tokens; offsets of token buffers) is an
    # int64 sum somewhere; refusing a total past int64 here is what makes all of them exact, downstream too.
    # Only when max * n passes int64 can the total do so: then add it up exactly.
    if int(arr.max()) * arr.shape[0] > INT64_MAX and (total := exact_sum(arr)) > INT64_MAX:
        raise InvalidLengthsError(
            f"{name} add up to {total} tokens, more than an int64 count can hold ({INT64_MAX}); "
            f"lengths are token counts of sequences that exist (the largest here is {int(arr.max())})"
        )
    return arr


def first_bool(values: Any, converted: np.ndarray) -> int | None:
    """The position of the first Python ``bool`` in the list or tuple ``values``, which ``converted`` (its int64
    conversion, one entry per item) read as 0 or 1 — or None.

    numpy and ``array("q")`` both take ``True`` for 1: a 0/1 mask passed where ids or lengths belong would pass
    unseen. Only items that converted to 0 or 1 can be bools, so only those are looked at, by C-level iteration
    (``itemgetter`` and ``map(type, ...)``), never a Python loop over the items.

    >>> first_bool([5, 1, True], np.array([5, 1, 1])), first_bool([5, 1], np.array([5, 1]))
    (2, None)
    """
    small = np.flatnonzero(converted.view(np.uint64) <= 1) if converted.dtype == np.int64 else np.flatnonzero(
        (converted == 0) | (converted == 1))
    if small.shape[0] == 0:
        return None
    picked = operator.itemgetter(*small.tolist())(values)
    types = list(map(type, picked if small.shape[0] > 1 else (picked,)))
    if bool not in types:
        return None
    return int(small[types.index(bool)])


def exact_sum(values: np.ndarray) -> int:
    """The sum of ``values: (n,) int64``, all ``>= 0``, as an exact Python int (numpy's int64 sum wraps).

    >>> exact_sum(np.array([2**62] * 3))
    13835058055282163712
    """
    if values.shape[0] == 0:
        return 0
    if int(values.max()) * values.shape[0] <= INT64_MAX:  # the common case: one int64 sum cannot wrap
        return int(values.sum())
    # Split every value into 32-bit halves: a chunk of 2**30 halves sums below 2**62, so no partial sum wraps.
    total = 0
    for chunk in range(0, values.shape[0], 2**30):  # one iteration below a billion values
        part = values[chunk : chunk + 2**30]
        total += (int((part >> 32).sum()) << 32) + int((part & 0xFFFFFFFF).sum())
    return total


def as_capacity(value: Any, name: str = "capacity") -> int:
    """``value`` as a Python int in ``[1, MAX_CAPACITY]``, else :class:`InvalidArgumentError`."""
    capacity: int = as_positive_int(value, name)  # type: ignore[assignment]
    if capacity > MAX_CAPACITY:
        raise InvalidArgumentError(f"{name} must be an integer >= 1 and <= {MAX_CAPACITY}, got {capacity}")
    return capacity


def as_int(value: Any, name: str, *, minimum: int | None = None, allow_none: bool = False) -> int | None:
    """``value`` as a Python int (``>= minimum`` when given; None when allowed), else :class:`InvalidArgumentError`.

    Accepts Python and numpy integers, never ``bool`` and never a float, even a whole one.

    >>> as_int(3, "k", minimum=1), as_int(None, "k", allow_none=True)
    (3, None)
    """
    if value is None and allow_none:
        return None
    accepted = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (" or None" if allow_none else "")
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be {accepted}, got {describe(value)}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be {accepted}, got {describe(value)}") from None
    if minimum is not None and number < minimum:
        raise InvalidArgumentError(f"{name} must be {accepted}, got {number}")
    return number


def as_positive_int(value: Any, name: str, *, allow_none: bool = False) -> int | None:
    """``value`` as a Python int >= 1 (or None when allowed), else :class:`InvalidArgumentError`."""
    return as_int(value, name, minimum=1, allow_none=allow_none)


def as_fraction(value: Any, name: str) -> float:
    """``value`` as a float in ``[0, 1]`` (a Python or numpy real number, not a bool), else
    :class:`InvalidArgumentError`.

    >>> as_fraction(np.float32(0.5), "hold_fill")
    0.5
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{name} must be a number in [0, 1], got {describe(value)}")
    number = float(value)
    if not 0.0 <= number <= 1.0:  # nan fails both comparisons
        raise InvalidArgumentError(f"{name} must be a number in [0, 1], got {describe(value)}")
    return number


def as_seed(seed: Any, name: str = "seed") -> int | None:
    """``seed`` as None or a non-negative Python int, else :class:`InvalidArgumentError`."""
    if seed is None:
        return None
    if isinstance(seed, bool):
        raise InvalidArgumentError(f"{name} must be None or an integer >= 0, got {describe(seed)}")
    try:
        number = operator.index(seed)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be None or an integer >= 0, got {describe(seed)}") from None
    if number < 0:
        raise InvalidArgumentError(f"{name} must be None or an integer >= 0, got {number}")
    return number


def as_flag(value: Any, name: str) -> bool:
    """``value`` as a bool — only ``True`` / ``False`` (numpy's too), else :class:`InvalidArgumentError`: a string such
    as ``"yes"`` from a config file, or a 0/1, would otherwise be read by truthiness.

    >>> as_flag(True, "shuffle")
    True
    """
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be True or False, got {describe(value)}")
    return bool(value)


def as_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else :class:`InvalidArgumentError` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(map(repr, choices))}; got {describe(value)}")
    return value


@dataclass(frozen=True)
class Pieces:
    """What the packer places after the overlong policy: one entry per piece, in input order.

    ``seq: (m,) int64 | None`` sequence id of each piece (None: piece i is sequence i); ``start: (m,) int64 | None``
    first token of the piece inside its sequence (None: every piece starts at token 0); ``length: (m,) int64``;
    ``dropped: (d,) int64`` ids of dropped sequences; ``truncated_tokens`` / ``num_truncated``: tokens cut off by
    ``"truncate"`` and the number of sequences that lost them.
    """

    seq: np.ndarray | None
    start: np.ndarray | None
    length: np.ndarray
    dropped: np.ndarray
    truncated_tokens: int
    num_truncated: int = 0

    def sequence_ids(self) -> np.ndarray:
        """``(m,) int64`` — the sequence of every piece, materialized."""
        return np.arange(self.length.shape[0], dtype=np.int64) if self.seq is None else self.seq


def refuse_overlong(lengths: np.ndarray, limit: int, *, names: Callable[[int], str] = lambda i: f"lengths[{i}]",
                    limit_name: str = "capacity") -> None:
    """The one refusal of sequences longer than a row (``overlong="error"``): name the first, count them all.

    Every entry point calls it with its own names for the sequences (``samples[3]``, ``dataset[7]['input_ids']``)
    and for the limit (``capacity``, ``max_length``), so one fault reads the same wherever it is found.

    >>> refuse_overlong(np.array([3, 9, 12]), 8)
    Traceback (most recent call last):
    ...
    padfree.errors.OverlongSequenceError: lengths[1] has 9 tokens, more than capacity=8 (2 of 3 sequences are \
longer, the longest has 12); raise capacity or pass overlong='truncate', 'split' or 'drop'
    """
    if lengths.size == 0 or lengths.max() <= limit:
        return
    over = lengths > limit
    i = int(np.argmax(over))
    raise OverlongSequenceError(
        f"{names(i)} has {lengths[i]} tokens, more than {limit_name}={limit} ({int(over.sum())} of {lengths.size} "
        f"sequences are longer, the longest has {int(lengths.max())}); raise {limit_name} or pass "
        f"overlong='truncate', 'split' or 'drop'"
    )


def apply_overlong(lengths: np.ndarray, capacity: int, policy: str) -> Pieces:
    """Turn sequences into placeable pieces of at most ``capacity`` tokens according to ``policy``.

    >>> p = apply_overlong(np.array([5, 2, 9]), 4, "split")
    >>> p.seq.tolist(), p.start.tolist(), p.length.tolist()
    ([0, 0, 1, 2, 2, 2], [0, 4, 0, 0, 4, 8], [4, 1, 2, 4, 4, 1])
    """
    policy = as_choice(policy, "overlong", OVERLONG_POLICIES)
    n = lengths.shape[0]
    if n > MAX_PIECES:
        raise InvalidLengthsError(
            f"lengths has {n} sequences, more than the {MAX_PIECES} pieces one call can place (the packing "
            f"kernels index pieces with int32); pack the data in parts or stream it with StreamPacker"
        )
    empty = np.zeros(0, np.int64)
    if n == 0 or lengths.max() <= capacity:  # the common case: one pass, no temporaries
        return Pieces(None, None, lengths, empty, 0)
    over = lengths > capacity
    if policy == "error":
        refuse_overlong(lengths, capacity)
    if policy == "truncate":
        truncated = int((lengths[over] - capacity).sum())
        # every piece is a whole sequence starting at token 0: only the lengths change
        return Pieces(None, None, np.minimum(lengths, capacity), empty, truncated, int(over.sum()))
    if policy == "drop":
        kept = np.flatnonzero(~over)
        return Pieces(kept, None, lengths[kept], np.flatnonzero(over), 0)
    # split: ceil(L / C) pieces per sequence, all full but the last
    counts = -(-lengths // capacity)
    num_pieces = int(counts.sum())  # counts <= lengths, whose total as_lengths keeps within int64
    if num_pieces > MAX_PIECES:
        i = int(np.argmax(counts))
        raise InvalidLengthsError(
            f"overlong='split' would cut lengths into {num_pieces} pieces of at most capacity={capacity} tokens "
            f"(lengths[{i}] = {lengths[i]} alone into {counts[i]}), more than the {MAX_PIECES} pieces one call "
            f"can place (the packing kernels index pieces with int32); raise capacity or pass "
            f"overlong='truncate' or 'drop'"
        )
    seq = np.repeat(np.arange(n, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    rank = np.arange(seq.shape[0], dtype=np.int64) - np.repeat(first, counts)
    start = rank * capacity
    length = np.minimum(lengths[seq] - start, capacity)
    return Pieces(seq, start, length, empty, 0)
