"""Validation of what users hand to the packing engine, and the overlong policy.

Everything here runs once per call on whole arrays; a Python loop only ever runs on the error path.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, InvalidLengthsError, OverlongSequenceError, describe

OVERLONG_POLICIES = ("error", "truncate", "split", "drop")
# Sorting and best fit index arrays by token count (O(capacity) memory, 4-12 bytes per unit of capacity):
# 2**26 tokens (64 Mi, far beyond any context length) keeps that under a gigabyte.
MAX_CAPACITY = 2**26


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
    if isinstance(lengths, np.ndarray):
        arr = lengths
    else:
        if isinstance(lengths, (str, bytes, dict)) or np.isscalar(lengths):
            raise InvalidLengthsError(f"{name} must be a 1-D sequence of integers, got {describe(lengths)}")
        try:
            arr = np.asarray(lengths)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidLengthsError(
                f"{name} could not be read as an array ({exc}); pass a list, a numpy array or a CPU tensor"
            ) from exc
    if arr.ndim != 1:
        raise InvalidLengthsError(f"{name} must be 1-D, got an array of shape {arr.shape}")
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
        except OverflowError as exc:
            raise InvalidLengthsError(f"{name} holds a value that does not fit in int64") from exc
    elif kind == "u":
        if arr.dtype.itemsize >= 8 and (arr > np.iinfo(np.int64).max).any():
            i = int(np.argmax(arr > np.iinfo(np.int64).max))
            raise InvalidLengthsError(f"{name}[{i}] = {arr[i]} does not fit in int64")
        arr = arr.astype(np.int64)
    elif kind == "i":
        arr = arr.astype(np.int64, copy=False)
    else:
        raise InvalidLengthsError(
            f"{name} must hold integers, got dtype {arr.dtype} (first value {describe(arr.flat[0])})"
        )
    if arr.min() >= 1:  # the common case, without a boolean temporary
        return arr
    small = arr < 1
    if small.any():
        i = int(np.argmax(small))
        raise InvalidLengthsError(
            f"{name}[{i}] = {arr[i]}, but every length must be >= 1 ({int(small.sum())} of {arr.size} values are < 1)"
        )
    return arr


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


def apply_overlong(lengths: np.ndarray, capacity: int, policy: str) -> Pieces:
    """Turn sequences into placeable pieces of at most ``capacity`` tokens according to ``policy``.

    >>> p = apply_overlong(np.array([5, 2, 9]), 4, "split")
    >>> p.seq.tolist(), p.start.tolist(), p.length.tolist()
    ([0, 0, 1, 2, 2, 2], [0, 4, 0, 0, 4, 8], [4, 1, 2, 4, 4, 1])
    """
    policy = as_choice(policy, "overlong", OVERLONG_POLICIES)
    n = lengths.shape[0]
    empty = np.zeros(0, np.int64)
    if n == 0 or lengths.max() <= capacity:  # the common case: one pass, no temporaries
        return Pieces(None, None, lengths, empty, 0)
    over = lengths > capacity
    if policy == "error":
        i = int(np.argmax(over))
        raise OverlongSequenceError(
            f"lengths[{i}] = {lengths[i]} exceeds capacity={capacity} ({int(over.sum())} of {n} sequences are "
            f"longer than capacity, the longest is {int(lengths.max())}); raise capacity or pass "
            f"overlong='truncate', 'split' or 'drop'"
        )
    if policy == "truncate":
        truncated = int((lengths[over] - capacity).sum())
        # every piece is a whole sequence starting at token 0: only the lengths change
        return Pieces(None, None, np.minimum(lengths, capacity), empty, truncated, int(over.sum()))
    if policy == "drop":
        kept = np.flatnonzero(~over)
        return Pieces(kept, None, lengths[kept], np.flatnonzero(over), 0)
    # split: ceil(L / C) pieces per sequence, all full but the last
    counts = -(-lengths // capacity)
    seq = np.repeat(np.arange(n, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    rank = np.arange(seq.shape[0], dtype=np.int64) - np.repeat(first, counts)
    start = rank * capacity
    length = np.minimum(lengths[seq] - start, capacity)
    return Pieces(seq, start, length, empty, 0)
