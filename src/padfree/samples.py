"""The front door for samples: every accepted form of token sequences becomes flat buffers, checked once.

Every entry point that takes samples — :func:`padfree.rows.packed_rows`, :func:`padfree.pack_result_to_tensors`,
:func:`padfree.pack_dataset`, the collators, :class:`padfree.PackingDataset`, :class:`padfree.IterablePackingDataset`
and the CLI — reads them here, so one input gives one answer and one error wherever it goes in:

>>> buf = read_tokens([[5, 6, 7], [8, 9]])
>>> buf.values.tolist(), buf.offsets.tolist(), buf.lengths.tolist()
([5, 6, 7, 8, 9], [0, 3, 5], [3, 2])
>>> read_tokens([[5, 6], [7, -1]])
Traceback (most recent call last):
...
padfree.errors.InvalidTokensError: token_ids[1][1] = -1 is negative; token ids are integers >= 0
>>> ids, labels = read_samples([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5]}])
Traceback (most recent call last):
...
padfree.errors.InvalidSampleError: samples[0] has 'labels' but samples[1] has none; give labels to every sample \
of a batch or to none

What is accepted: lists or tuples of ints, numpy integer arrays, torch integer tensors, pyarrow list arrays
(zero-copy), a ``(values, offsets)`` pair, a :class:`TokenBuffers`; samples as token sequences or as dicts with the
ids under ``input_ids`` (and optionally ``labels``). The checks: every token is an integer (never a bool) that fits
int64, token ids are >= 0 (and below ``vocab_size`` when it is known), a label is a token id or the ignored label
``-100`` (what the loss skips; an entry point with another ``label_padding_value`` accepts that one too), labels are
aligned with their ids one per token.

The faults, one class each: :class:`~padfree.errors.InvalidSampleError` for a sample's shape (not a sequence, a
missing key, no tokens, labels of another length, samples of mixed forms) and
:class:`~padfree.errors.InvalidTokensError` for a token's value (not an integer, negative, out of the vocabulary,
too large). Both name the sample, the field and the token. A dict sample that is already a packed row carries its
boundaries in any spelling of :data:`BOUNDARY_KEYS` (:func:`row_boundaries`);
:class:`~padfree.errors.InvalidLayoutError` names the sample and the field of a spelling that is wrong or disagrees.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, InvalidLayoutError, InvalidSampleError, InvalidTokensError, describe
from padfree.layout import IGNORE_INDEX
from padfree.packing.inputs import first_bool

__all__ = [
    "BOUNDARY_KEYS",
    "TokenBuffers",
    "as_fill_value",
    "check_tokens",
    "concat",
    "length_of",
    "read_arrow_chunks",
    "read_samples",
    "read_sequence",
    "read_tokens",
    "refuse_empty",
    "row_boundaries",
    "split_sample",
]

_INT64_MAX = np.iinfo(np.int64).max
_KINDS = ("ids", "labels", "values")


@dataclass(frozen=True, eq=False)
class TokenBuffers:
    """Sequences of tokens as one flat buffer: sequence ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    ``values: (total,)`` integer token ids (or labels); ``offsets: (num_sequences + 1,) int64``. The offsets need not
    start at 0 (a sliced Arrow array keeps its parent's values).
    """

    values: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """``(num_sequences,) int64``."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def take(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> TokenBuffers:
        """Piece ``j`` = tokens ``[starts[j], starts[j] + lengths[j])`` of sequence ``rows[j]``, as new buffers.

        >>> TokenBuffers(np.arange(10), np.array([0, 4, 10])).take(np.array([1, 0]), np.array([2, 0]),
        ...                                                         np.array([3, 1])).values.tolist()
        [6, 7, 8, 0]
        """
        offsets = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        src = np.repeat(self.offsets[:-1][rows] + starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return TokenBuffers(self.values[src], offsets)


def concat(arrays: Sequence[np.ndarray]) -> TokenBuffers:
    """One :class:`TokenBuffers` of int64 from 1-D integer arrays (each already checked: the cast cannot wrap).

    >>> concat([np.array([1, 2]), np.array([3])]).offsets.tolist()
    [0, 2, 3]
    """
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays, dtype=np.int64, casting="unsafe") if len(arrays) else np.zeros(0, np.int64)
    return TokenBuffers(values, offsets)


# --------------------------------------------------------------------------------------------------
# Values: one vectorized pass, and on the error path the first offender by name
# --------------------------------------------------------------------------------------------------


def check_tokens(
    values: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    names: Callable[[int], str],
    *,
    kind: str = "ids",
    vocab_size: int | None = None,
    chunks: Sequence[tuple[np.ndarray, int]] | None = None,
    ignored: Sequence[int] = (IGNORE_INDEX,),
) -> tuple[int, int]:
    """Check the tokens of rows ``values[starts[i]:starts[i] + lengths[i]]``; return their ``(min, max)``.

    ``kind="ids"``: integers in ``[0, vocab_size)`` (``vocab_size`` None: any non-negative int64); ``"labels"``:
    token ids (below ``vocab_size`` when it is known) or one of the ``ignored`` labels (``-100``: no target) — any
    other negative value would fail later, inside the loss; ``"values"``: any integer that fits int64 (a per-token
    column carried as it is). ``names(i)`` names row ``i`` in a message. ``chunks`` lists ``(array, base)`` pieces
    of ``values`` to scan instead of the span the rows cover (``values[base:base + array.size]`` is ``array``) — for
    columns whose chunks lie apart in memory.

    >>> check_tokens(np.array([3, 1, 4]), np.array([0]), np.array([3]), lambda i: f"ids[{i}]")
    (1, 4)
    """
    if chunks is None:
        nonempty = lengths > 0
        if not nonempty.any():
            return 0, 0
        lo = int(starts[nonempty].min())
        chunks = [(values[lo:int((starts + lengths)[nonempty].max())], lo)]
    chunks = [(c, base) for c, base in chunks if c.size]
    if not chunks:
        return 0, 0
    dtype = chunks[0][0].dtype
    if dtype.kind not in "iu":
        raise InvalidTokensError(f"{names(0)} must hold integer token {kind}, got dtype {dtype}")
    low = min(int(c.min()) for c, _ in chunks)
    high = max(int(c.max()) for c, _ in chunks)
    faults = []
    if high > _INT64_MAX:
        faults.append((lambda c: c > _INT64_MAX, "does not fit int64 (token values are at most 2**63 - 1)"))
    if kind == "ids" and low < 0:
        faults.append((lambda c: c < 0, "is negative; token ids are integers >= 0"))
    if kind == "labels" and low < 0:
        allowed = sorted({int(v) for v in ignored if v < 0})
        spelled = " or ".join(map(str, allowed)) or "none"
        faults.append((lambda c: _negative_except(c, allowed),
                       f"is not a label: a label is a token id >= 0 or the ignored label {spelled} (no target)"))
    if vocab_size is not None and high >= vocab_size and kind != "values":
        faults.append((lambda c: c >= vocab_size, f"is not below the vocabulary size {vocab_size}"))
    for bad, why in faults:
        # the ignored label is almost always there (low < 0): a fault is looked for before it is located
        if any(bool(bad(c).any()) for c, _ in chunks):
            _raise_first(chunks, bad, why, starts, lengths, names)
    return low, high


def _negative_except(values: np.ndarray, allowed: Sequence[int]) -> np.ndarray:
    """``values < 0`` but for the ``allowed`` negative values (the ignored labels)."""
    bad = values < 0
    for value in allowed:
        bad &= values != value
    return bad


def _raise_first(chunks: Sequence[tuple[np.ndarray, int]], bad: Callable[[np.ndarray], np.ndarray], why: str,
                 starts: np.ndarray, lengths: np.ndarray, names: Callable[[int], str]) -> None:
    """Name the first row (in row order) holding a token that ``bad`` flags, and where in the row (error path)."""
    hits = np.concatenate([np.flatnonzero(bad(c)) + base for c, base in chunks])
    order = np.argsort(starts, kind="stable")
    j = np.searchsorted(starts[order], hits, side="right") - 1
    row = order[np.maximum(j, 0)]
    inside = (j >= 0) & (hits < starts[row] + lengths[row])
    if not inside.any():  # flagged values lie between rows (a sliced Arrow child): nothing a row holds is wrong
        return
    pick = np.flatnonzero(inside)
    first = pick[np.lexsort((hits[pick], row[pick]))[0]]
    i, at = int(row[first]), int(hits[first])
    value = next(int(c[at - base]) for c, base in chunks if base <= at < base + c.size)
    raise InvalidTokensError(f"{names(i)}[{at - int(starts[i])}] = {value} {why}")


def refuse_empty(lengths: np.ndarray, names: Callable[[int], str]) -> None:
    """Every sequence needs a token: name the first empty one, and count them all.

    >>> refuse_empty(np.array([3, 0, 0]), lambda i: f"samples[{i}]")
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidSampleError: samples[1] has no tokens (2 of 3 samples are empty); every sample needs at \
least one: filter the empty ones out first
    """
    if lengths.size and lengths.min() < 1:
        i = int(np.argmax(lengths < 1))
        raise InvalidSampleError(
            f"{names(i)} has no tokens ({int((lengths < 1).sum())} of {lengths.size} samples are empty); every sample "
            f"needs at least one: filter the empty ones out first"
        )


def as_fill_value(value: Any, name: str, dtype: Any = np.int64) -> int:
    """A padding token or ignored label (``padding_value``, ``label_padding_value``): an integer — never a bool, a
    float or a string — that fits ``dtype``, the type of the column it is written into.

    >>> as_fill_value(-100, "label_padding_value")
    -100
    >>> as_fill_value(-100.5, "label_padding_value")
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidArgumentError: label_padding_value must be an integer that fits int64, got -100.5 (type \
float)
    """
    info = np.iinfo(dtype)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not (
        info.min <= int(value) <= info.max
    ):
        raise InvalidArgumentError(f"{name} must be an integer that fits {np.dtype(dtype).name}, got {describe(value)}")
    return int(value)


# --------------------------------------------------------------------------------------------------
# One sample
# --------------------------------------------------------------------------------------------------


def split_sample(sample: Any, where: str, ids_key: str = "input_ids",
                 labels_key: str | None = "labels") -> tuple[Any, Any, str]:
    """``(token ids, labels or None, the ids' name for messages)`` of one sample, not yet converted.

    >>> split_sample({"input_ids": [1, 2], "labels": [-100, 2]}, "samples[0]")
    ([1, 2], [-100, 2], "samples[0]['input_ids']")
    """
    if isinstance(sample, Mapping):
        if ids_key not in sample:
            keys = sorted(map(str, sample))[:10]
            raise InvalidSampleError(
                f"{where} is a dict without {ids_key!r} (keys: {keys}); every sample must be a sequence of token "
                f"ids or a dict with {ids_key!r}" + (f" and optionally {labels_key!r}" if labels_key else "")
            )
        labels = sample.get(labels_key) if labels_key is not None else None
        return sample[ids_key], labels, f"{where}[{ids_key!r}]"
    return sample, None, where


def length_of(obj: Any, where: str) -> int:
    """``len(obj)`` of a would-be token sequence (a stream measures before it converts), or an error."""
    if isinstance(obj, (str, bytes)):
        raise InvalidSampleError(f"{where} is text ({describe(obj)}); tokenize it first: samples are token ids")
    try:
        return len(obj)
    except TypeError:
        raise InvalidSampleError(f"{where} = {describe(obj)} is not a sequence of token ids") from None


def read_sequence(value: Any, where: str, *, kind: str = "ids", vocab_size: int | None = None,
                  ignored: Sequence[int] = (IGNORE_INDEX,)) -> np.ndarray:
    """One sample's ids (or labels) as a checked 1-D integer numpy array; tensors and arrays are not copied.

    >>> read_sequence((4, 5, 6), "samples[0]").tolist()
    [4, 5, 6]
    >>> read_sequence([4, 5.5], "samples[0]")
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidTokensError: samples[0][1] = 5.5 (type float) is not an integer token id
    """
    arr = _as_array(value, where)
    check_tokens(arr, np.zeros(1, np.int64), np.array([arr.shape[0]]), lambda _: where, kind=kind,
                 vocab_size=vocab_size, ignored=ignored)
    return arr


def _as_array(value: Any, where: str) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        # array('q') reads Python ints through __index__ in one C loop, a third faster than np.asarray (which first
        # scans the list to infer a dtype), and refuses floats, strings and None instead of converting them
        try:
            arr = np.frombuffer(array.array("q", value), np.int64)
        except (TypeError, OverflowError):
            _raise_bad_token(value, where)
        _refuse_bools(value, arr, where)  # array("q") reads True as 1: a 0/1 mask passed as ids
        return arr
    elif isinstance(value, (str, bytes)):
        raise InvalidSampleError(f"{where} is text ({describe(value)}); tokenize it first: samples are token ids")
    elif not isinstance(value, Sequence):
        raise InvalidSampleError(f"{where} = {describe(value)} is not a sequence of token ids")
    else:
        arr = np.asarray(value, dtype=object)
    if arr.ndim != 1:
        raise InvalidSampleError(f"{where} must be 1-D (one sequence of token ids), got shape {tuple(arr.shape)} "
                                 f"from {describe(value)}")
    if arr.dtype.kind == "b" and arr.shape[0]:
        raise InvalidTokensError(f"{where} holds booleans ({describe(value)}), not integer token ids")
    if arr.dtype.kind not in "iu":
        if arr.shape[0] == 0:
            return np.zeros(0, np.int64)
        if arr.dtype != object:
            raise InvalidTokensError(f"{where} must hold integer token ids, got dtype {arr.dtype} "
                                     f"(first value {describe(arr[0].item())})")
        items = arr.tolist()
        try:
            arr = np.frombuffer(array.array("q", items), np.int64)
        except (TypeError, OverflowError):
            _raise_bad_token(items, where)
        _refuse_bools(items, arr, where)
    return arr


def _refuse_bools(items: Sequence[Any], converted: np.ndarray, where: str) -> None:
    k = first_bool(items, converted)
    if k is not None:
        raise InvalidTokensError(f"{where}[{k}] = {describe(items[k])} is not an integer token id (a bool is not a "
                                 f"token: pass integer ids)")


def _raise_bad_token(values: Sequence[Any], where: str) -> None:
    """Name the first token that is not an int64 (error path only: this loop may touch every token)."""
    for k, token in enumerate(values):
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise InvalidTokensError(f"{where}[{k}] = {describe(token)} is not an integer token id")
        if not -(2**63) <= int(token) <= _INT64_MAX:
            raise InvalidTokensError(f"{where}[{k}] = {token} does not fit int64 (token values are at most 2**63 - 1)")
    raise InvalidTokensError(f"{where} must hold integer token ids")  # pragma: no cover - array() found a bad one


# --------------------------------------------------------------------------------------------------
# Many sequences: columns and batches
# --------------------------------------------------------------------------------------------------


def read_tokens(tokens: Any, name: str = "token_ids", *, kind: str = "ids",
                vocab_size: int | None = None, ignored: Sequence[int] = (IGNORE_INDEX,)) -> TokenBuffers:
    """Sequences of token ids (or labels) as checked :class:`TokenBuffers`, without copying columnar input.

    Accepts a pyarrow ``ListArray`` / ``LargeListArray`` / ``ChunkedArray`` (zero-copy but for several chunks), a
    ``(values, offsets)`` pair of numpy arrays, a :class:`TokenBuffers`, a ``(sequences, length)`` integer array or
    tensor (rows of equal length), or a sequence of sequences of ints (lists, tuples, numpy arrays, tensors).

    >>> read_tokens([[5, 6, 7], [8, 9]], vocab_size=9)
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidTokensError: token_ids[1][1] = 9 is not below the vocabulary size 9
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}")  # a programming error inside padfree, not a user input
    if type(tokens).__module__.startswith("torch") and getattr(tokens, "ndim", 0) == 2:
        tokens = tokens.detach().cpu().numpy()  # a (sequences, length) tensor: read as the numpy block below
    if isinstance(tokens, TokenBuffers):
        buf = tokens
    elif type(tokens).__module__.startswith("pyarrow"):
        buf = _from_arrow(tokens, name)
    elif isinstance(tokens, tuple) and len(tokens) == 2 and all(isinstance(t, np.ndarray) for t in tokens):
        buf = _from_pair(tokens[0], tokens[1], name)
    elif isinstance(tokens, (str, bytes, Mapping)) or not isinstance(tokens, Sequence | np.ndarray):
        raise InvalidSampleError(f"{name} must be a sequence of token-id sequences, got {describe(tokens)}")
    elif isinstance(tokens, np.ndarray) and tokens.ndim not in (1, 2):
        raise InvalidSampleError(f"{name} must be a sequence of token-id sequences (a list, or a 2-D integer array of "
                                 f"equal-length rows), got an array of shape {tokens.shape}: {describe(tokens)}")
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 2 and tokens.dtype.kind in "iu":
        # a (sequences, length) block: rows of equal length, one view
        values = np.ascontiguousarray(tokens).reshape(-1)
        buf = TokenBuffers(values, np.arange(tokens.shape[0] + 1, dtype=np.int64) * tokens.shape[1])
    else:
        return concat_checked([_as_array(seq, f"{name}[{i}]") for i, seq in enumerate(tokens)],
                              lambda i: f"{name}[{i}]", kind=kind, vocab_size=vocab_size, ignored=ignored)
    check_tokens(buf.values, buf.offsets[:-1], buf.lengths, lambda i: f"{name}[{i}]", kind=kind,
                 vocab_size=vocab_size, ignored=ignored)
    return buf


def concat_checked(arrays: Sequence[np.ndarray], names: Callable[[int], str], *, kind: str = "ids",
                   vocab_size: int | None = None, ignored: Sequence[int] = (IGNORE_INDEX,)) -> TokenBuffers:
    """:func:`concat` after one check of every value (int64 overflow, negative ids, vocabulary) across arrays."""
    for i, a in enumerate(arrays):  # per sequence, never per token: only uint64 can hold what int64 cannot
        if a.dtype == np.uint64 and a.size and a.max() > _INT64_MAX:
            k = int(np.argmax(a > _INT64_MAX))
            raise InvalidTokensError(f"{names(i)}[{k}] = {a[k]} does not fit int64 (token values are at most "
                                     f"2**63 - 1)")
    buf = concat(arrays)
    check_tokens(buf.values, buf.offsets[:-1], buf.lengths, names, kind=kind, vocab_size=vocab_size, ignored=ignored)
    return buf


def _from_pair(values: np.ndarray, offsets: np.ndarray, name: str) -> TokenBuffers:
    if values.ndim != 1 or offsets.ndim != 1 or offsets.shape[0] < 1 or offsets.dtype.kind not in "iu":
        raise InvalidSampleError(f"{name} as a (values, offsets) pair needs 1-D values and 1-D integer offsets of "
                                 f"num_sequences + 1 entries, got shapes {values.shape} and {offsets.shape}")
    offsets = offsets.astype(np.int64, copy=False)
    if (np.diff(offsets) < 0).any() or offsets[0] < 0 or offsets[-1] > values.shape[0]:
        raise InvalidSampleError(f"{name}'s offsets must be non-decreasing and within the {values.shape[0]} values, "
                                 f"got {describe(offsets.tolist())}")
    return TokenBuffers(values, offsets)


def _from_arrow(tokens: Any, name: str) -> TokenBuffers:
    chunks = read_arrow_chunks(tokens, name)
    if len(chunks) == 1:
        return chunks[0]
    if not chunks:
        return concat([])
    # several chunks: their values one copy, their sequences' offsets rebased onto it (each chunk's own offsets may
    # start past 0, in a sliced parent)
    values = np.concatenate([c.values[c.offsets[0]:c.offsets[-1]] for c in chunks], dtype=np.int64, casting="unsafe")
    lengths = np.concatenate([c.lengths for c in chunks])
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenBuffers(values, offsets)


def read_arrow_chunks(column: Any, name: str, *, kind: str = "ids", vocab_size: int | None = None,
                      mask: bool = False, rows: Callable[[int], str] | None = None,
                      nulls: list[np.ndarray] | None = None,
                      ignored: Sequence[int] = (IGNORE_INDEX,)) -> list[TokenBuffers]:
    """A pyarrow list column (``ListArray``, ``LargeListArray``, ``FixedSizeListArray`` or a ``ChunkedArray`` of
    them) as one checked :class:`TokenBuffers` per chunk, zero-copy: a memory-mapped dataset stays mapped.

    ``mask=True`` reads a 0/1 loss-mask column (integers or booleans; booleans become ``uint8``) without value
    checks. ``rows(i)`` names row ``i`` (counted from the column's first row) in messages; default ``name[i]``.
    A null row is refused, unless ``nulls`` is a list: then the indices of the null rows are appended to it (for a
    table read through an indices mapping, whose selected rows alone must not be null) and they read as empty.

    >>> import pyarrow as pa
    >>> [c.values.tolist() for c in read_arrow_chunks(pa.chunked_array([[[1, 2]], [[3]]]), "input_ids")]
    [[1, 2], [3]]
    """
    import pyarrow as pa

    rows = rows or (lambda i: f"{name}[{i}]")
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    accepted = "0/1 integers or booleans" if mask else "integer token ids"
    out = []
    base = 0
    for chunk in chunks:
        kind_ = chunk.type
        if not (pa.types.is_list(kind_) or pa.types.is_large_list(kind_) or pa.types.is_fixed_size_list(kind_)):
            raise InvalidSampleError(f"{name} must hold one list of {accepted} per row, got Arrow type {kind_}")
        if not (pa.types.is_integer(kind_.value_type) or (mask and pa.types.is_boolean(kind_.value_type))):
            raise InvalidTokensError(f"{name} must hold {accepted}, got Arrow type {kind_}")
        if chunk.null_count and nulls is not None:
            nulls.append(base + np.flatnonzero(~chunk.is_valid().to_numpy(zero_copy_only=False)))
        elif chunk.null_count:
            i = base + int(np.argmax(~chunk.is_valid().to_numpy(zero_copy_only=False)))
            raise InvalidSampleError(f"{rows(i)} is null ({column.null_count} rows of {name} are); every row needs a "
                                     f"list of tokens")
        child = chunk.values
        if child.null_count:
            raise InvalidTokensError(f"{name} holds {child.null_count} null values inside its lists; every token "
                                     f"must be an integer")
        n = len(chunk)
        if pa.types.is_fixed_size_list(kind_):
            offsets = (np.arange(n + 1, dtype=np.int64) + chunk.offset) * kind_.list_size
        else:
            offsets = np.frombuffer(chunk.buffers()[1], np.int64 if pa.types.is_large_list(kind_) else np.int32,
                                    n + 1, chunk.offset * (8 if pa.types.is_large_list(kind_) else 4))
            offsets = offsets.astype(np.int64)
        if pa.types.is_boolean(kind_.value_type):  # booleans are bit-packed in Arrow: unpacked to bytes
            values = child.to_numpy(zero_copy_only=False).astype(np.uint8)
        else:  # zero-copy, straight from the buffer (the child's own slice offset included)
            dtype = np.dtype(kind_.value_type.to_pandas_dtype())
            values = np.frombuffer(child.buffers()[1], dtype, len(child), child.offset * dtype.itemsize)
        buf = TokenBuffers(values, offsets)
        if not mask:
            check_tokens(values, offsets[:-1], np.diff(offsets), lambda i, b=base: rows(b + i), kind=kind,
                         vocab_size=vocab_size, ignored=ignored)
        out.append(buf)
        base += n
    return out


@dataclass(frozen=True, eq=False)
class Samples:
    """A batch of samples as flat buffers: ``ids``, ``labels`` (None: none given) and, for rows that are already
    packed, ``row_offsets`` — row ``r`` holds sequences ``row_offsets[r]:row_offsets[r + 1]`` of the buffers."""

    ids: TokenBuffers
    labels: TokenBuffers | None
    row_offsets: np.ndarray | None = None


def read_samples(samples: Any, *, name: str = "samples", ids_key: str = "input_ids", labels_key: str = "labels",
                 vocab_size: int | None = None, ignored: Sequence[int] = (IGNORE_INDEX,)) -> Samples:
    """A loader batch (token sequences, or dicts with ``ids_key`` / ``labels_key``) as checked flat buffers.

    Already-packed rows (dicts carrying any of :data:`BOUNDARY_KEYS`: ``seq_lens``, TRL's ``seq_lengths``,
    ``cu_seq_lens`` / ``cu_seqlens``, restarting ``position_ids``, a LLaMA-Factory segment ``attention_mask``) are cut
    into their sequences, so no boundary inside a row is lost (several spellings in one sample must agree; see
    :func:`row_boundaries`). A sample holds no padding: a 0 in its ``attention_mask`` is refused.

    >>> s = read_samples([{"input_ids": [1, 2, 3, 4, 5], "seq_lens": [3, 2]}])
    >>> s.ids.offsets.tolist(), s.row_offsets.tolist()
    ([0, 3, 5], [0, 2])
    """
    if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
        raise InvalidSampleError(f"{name} must be a list of samples (dicts with {ids_key!r} or token-id sequences), "
                                 f"got {describe(samples)}")
    if len(samples) == 0:
        raise InvalidSampleError(f"{name} is empty; a batch needs at least one sample")
    keyed = isinstance(samples[0], Mapping)
    has_labels = keyed and samples[0].get(labels_key) is not None
    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for i, sample in enumerate(samples):  # per sample: each is a Python object that has to be read once
        where = f"{name}[{i}]"
        if isinstance(sample, Mapping) != keyed:
            raise InvalidSampleError(f"{where} is {describe(sample)} but {name}[0] is {describe(samples[0])}; give "
                                     f"every sample as a dict with {ids_key!r} or every one as a token-id sequence")
        raw_ids, raw_labels, where_ids = split_sample(sample, where, ids_key, labels_key if keyed else None)
        ids.append(_as_array(raw_ids, where_ids))
        if (raw_labels is not None) != has_labels:
            first, other = (f"{name}[0]", where) if has_labels else (where, f"{name}[0]")
            raise InvalidSampleError(f"{first} has {labels_key!r} but {other} has none; give labels to every sample "
                                     f"of a batch or to none")
        if has_labels:
            labels.append(_as_array(raw_labels, f"{where}[{labels_key!r}]"))
    field = f"[{ids_key!r}]" if keyed else ""
    buf = concat_checked(ids, lambda i: f"{name}[{i}]{field}", vocab_size=vocab_size)
    lengths = buf.lengths
    refuse_empty(lengths, lambda i: f"{name}[{i}]{field}")
    lab = None
    if has_labels:
        lab = concat_checked(labels, lambda i: f"{name}[{i}][{labels_key!r}]", kind="labels", vocab_size=vocab_size,
                             ignored=ignored)
        if not np.array_equal(lab.lengths, lengths):
            i = int(np.argmax(lab.lengths != lengths))
            raise InvalidSampleError(f"{name}[{i}][{labels_key!r}] has {lab.lengths[i]} entries but its {ids_key} "
                                     f"has {lengths[i]} tokens; labels are aligned with the ids, one per token")
    if not keyed:
        return Samples(buf, lab)
    seq_lens, per_row = _boundaries(samples, lengths, name)
    if per_row.shape[0] == seq_lens.shape[0]:  # one sequence per sample: nothing to cut
        return Samples(buf, lab)
    offsets = np.zeros(seq_lens.shape[0] + 1, np.int64)
    np.cumsum(seq_lens, out=offsets[1:])
    row_offsets = np.zeros(per_row.shape[0] + 1, np.int64)
    np.cumsum(per_row, out=row_offsets[1:])
    return Samples(TokenBuffers(buf.values, offsets), TokenBuffers(lab.values, offsets) if lab is not None else None,
                   row_offsets)


#: The spellings of the sequences inside an already-packed row that a sample may carry: padfree's and SeqPacker's
#: ``seq_lens``, TRL's ``seq_lengths``, flash-attn offsets ``cu_seq_lens`` / ``cu_seqlens`` (0 to the row's length),
#: ``position_ids`` restarting at 0 at every sequence, and a LLaMA-Factory segment mask as ``attention_mask``.
BOUNDARY_KEYS = ("seq_lens", "seq_lengths", "cu_seq_lens", "cu_seqlens", "position_ids", "attention_mask")

_ACCEPTED = {
    "lengths": "accepted: lengths >= 1 summing to the sample's tokens",
    "offsets": "accepted: offsets from 0 to the sample's tokens, strictly increasing",
    "positions": "accepted: one position per input_ids token, restarting at 0 at every sequence of the row and "
                 "counting up by 1 within it",
    "mask": "accepted: one entry per input_ids token, 1 on every token or LLaMA-Factory segment ids 1, 1, 2, 2, 2, "
            "... (a sample holds no padding: the collators pad)",
}
_KIND_OF = {"seq_lens": "lengths", "seq_lengths": "lengths", "cu_seq_lens": "offsets", "cu_seqlens": "offsets",
            "position_ids": "positions", "attention_mask": "mask"}


def row_boundaries(sample: Mapping[str, Any], tokens: int, where: str = "sample") -> np.ndarray | None:
    """``(n,) int64`` — the lengths of the sequences inside one already-packed row, read from every spelling of
    :data:`BOUNDARY_KEYS` the row carries (all must agree); None when it carries none (the row is one sequence).

    ``tokens`` is the row's length; ``where`` names the row in errors. An ``attention_mask`` of 1s marks no
    boundary (every token real); values > 1 are LLaMA-Factory segment ids. A sample holds no padding — the
    collators pad rows themselves — so a 0 in its mask is refused rather than trained as a token or dropped
    uncounted. Every fault raises :class:`~padfree.errors.InvalidLayoutError` naming the row and the field.

    >>> row_boundaries({"input_ids": [5, 6, 7, 8, 9], "attention_mask": [1, 1, 2, 2, 2]}, 5).tolist()
    [2, 3]
    >>> row_boundaries({"cu_seqlens": [0, 2, 5], "position_ids": [0, 1, 0, 1, 2]}, 5).tolist()
    [2, 3]
    >>> row_boundaries({"attention_mask": [1, 1, 1]}, 3) is None
    True
    >>> row_boundaries({"seq_lengths": [2, 3], "attention_mask": [1, 1, 1, 2, 2]}, 5, "samples[0]")
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidLayoutError: samples[0]['seq_lengths'] and samples[0]['attention_mask'] disagree on where \
the sequences of the row start ([2, 3] vs [3, 2])
    >>> row_boundaries({"attention_mask": [1, 1, 1, 0]}, 4, "samples[0]")
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidLayoutError: samples[0]['attention_mask'][3] = 0 marks padding, but a sample holds no \
padding (the collators pad rows themselves); give the real tokens only
    """
    if not isinstance(sample, Mapping):
        raise InvalidSampleError(f"{where} = {describe(sample)} is not a packed row: row_boundaries reads a dict "
                                 f"sample (input_ids and any of {', '.join(BOUNDARY_KEYS)})")
    found: list[tuple[str, np.ndarray]] = []
    for key in BOUNDARY_KEYS:
        value = sample.get(key)
        if value is None:
            continue
        lens = _read_boundary(_KIND_OF[key], value, tokens, f"{where}[{key!r}]")
        if lens is not None:
            found.append((key, lens))
    for (key, lens), (other, theirs) in itertools.pairwise(found):
        if not np.array_equal(lens, theirs):
            raise InvalidLayoutError(f"{where}[{key!r}] and {where}[{other!r}] disagree on where the sequences of the "
                                     f"row start ({lens.tolist()} vs {theirs.tolist()})")
    return found[0][1] if found else None


def _read_boundary(kind: str, value: Any, n: int, where: str) -> np.ndarray | None:
    """One spelling of one row's boundaries as ``(n,) int64`` lengths (None: a 0/1 mask, which marks none)."""
    from padfree import layout

    arr = _boundary_values(value, where, _ACCEPTED[kind], bool_ok=kind == "mask")
    if kind == "lengths":
        if arr.shape[0] == 0 or arr.min() < 1 or int(arr.sum()) != n:
            raise InvalidLayoutError(f"{where} = {arr.tolist()} must be lengths >= 1 summing to the sample's {n} "
                                     f"tokens")
        return arr
    if kind == "offsets":
        try:
            lens = np.asarray(layout.cu_seqlens_to_lengths(arr), np.int64)
        except InvalidLayoutError:
            lens = None
        if lens is None or lens.shape[0] == 0 or arr[-1] != n:
            raise InvalidLayoutError(f"{where} = {describe(arr.tolist())} must be offsets from 0 to the sample's {n} "
                                     f"tokens, strictly increasing")
        return lens
    if arr.shape[0] != n:
        raise InvalidLayoutError(f"{where} = {describe(value)} has {arr.shape[0]} entries but the sample has {n} "
                                 f"tokens; {_ACCEPTED[kind]}")
    if kind == "mask":
        if n and arr.min() < 1:
            k = int(np.argmax(arr < 1))
            if arr[k] == 0:
                raise InvalidLayoutError(f"{where}[{k}] = 0 marks padding, but a sample holds no padding (the "
                                         f"collators pad rows themselves); give the real tokens only")
            raise InvalidLayoutError(f"{where}[{k}] = {arr[k]} is negative; {_ACCEPTED[kind]}")
        if not n or arr.max() <= 1:
            return None
    convert = layout.segment_ids_to_lengths if kind == "mask" else layout.position_ids_to_lengths
    try:
        return np.asarray(convert(arr[None]), np.int64)
    except InvalidLayoutError as exc:
        # layout names the entry of the (1, n) row it was given; its hints about padding do not apply to a sample
        what = "segment mask" if kind == "mask" else "packed row"
        raise InvalidLayoutError(f"{where} = {describe(value)} is not a {what} ({str(exc).split(';')[0]}); "
                                 f"{_ACCEPTED[kind]}") from None


def _boundary_values(value: Any, where: str, accepted: str, *, bool_ok: bool = False) -> np.ndarray:
    """A boundary field as a 1-D int64 array, or InvalidLayoutError naming ``where``, the value and ``accepted``."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], bool)):
        try:  # the common case, one C loop (as _as_array); anything else is judged below
            return np.frombuffer(array.array("q", value), np.int64)
        except (TypeError, OverflowError):
            pass
    got = None
    if isinstance(value, (str, bytes, Mapping)) or np.isscalar(value):
        got = f"type {type(value).__name__}"
        arr = None
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError):
            arr, got = None, "a ragged nesting"
    if arr is not None and arr.ndim != 1:
        got = f"shape {arr.shape}"
    elif arr is not None and not (arr.dtype.kind in "iu" or (bool_ok and arr.dtype.kind == "b")):
        got = "booleans" if arr.dtype.kind == "b" else f"dtype {arr.dtype}"
    if got is not None:
        raise InvalidLayoutError(f"{where} = {describe(value)} must be a 1-D sequence of integers, got {got}; "
                                 f"{accepted}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > _INT64_MAX:
        raise InvalidLayoutError(f"{where} = {describe(value)} holds a value that does not fit int64; {accepted}")
    return arr.astype(np.int64)


def _boundaries(samples: Sequence[Mapping[str, Any]], row_lengths: np.ndarray,
                name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths of every sequence, sequences per sample)``: each sample's boundaries by :func:`row_boundaries`;
    a sample with none is one sequence."""
    parts = []
    for i, sample in enumerate(samples):  # per sample, never per token
        n = int(row_lengths[i])
        lens = row_boundaries(sample, n, f"{name}[{i}]")
        parts.append(lens if lens is not None else np.array([n], np.int64))
    return np.concatenate(parts), np.array([p.shape[0] for p in parts], np.int64)
