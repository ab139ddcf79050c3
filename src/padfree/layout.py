"""Sequence boundaries in every spelling padfree meets, and exact conversions between them.

A batch of packed rows is ``(batch, seq)``: row ``r`` holds whole sequences one after the other, then padding.
The same boundaries can be written many ways, and every library wants its own:

================  ==========================  ==============================================================
spelling          shape, dtype                meaning
================  ==========================  ==============================================================
lengths           ``(n,)`` int64              tokens of every sequence, row after row, left to right
seqs_per_row      ``(batch,)`` int64          how many of those sequences each row holds (0: an all-padding row)
cu_seqlens        ``(n + 1,)`` int32          flash-attn varlen offsets over the *non-padding* tokens, leading 0
segment ids       ``(batch, seq)`` int64      1, 2, 3, ... per row, 0 for padding — the LLaMA-Factory mask
position_ids      ``(batch, seq)`` int64      0, 1, 2, ... restarting at 0 for every sequence and for the padding
seq_idx           ``(batch, seq)`` int32      Mamba: 0, 1, 2, ... per row; padding = number of sequences
dense mask        ``(batch, 1, seq, seq)``    block-diagonal causal "may attend" (bool) or additive (float)
BlockMask         flex attention              the same pattern for ``torch.nn.attention.flex_attention``
================  ==========================  ==============================================================

Conventions (every conversion here is exact under them, and refuses what breaks them):

- **Padding is a trailing run of each row** (right padding), as packing produces. Left or inner padding is an
  :class:`~padfree.errors.InvalidLayoutError`, never a guess.
- **Segment ids are the hub**: they alone carry rows, boundaries and padding, and every other spelling converts to
  and from them. ``[[1, 1, 2, 2, 2, 0]]`` is two sequences of 2 and 3 tokens and one padding token; an ordinary 0/1
  attention mask (booleans too) is a valid segment-id array with one sequence per row.
- **position_ids and seq_idx cannot describe padding on their own.** padfree writes the padding tail of a row as
  one extra trailing sequence: positions ``0, 1, 2, ...`` from its first token, and ``seq_idx`` = (number of
  sequences in the row). A consumer that only reads ``position_ids`` (transformers' packed-sequence detection,
  flash-attn varlen) therefore never glues padding to the last real sequence, no real token can attend to it, no
  row is fully masked, and the padding costs one extra segment rather than one per token. ``seq_idx`` stays
  non-decreasing, so every Mamba kernel resets its state before the padding. :mod:`padfree.rows` pads the same way.
  To read padding back, pass ``attention_mask`` (0/1 or segment ids; nonzero = real token); without it every token
  counts as real. The positions (or seq_idx) of padding tokens are ignored when a mask is given, whatever their
  values.
- **cu_seqlens are flat over the batch's non-padding tokens** (the flash-attn varlen convention: index into the
  tokens gathered by :func:`get_unpad_data`), so they forget rows and padding; keep ``seqs_per_row`` and the row
  length to go back.
- **Every sequence has at least one token**: a zero length, or a repeated value in ``cu_seqlens``, is refused.

Backends: numpy in, numpy out; torch in, torch out, on the input's device (companion arguments such as
``attention_mask`` follow the first argument). Torch is imported only when a tensor arrives, so ``import padfree``
stays torch-free. Everything is vectorized; nothing loops over tokens in Python.

Host syncs on CUDA: the value checks (``check=True``, the default) read one boolean per check back to the host;
``check=False`` skips them — garbage in, garbage out — and then only functions whose output size depends on the
values sync: ``*_to_lengths``, ``*_to_cu_seqlens``, :func:`get_seqlens_in_batch`, :func:`get_unpad_data` (also for its
``max_seqlen`` int) and ``lengths_to_*`` (the total token count, and the row length when ``seq_len`` is None).
The ``(batch, seq) -> (batch, seq)`` conversions and :func:`block_causal_mask` never sync with ``check=False``.

>>> import numpy as np
>>> mask = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
>>> indices, cu_seqlens, max_seqlen = get_unpad_data(mask)
>>> indices.tolist(), cu_seqlens.tolist(), max_seqlen
([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11], [0, 2, 5, 6, 8, 11], 3)
>>> segment_ids_to_position_ids(mask).tolist()
[[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]]
>>> position_ids_to_segment_ids(segment_ids_to_position_ids(mask), attention_mask=mask).tolist()
[[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np

from padfree.arrays import NumpyOps, TorchOps, backend_of, import_torch, torch_module
from padfree.errors import BackendUnavailableError, InvalidArgumentError, InvalidLayoutError, describe
from padfree.packing.inputs import MAX_CAPACITY, as_positive_int

__all__ = [
    "IGNORE_INDEX",
    "block_causal_mask",
    "block_causal_mask_to_segment_ids",
    "block_mask",
    "block_mask_to_segment_ids",
    "cu_seqlens_to_lengths",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "lengths_to_cu_seqlens",
    "lengths_to_position_ids",
    "lengths_to_segment_ids",
    "lengths_to_seq_idx",
    "position_ids_to_cu_seqlens",
    "position_ids_to_lengths",
    "position_ids_to_segment_ids",
    "segment_ids_to_batch_seq_idx",
    "segment_ids_to_cu_seqlens",
    "segment_ids_to_lengths",
    "segment_ids_to_position_ids",
    "segment_ids_to_seq_idx",
    "seq_idx_to_segment_ids",
    "seqs_per_row",
]

INT32_MAX = 2**31 - 1

# The label of a token that is not a target (Hugging Face's convention, and torch's cross_entropy default): a
# sequence's first token and every pad carry it. The one definition in padfree.
IGNORE_INDEX = -100

# ---- validation ------------------------------------------------------------------------------------------------------

_SHAPES = {1: "(n,)", 2: "(batch, seq)", 4: "(batch, heads, seq, seq)"}


def _ints(value: Any, name: str, ndim: int, *, like: Any = None, bool_ok: bool = False) -> tuple[Any, Any]:
    """``(backend, value as an int64 array of ndim dims)`` in the backend of ``like`` (else its own), or an error."""
    xp = backend_of(like if like is not None else value)
    shown = ""  # an array is described by its shape and dtype; anything else is shown as given
    if not (xp.is_array(value) or torch_module(value) is not None):
        shown = f" ({describe(value)})"
        if isinstance(value, (str, bytes, dict)) or np.isscalar(value) or value is None:
            raise InvalidLayoutError(f"{name} must be a {ndim}-D integer array {_SHAPES[ndim]}, got {describe(value)}")
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise InvalidLayoutError(f"{name} must be a {ndim}-D integer array {_SHAPES[ndim]}, got "
                                     f"{describe(value)}, which is not one: {exc}; pass a numpy array, a tensor or "
                                     f"equal-length lists of ints") from exc
        if value.size == 0:  # numpy reads [] as float64
            value = value.astype(np.int64)
    arr = xp.asarray(value, like) if like is not None or not xp.is_array(value) else value
    kind = xp.kind(arr)
    if kind == "f" or (kind == "b" and not bool_ok) or getattr(arr.dtype, "kind", "") == "O":
        accepted = "integers or booleans" if bool_ok else "integers"
        raise InvalidLayoutError(f"{name} must hold {accepted}, got dtype {arr.dtype}{shown}")
    if arr.ndim != ndim:
        raise InvalidLayoutError(f"{name} must be {ndim}-D {_SHAPES[ndim]}, got shape {tuple(arr.shape)}{shown}")
    return xp, xp.cast(arr, xp.int64)


def _check_lengths(xp: Any, lengths: Any, name: str) -> None:
    hit = xp.first_true(lengths < 1)
    if hit is not None:
        (i,) = hit
        raise InvalidLayoutError(f"{name}[{i}] = {lengths[i].item()}, but every sequence length must be >= 1")


def _check_segment_ids(xp: Any, seg: Any, name: str) -> None:
    """Refuse anything but runs of 1, 2, 3, ... in order, then only padding (0), in every row."""
    if seg.shape[0] == 0 or seg.shape[1] == 0:
        return
    prev, nxt = seg[:, :-1], seg[:, 1:]
    bad = seg < 0
    bad[:, 0] |= seg[:, 0] > 1
    bad[:, 1:] |= (nxt != 0) & ((prev == 0) | ((nxt != prev) & (nxt != prev + 1)))
    hit = xp.first_true(bad)
    if hit is None:
        return
    r, c = hit
    value = seg[r, c].item()
    rule = "a packed row is runs of 1, 2, 3, ... in order, then only padding (0)"
    if value < 0:
        raise InvalidLayoutError(f"{name}[{r}, {c}] = {value} is negative; {rule}")
    if c == 0:
        raise InvalidLayoutError(f"{name}[{r}, 0] = {value}, but the first sequence of a row has id 1; {rule}")
    before = seg[r, c - 1].item()
    if before == 0:
        raise InvalidLayoutError(
            f"{name}[{r}, {c}] = {value} follows padding (0) at column {c - 1}; padding must be a trailing run of "
            f"the row (right padding)"
        )
    raise InvalidLayoutError(f"{name}[{r}, {c}] = {value} follows {before}; {rule}")


def _real_tokens(xp: Any, attention_mask: Any, like: Any, check: bool) -> tuple[Any, Any]:
    """``(real, segment ids or None)``: the non-padding tokens marked by a 0/1 or segment-id mask (None: all real).

    The segment ids come back only when ``check`` and the mask holds any id > 1, for :func:`_check_agrees`.
    """
    if attention_mask is None:
        return xp.zeros(tuple(like.shape), xp.bool_, like) == 0, None
    _, mask = _ints(attention_mask, "attention_mask", 2, like=like, bool_ok=True)
    if tuple(mask.shape) != tuple(like.shape):
        raise InvalidLayoutError(f"attention_mask has shape {tuple(mask.shape)}, but the ids it marks have shape "
                                 f"{tuple(like.shape)}; they must match")
    real = mask != 0
    if not check:
        return real, None
    hit = xp.first_true(mask < 0)
    if hit is not None:
        raise InvalidLayoutError(f"attention_mask[{hit[0]}, {hit[1]}] = {mask[hit].item()} is negative; a mask holds "
                                 f"0 for padding and 1 (or a segment id 1, 2, 3, ...) for real tokens")
    after_pad = xp.zeros(tuple(mask.shape), xp.bool_, mask)
    after_pad[:, 1:] = real[:, 1:] & ~real[:, :-1]
    hit = xp.first_true(after_pad)
    if hit is not None:
        r, c = hit
        raise InvalidLayoutError(f"attention_mask[{r}, {c}] marks a real token after padding at column {c - 1}; "
                                 f"padding must be a trailing run of each row (right padding)")
    return real, (mask if xp.first_true(mask > 1) is not None else None)


def _check_agrees(xp: Any, seg: Any, mask_seg: Any, what: str) -> None:
    """A segment-id ``attention_mask`` given next to position_ids / seq_idx must tell the same boundaries."""
    _check_segment_ids(xp, mask_seg, "attention_mask")
    hit = xp.first_true(seg != mask_seg)
    if hit is not None:
        r, c = hit
        raise InvalidLayoutError(f"attention_mask[{r}, {c}] = {mask_seg[hit].item()}, but {what} put that token in "
                                 f"sequence {seg[hit].item()} of its row; the two disagree on the boundaries")


def _window(sliding_window: Any) -> int | None:
    return as_positive_int(sliding_window, "sliding_window", allow_none=True)


def _starts(seg: Any) -> Any:
    """``(batch, seq)`` bool: the first token of every sequence (segment ids assumed valid)."""
    start = seg > 0
    start[:, 1:] &= seg[:, 1:] != seg[:, :-1]
    return start


# ---- lengths <-> cu_seqlens ------------------------------------------------------------------------------------------


def lengths_to_cu_seqlens(lengths: Any, *, check: bool = True) -> Any:
    """Cumulative offsets of the sequences: ``(n,)`` lengths -> ``(n + 1,) int32`` ``cu_seqlens`` with a leading 0.

    Sequence ``i`` takes tokens ``cu_seqlens[i]:cu_seqlens[i + 1]`` of the flattened non-padding tokens — what
    flash-attn's varlen functions and torch's ``varlen_attn`` expect. Refuses a length < 1 and a total that does
    not fit int32.

    >>> lengths_to_cu_seqlens([2, 3, 1])
    array([0, 2, 5, 6], dtype=int32)
    """
    xp, lengths = _ints(lengths, "lengths", 1)
    if check:
        _check_lengths(xp, lengths, "lengths")
    csum = lengths.cumsum(0)
    if check and lengths.shape[0] and int(csum[-1]) > INT32_MAX:
        raise InvalidLayoutError(f"lengths sum to {int(csum[-1])} tokens, more than int32 cu_seqlens can index "
                                 f"({INT32_MAX}); split the batch")
    return xp.cat([xp.zeros((1,), xp.int32, lengths), xp.cast(csum, xp.int32)])


def cu_seqlens_to_lengths(cu_seqlens: Any, *, check: bool = True) -> Any:
    """Sequence lengths from offsets: ``(n + 1,)`` ``cu_seqlens`` -> ``(n,) int64``.

    Refuses offsets that do not start at 0 or do not strictly increase (every sequence has >= 1 token).

    >>> cu_seqlens_to_lengths(np.array([0, 2, 5, 6], np.int32))
    array([2, 3, 1])
    """
    xp, cu = _ints(cu_seqlens, "cu_seqlens", 1)
    if cu.shape[0] == 0:
        raise InvalidLayoutError("cu_seqlens is empty, but it holds at least the leading 0 (shape (n + 1,))")
    lengths = cu[1:] - cu[:-1]
    if check:
        if cu[0].item() != 0:
            raise InvalidLayoutError(f"cu_seqlens[0] = {cu[0].item()}, but offsets start at 0")
        hit = xp.first_true(lengths < 1)
        if hit is not None:
            (i,) = hit
            raise InvalidLayoutError(f"cu_seqlens[{i + 1}] = {cu[i + 1].item()} follows {cu[i].item()}; offsets must "
                                     f"strictly increase (every sequence has >= 1 token)")
    return lengths


# ---- segment ids (the hub) <-> lengths, cu_seqlens ------------------------------------------------------------------


def segment_ids_to_lengths(segment_ids: Any, *, check: bool = True) -> Any:
    """Sequence lengths of a batch: ``(batch, seq)`` segment ids -> ``(n,) int64``, row after row.

    ``segment_ids`` is 1, 2, 3, ... per row and 0 for padding — LLaMA-Factory's integer attention mask; a 0/1
    mask works too (one sequence per row). Syncs once on CUDA (the output size depends on the values).

    >>> segment_ids_to_lengths(np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])).tolist()
    [2, 3, 1, 2, 3]
    """
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    return _lengths_from_segments(xp, seg, "segment_ids", check)


def _cu_from_segments(xp: Any, seg: Any, name: str, check: bool) -> Any:
    if check:
        _check_segment_ids(xp, seg, name)
    real = seg > 0
    starts = _starts(seg)[real]  # one flag per non-padding token, in row-major order: the unpadded stream
    return xp.cat([xp.flatnonzero(starts), xp.zeros((1,), xp.int64, seg) + starts.shape[0]])


def _lengths_from_segments(xp: Any, seg: Any, name: str, check: bool) -> Any:
    cu = _cu_from_segments(xp, seg, name, check)
    return cu[1:] - cu[:-1]


def segment_ids_to_cu_seqlens(segment_ids: Any, *, check: bool = True) -> Any:
    """``(batch, seq)`` segment ids -> ``(n + 1,) int32`` ``cu_seqlens`` over the non-padding tokens (syncs once).

    >>> segment_ids_to_cu_seqlens(np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    array([ 0,  2,  5,  6,  8, 11], dtype=int32)
    """
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    return xp.cast(_cu_from_segments(xp, seg, "segment_ids", check), xp.int32)


def seqs_per_row(segment_ids: Any, *, check: bool = True) -> Any:
    """How many sequences each row holds: ``(batch, seq)`` segment ids -> ``(batch,) int64`` (0: all padding).

    With :func:`segment_ids_to_lengths` and the row length it is everything :func:`lengths_to_segment_ids` needs
    to rebuild the batch.

    >>> seqs_per_row(np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0]])).tolist()
    [2, 3, 0]
    """
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    if check:
        _check_segment_ids(xp, seg, "segment_ids")
    if seg.shape[1] == 0:
        return xp.zeros((seg.shape[0],), xp.int64, seg)
    return xp.amax(seg, 1)[:, 0]


def lengths_to_segment_ids(
    lengths: Any, seqs_per_row: Any = None, seq_len: int | None = None, *, check: bool = True
) -> Any:
    """Build ``(batch, seq_len) int64`` segment ids from ``(n,)`` lengths laid row after row.

    Args:
        lengths: ``(n,)`` tokens of every sequence, in row order.
        seqs_per_row: ``(batch,)`` sequences in each row, summing to ``n`` (0 is an all-padding row); None puts
            every sequence in one row.
        seq_len: the padded row length; None uses the fullest row (syncs once on CUDA).

    Syncs once on CUDA for the total token count.

    >>> lengths_to_segment_ids([2, 3, 1, 2, 3], seqs_per_row=[2, 3], seq_len=6)
    array([[1, 1, 2, 2, 2, 0],
           [1, 2, 2, 3, 3, 3]])
    """
    xp, lengths, counts, fill, seq_len = _rows_of(lengths, seqs_per_row, seq_len, check)
    n, rows = lengths.shape[0], counts.shape[0]
    first = counts.cumsum(0) - counts  # index of each row's first sequence
    ids = xp.arange(n, lengths) - xp.repeat(first, counts, n) + 1
    total = int(fill.sum())
    real = xp.arange(seq_len, lengths)[None, :] < fill[:, None]
    seg = xp.zeros((rows, seq_len), xp.int64, lengths)
    # boolean-mask assignment walks the mask in row-major order, which is exactly the order of the tokens
    seg[real] = xp.repeat(ids, lengths, total)
    return seg


def _rows_of(lengths: Any, seqs_per_row: Any, seq_len: Any, check: bool) -> tuple[Any, Any, Any, Any, int]:
    """Validated ``(backend, lengths, seqs_per_row, tokens per row, seq_len)`` for the ``lengths_to_*`` builders."""
    xp, lengths = _ints(lengths, "lengths", 1)
    n = lengths.shape[0]
    if seqs_per_row is None:
        counts = xp.zeros((1,), xp.int64, lengths) + n
    else:
        _, counts = _ints(seqs_per_row, "seqs_per_row", 1, like=lengths)
    if check:
        _check_lengths(xp, lengths, "lengths")
        hit = xp.first_true(counts < 0)
        if hit is not None:
            raise InvalidLayoutError(f"seqs_per_row[{hit[0]}] = {counts[hit].item()}, but a row holds >= 0 sequences")
        if int(counts.sum()) != n:
            raise InvalidLayoutError(f"seqs_per_row sums to {int(counts.sum())}, but lengths holds {n} sequences; "
                                     f"they must match")
    first = counts.cumsum(0) - counts
    csum = xp.cat([xp.zeros((1,), xp.int64, lengths), lengths.cumsum(0)])
    fill = csum[first + counts] - csum[first]
    if seq_len is None:
        seq_len = int(fill.max()) if counts.shape[0] else 0
    else:
        seq_len = as_positive_int(seq_len, "seq_len")
        # refused before anything is allocated: seq_len is a row length (at most a capacity's bound), and a batch's
        # positions are indexed by int32 offsets (cu_seqlens) — seq_len=2**40 would otherwise ask for terabytes
        rows = counts.shape[0]
        if seq_len > MAX_CAPACITY or rows * seq_len > INT32_MAX:
            fullest = int(fill.max()) if rows else 0
            raise InvalidArgumentError(
                f"seq_len must be None (the fullest row) or an integer in [{fullest} (the fullest row), "
                f"{min(MAX_CAPACITY, INT32_MAX // max(rows, 1))}] (a row holds at most {MAX_CAPACITY} tokens and "
                f"int32 offsets index the {rows} rows' positions), got seq_len={seq_len}"
            )
        if check:
            hit = xp.first_true(fill > seq_len)
            if hit is not None:
                raise InvalidLayoutError(f"row {hit[0]} holds {fill[hit].item()} tokens, more than seq_len={seq_len}; "
                                         f"raise seq_len or pass seq_len=None for the fullest row")
    return xp, lengths, counts, fill, seq_len


def lengths_to_position_ids(
    lengths: Any, seqs_per_row: Any = None, seq_len: int | None = None, *, check: bool = True
) -> Any:
    """Build ``(batch, seq_len) int64`` position_ids, restarting at 0 for every sequence and for the padding tail.

    Arguments as in :func:`lengths_to_segment_ids`. With the defaults (one row, no padding) this is the
    ``position_ids`` of transformers' ``DataCollatorWithFlattening``.

    >>> lengths_to_position_ids([2, 3, 1, 2, 3], seqs_per_row=[2, 3], seq_len=7).tolist()
    [[0, 1, 0, 1, 2, 0, 1], [0, 0, 1, 0, 1, 2, 0]]
    >>> lengths_to_position_ids([3, 2]).tolist()
    [[0, 1, 2, 0, 1]]
    """
    seg = lengths_to_segment_ids(lengths, seqs_per_row, seq_len, check=check)
    return segment_ids_to_position_ids(seg, check=False)


def lengths_to_seq_idx(
    lengths: Any, seqs_per_row: Any = None, seq_len: int | None = None, *, check: bool = True
) -> Any:
    """Build the ``(batch, seq_len) int32`` Mamba ``seq_idx``; arguments as in :func:`lengths_to_segment_ids`.

    >>> lengths_to_seq_idx([2, 3, 1, 2, 3], seqs_per_row=[2, 3], seq_len=6).tolist()
    [[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]]
    """
    seg = lengths_to_segment_ids(lengths, seqs_per_row, seq_len, check=check)
    return segment_ids_to_seq_idx(seg, check=False)


# ---- segment ids <-> position_ids ---------------------------------------------------------------------------------


def segment_ids_to_position_ids(segment_ids: Any, *, check: bool = True) -> Any:
    """``(batch, seq)`` segment ids -> ``(batch, seq) int64`` position_ids: 0, 1, 2, ... per sequence; the padding
    tail counts 0, 1, ... as one more sequence.

    >>> segment_ids_to_position_ids(np.array([[1, 1, 2, 2, 2, 0, 0]])).tolist()
    [[0, 1, 0, 1, 2, 0, 1]]
    """
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    if check:
        _check_segment_ids(xp, seg, "segment_ids")
    col = xp.arange(seg.shape[1], seg)[None, :]
    # a start is every sequence start and the first padding token; the column of the latest start is carried
    # right along the row by a running max
    starts = seg != 0
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    last_start = xp.cummax(xp.where(starts, col, 0), 1) if seg.shape[1] else col
    return col - last_start


def position_ids_to_segment_ids(position_ids: Any, attention_mask: Any = None, *, check: bool = True) -> Any:
    """``(batch, seq)`` position_ids -> ``(batch, seq) int64`` segment ids; a sequence starts wherever position is 0.

    Within a row every real token's position is the previous one + 1 or a restart at 0, and a row starts at 0;
    anything else (a negative value, a jump) is not a packing and raises :class:`InvalidLayoutError`.
    ``attention_mask`` (0/1 or segment ids, right-padded) marks the padding, whose positions are then ignored;
    without it every token is real. A segment-id mask must agree with the positions.

    >>> pos = np.array([[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]])
    >>> position_ids_to_segment_ids(pos).tolist()
    [[1, 1, 2, 2, 2, 3], [1, 2, 2, 3, 3, 3]]
    >>> position_ids_to_segment_ids(pos, attention_mask=[[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]).tolist()
    [[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]
    """
    xp, pos = _ints(position_ids, "position_ids", 2)
    real, mask_seg = _real_tokens(xp, attention_mask, pos, check)
    if check and pos.shape[1]:
        bad = real & (pos < 0)
        bad[:, 0] |= real[:, 0] & (pos[:, 0] != 0)
        bad[:, 1:] |= real[:, 1:] & (pos[:, 1:] != 0) & (pos[:, 1:] != pos[:, :-1] + 1)
        hit = xp.first_true(bad)
        if hit is not None:
            r, c = hit
            value = pos[r, c].item()
            hint = "" if attention_mask is not None else "; if it is padding, pass attention_mask"
            if value < 0:
                raise InvalidLayoutError(f"position_ids[{r}, {c}] = {value} is negative{hint}")
            if c == 0:
                raise InvalidLayoutError(f"position_ids[{r}, 0] = {value}, but a row starts a sequence at position 0")
            raise InvalidLayoutError(f"position_ids[{r}, {c}] = {value} follows {pos[r, c - 1].item()}; a position is "
                                     f"the previous one + 1 or a restart at 0{hint}")
    seg = xp.where(real, xp.cast(real & (pos == 0), xp.int64).cumsum(1), 0)
    if check and mask_seg is not None:
        _check_agrees(xp, seg, mask_seg, "position_ids")
    return seg


def position_ids_to_lengths(position_ids: Any, attention_mask: Any = None, *, check: bool = True) -> Any:
    """``(batch, seq)`` position_ids -> ``(n,) int64`` sequence lengths, row after row (syncs once).

    ``attention_mask`` as in :func:`position_ids_to_segment_ids`.

    >>> position_ids_to_lengths(np.array([[0, 1, 0, 1, 2, 0, 1, 2, 3]])).tolist()
    [2, 3, 4]
    """
    seg = position_ids_to_segment_ids(position_ids, attention_mask, check=check)
    return _lengths_from_segments(backend_of(seg), seg, "position_ids", False)


def position_ids_to_cu_seqlens(position_ids: Any, attention_mask: Any = None, *, check: bool = True) -> Any:
    """``(batch, seq)`` position_ids -> ``(n + 1,) int32`` cu_seqlens over the non-padding tokens (syncs once).

    This is what transformers derives from ``position_ids`` for flash-attn varlen, with validation.

    >>> position_ids_to_cu_seqlens(np.array([[0, 1, 0, 1, 2, 0, 1, 2, 3]]))
    array([0, 2, 5, 9], dtype=int32)
    """
    seg = position_ids_to_segment_ids(position_ids, attention_mask, check=check)
    xp = backend_of(seg)
    return xp.cast(_cu_from_segments(xp, seg, "position_ids", False), xp.int32)


# ---- segment ids <-> seq_idx -----------------------------------------------------------------------------------------


def segment_ids_to_seq_idx(segment_ids: Any, *, check: bool = True) -> Any:
    """``(batch, seq)`` segment ids -> ``(batch, seq) int32`` Mamba ``seq_idx``: 0, 1, 2, ... per sequence of a row.

    Padding gets the row's sequence count — one extra trailing segment — so ``seq_idx`` stays non-decreasing and a
    kernel that resets state where ``seq_idx`` changes (mamba_ssm, causal-conv1d) never carries a real sequence's
    state into the padding or back.

    >>> segment_ids_to_seq_idx(np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])).tolist()
    [[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]]
    """
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    if check:
        _check_segment_ids(xp, seg, "segment_ids")
    if seg.shape[1] == 0:
        return xp.cast(seg, xp.int32)
    return xp.cast(xp.where(seg > 0, seg - 1, xp.amax(seg, 1)), xp.int32)


def seq_idx_to_segment_ids(seq_idx: Any, attention_mask: Any = None, *, check: bool = True) -> Any:
    """``(batch, seq)`` Mamba ``seq_idx`` -> ``(batch, seq) int64`` segment ids.

    Every row's real tokens must read 0, then steps of 0 or +1. ``attention_mask`` (0/1 or segment ids,
    right-padded) marks the padding, whose ``seq_idx`` is then ignored; without it every token is real.

    >>> seq_idx_to_segment_ids(np.array([[0, 0, 1, 1, 1, 2]]), attention_mask=[[1, 1, 1, 1, 1, 0]]).tolist()
    [[1, 1, 2, 2, 2, 0]]
    """
    xp, idx = _ints(seq_idx, "seq_idx", 2)
    real, mask_seg = _real_tokens(xp, attention_mask, idx, check)
    if check and idx.shape[1]:
        bad = real & (idx < 0)
        bad[:, 0] |= real[:, 0] & (idx[:, 0] != 0)
        bad[:, 1:] |= real[:, 1:] & (idx[:, 1:] != idx[:, :-1]) & (idx[:, 1:] != idx[:, :-1] + 1)
        hit = xp.first_true(bad)
        if hit is not None:
            r, c = hit
            value = idx[r, c].item()
            if value < 0 or c == 0:
                raise InvalidLayoutError(f"seq_idx[{r}, {c}] = {value}, but a row's seq_idx starts at 0 and never "
                                         f"decreases")
            raise InvalidLayoutError(f"seq_idx[{r}, {c}] = {value} follows {idx[r, c - 1].item()}; within a row "
                                     f"seq_idx stays or grows by 1")
    seg = xp.where(real, idx + 1, 0)
    if check and mask_seg is not None:
        _check_agrees(xp, seg, mask_seg, "seq_idx")
    return seg


# ---- LLaMA-Factory names -------------------------------------------------------------------------------------------


def get_seqlens_in_batch(attention_mask: Any) -> Any:
    """Sequence lengths of a LLaMA-Factory integer attention mask: ``(batch, seq)`` -> ``(n,) int64``.

    Same values as LLaMA-Factory's function; unlike it, the mask is validated (a segment id that reappears later
    in the row, or a real token after padding, is an error rather than a silently merged sequence), no Python loop
    runs over segment ids, and the result is int64 whatever the mask's dtype. Syncs once on CUDA.

    >>> get_seqlens_in_batch(np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])).tolist()
    [2, 3, 1, 2, 3]
    """
    xp, seg = _ints(attention_mask, "attention_mask", 2, bool_ok=True)
    return _lengths_from_segments(xp, seg, "attention_mask", True)


def get_unpad_data(attention_mask: Any) -> tuple[Any, Any, int]:
    """``(indices, cu_seqlens, max_seqlen_in_batch)`` for flash-attn varlen from an integer attention mask.

    Args:
        attention_mask: ``(batch, seq)`` segment ids (LLaMA-Factory) or 0/1, right-padded.

    Returns:
        indices: ``(total,) int64`` — positions of the non-padding tokens in the flattened ``(batch * seq)`` batch.
        cu_seqlens: ``(n + 1,) int32`` — offsets of the sequences among those tokens, leading 0.
        max_seqlen_in_batch: a Python int (0 for an all-padding batch) — the one unavoidable host sync.

    >>> indices, cu_seqlens, max_seqlen = get_unpad_data(np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    >>> indices.tolist(), cu_seqlens.tolist(), max_seqlen
    ([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11], [0, 2, 5, 6, 8, 11], 3)
    """
    xp, seg = _ints(attention_mask, "attention_mask", 2, bool_ok=True)
    cu = _cu_from_segments(xp, seg, "attention_mask", True)
    lengths = cu[1:] - cu[:-1]
    max_seqlen = int(lengths.max()) if lengths.shape[0] else 0
    return xp.flatnonzero(seg > 0), xp.cast(cu, xp.int32), max_seqlen


# ---- dense 4-D masks -------------------------------------------------------------------------------------------------


def _may_attend(xp: Any, seg: Any, window: int | None) -> Any:
    """``(batch, 1, seq, seq)`` bool: query i may attend key j (same sequence, j <= i, i - j < window)."""
    i = xp.arange(seg.shape[1], seg)
    q, k = seg[:, :, None], seg[:, None, :]
    allowed = (q == k) & (q > 0) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    return allowed[:, None]


def _float_dtype(xp: Any, dtype: Any) -> Any:
    """None for a boolean mask, else the floating dtype of an additive mask (numpy or torch, like the input)."""
    if dtype is None or dtype is bool:
        return None
    if isinstance(xp, TorchOps):
        if dtype == xp.torch.bool:
            return None
        if isinstance(dtype, xp.torch.dtype) and dtype.is_floating_point:
            return dtype
        accepted = "None or bool (a boolean mask) or a floating torch dtype (torch input gives a torch mask)"
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            np_dtype = None
        if np_dtype is not None and np_dtype.kind == "b":
            return None
        if np_dtype is not None and np_dtype.kind == "f":
            return np_dtype
        accepted = "None or bool (a boolean mask) or a floating numpy dtype (numpy input gives a numpy mask)"
    raise InvalidArgumentError(f"dtype must be {accepted}, got {describe(dtype)}")


def block_causal_mask(
    segment_ids: Any, sliding_window: int | None = None, dtype: Any = None, *, check: bool = True
) -> Any:
    """The dense block-diagonal causal mask of a packed batch: ``(batch, seq)`` -> ``(batch, 1, seq, seq)``.

    Query ``i`` may attend key ``j`` when both belong to the same sequence, ``j <= i`` and, with a
    ``sliding_window`` of ``w``, ``i - j < w`` (``w`` keys including itself — transformers' convention, flash-attn's
    ``window_size=(w - 1, 0)``). Padding queries attend nothing and nothing attends padding.

    Args:
        segment_ids: ``(batch, seq)``; from position_ids, use :func:`position_ids_to_segment_ids` first.
        sliding_window: None, or the window size ``w >= 1``.
        dtype: None (or bool): a boolean "may attend" mask, ``True`` = attend (``scaled_dot_product_attention``'s
            ``attn_mask``). A floating dtype: the additive mask transformers' eager/sdpa paths add to the scores,
            0 where allowed and the dtype's most negative finite value where not. A fully masked (padding) row
            then softmaxes to a harmless uniform row instead of NaN; torch >= 2.5 sdpa returns 0 for the boolean
            form's empty rows.

    Memory is O(batch · seq²) — 1 GiB of booleans at batch 1, seq 32k. Use it for eager attention, checks and
    short rows; :func:`block_mask` and varlen kernels scale.

    >>> block_causal_mask(np.array([[1, 1, 2, 2, 0]]))[0, 0].astype(int)
    array([[1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0],
           [0, 0, 1, 0, 0],
           [0, 0, 1, 1, 0],
           [0, 0, 0, 0, 0]])
    >>> block_causal_mask(np.array([[1, 1, 1]]), sliding_window=2, dtype=np.float16)[0, 0].tolist()
    [[0.0, -65504.0, -65504.0], [0.0, 0.0, -65504.0], [-65504.0, 0.0, 0.0]]
    """
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    window = _window(sliding_window)
    float_dtype = _float_dtype(xp, dtype)
    if check:
        _check_segment_ids(xp, seg, "segment_ids")
    allowed = _may_attend(xp, seg, window)
    if float_dtype is None:
        return allowed
    if isinstance(xp, TorchOps):
        out = xp.torch.zeros(tuple(allowed.shape), dtype=float_dtype, device=seg.device)
        return out.masked_fill_(~allowed, xp.torch.finfo(float_dtype).min)
    return np.where(allowed, float_dtype.type(0), np.finfo(float_dtype).min).astype(float_dtype)


def block_causal_mask_to_segment_ids(mask: Any, sliding_window: int | None = None, *, check: bool = True) -> Any:
    """Read the segment ids back from a dense block-causal mask: ``(batch, heads, seq, seq)`` -> ``(batch, seq) int64``.

    ``mask`` is boolean (True = may attend) or additive float (0 = may attend, anything else masked). Real tokens
    attend themselves and a sequence starts where a token may not attend its left neighbour, so the boundaries are
    read from the diagonal and the one below it; with ``check``, the mask is rebuilt from them with
    ``sliding_window`` and must match exactly, else :class:`InvalidLayoutError` names the first differing entry.
    A window of 1 hides every boundary and is refused.

    >>> seg = np.array([[1, 1, 2, 2, 2, 0]])
    >>> block_causal_mask_to_segment_ids(block_causal_mask(seg, sliding_window=2), sliding_window=2).tolist()
    [[1, 1, 2, 2, 2, 0]]
    """
    xp = backend_of(mask)
    given = mask
    if not xp.is_array(mask):
        try:
            mask = np.asarray(mask)
        except (TypeError, ValueError):
            mask = None
    if mask is None or mask.ndim != 4 or mask.shape[-1] != mask.shape[-2]:
        got = "" if xp.is_array(given) else f"{describe(given)}, "
        shape = f"shape {tuple(mask.shape)}" if mask is not None else "no array at all"
        raise InvalidLayoutError(f"mask must be a 4-D array (batch, heads, seq, seq) of booleans or floats, got "
                                 f"{got}{shape}")
    window = _window(sliding_window)
    if window == 1:
        raise InvalidArgumentError("sliding_window=1 lets every token attend only itself, which hides every boundary; "
                                   "a mask can be read back only with sliding_window=None or >= 2")
    if xp.kind(mask) == "i":
        raise InvalidLayoutError(f"mask must be boolean (True = may attend) or floating (additive, 0 = may attend), "
                                 f"got dtype {mask.dtype}")
    allowed = mask if xp.kind(mask) == "b" else mask == 0
    head = allowed[:, 0]
    real = xp.diagonal(head, 0)
    start = real.copy() if isinstance(xp, NumpyOps) else real.clone()
    start[:, 1:] &= ~xp.diagonal(head, -1)
    seg = xp.where(real, xp.cast(start, xp.int64).cumsum(1), 0)
    if check:
        after_pad = real[:, 1:] & ~real[:, :-1]
        hit = xp.first_true(after_pad)
        if hit is not None:
            r, c = hit[0], hit[1] + 1
            raise InvalidLayoutError(f"mask[{r}, :, {c}, {c}] lets token {c} attend itself after padding at token "
                                     f"{c - 1} (which attends nothing); padding must be a trailing run of each row")
        hit = xp.first_true(_may_attend(xp, seg, window) != allowed)
        if hit is not None:
            r, h, i, j = hit
            kind = "causal" if window is None else f"causal sliding-window (sliding_window={window})"
            raise InvalidLayoutError(
                f"mask[{r}, {h}, {i}, {j}] says {'attend' if bool(allowed[hit]) else 'masked'}, but the block-diagonal "
                f"{kind} mask of the boundaries on its diagonal says the opposite; it is not the mask of a packed row"
            )
    return seg


# ---- flex attention BlockMask --------------------------------------------------------------------------------------


def _flex(what: str) -> Any:
    torch = import_torch(what)
    try:
        flex_attention = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as exc:
        raise BackendUnavailableError(f"{what} needs torch.nn.attention.flex_attention (torch >= 2.5); this is torch "
                                      f"{torch.__version__}") from exc
    return flex_attention


def block_mask(
    segment_ids: Any, sliding_window: int | None = None, *, block_size: int = 128, check: bool = True
) -> Any:
    """The flex-attention ``BlockMask`` of a packed batch: the pattern of :func:`block_causal_mask`, never dense.

    Built with ``torch.nn.attention.flex_attention.create_block_mask`` on the device of ``segment_ids`` (a numpy
    array goes to the CPU), from a ``mask_mod`` that compares segment ids, is causal and honours
    ``sliding_window``; blocks of ``block_size`` tokens that hold no allowed pair are skipped by the kernel.
    The BlockMask keeps a reference to ``segment_ids``. Raises :class:`BackendUnavailableError` when torch or
    flex attention is missing.

    >>> bm = block_mask(np.array([[1, 1, 2, 2, 2, 0]]), block_size=2)
    >>> bm.shape, bm.to_dense().tolist()  # which 2x2 blocks of query x key hold any allowed pair
    ((1, 1, 6, 6), [[[[1, 0, 0], [0, 1, 0], [0, 1, 1]]]])
    """
    flex = _flex("block_mask")
    torch = sys.modules["torch"]
    if torch_module(segment_ids) is None:
        segment_ids = torch.as_tensor(np.asarray(segment_ids))
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    window = _window(sliding_window)
    block_size = as_positive_int(block_size, "block_size")
    if check:
        _check_segment_ids(xp, seg, "segment_ids")
    batch, seq = seg.shape

    def mask_mod(b, h, q_idx, kv_idx):
        same = (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] > 0) & (q_idx >= kv_idx)
        return same & (q_idx - kv_idx < window) if window is not None else same

    return flex.create_block_mask(mask_mod, batch, None, seq, seq, device=seg.device, BLOCK_SIZE=block_size)


def _blocks_to_tokens(torch: Any, num: Any, indices: Any, n_kv: int, block: tuple[int, int], q_len: int) -> Any:
    """``(B, H, q_len, n_kv * kv_block)`` bool: the tokens covered by the listed kv blocks of each query block."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
    cols = torch.where(listed, indices.long(), n_kv)  # unlisted slots land in a spare column, dropped below
    dense = torch.zeros((*indices.shape[:-1], n_kv + 1), dtype=torch.bool, device=indices.device)
    dense = dense.scatter_(-1, cols, True)[..., :n_kv]
    return dense.repeat_interleave(block[0], dim=-2)[..., :q_len, :].repeat_interleave(block[1], dim=-1)


def block_mask_to_segment_ids(block_mask: Any, sliding_window: int | None = None, *, check: bool = True) -> Any:
    """Read the segment ids back from a flex-attention ``BlockMask``: -> ``(batch, seq) int64`` torch tensor.

    The token-level pattern flex attention would apply is rebuilt exactly — ``mask_mod`` inside the partial
    blocks, everything inside the full blocks, nothing elsewhere — then read as in
    :func:`block_causal_mask_to_segment_ids`. Memory O(batch · heads · seq²): for checks, not for training steps.

    >>> seg = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    >>> block_mask_to_segment_ids(block_mask(seg, block_size=4)).tolist()
    [[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]
    """
    flex = _flex("block_mask_to_segment_ids")
    torch = sys.modules["torch"]
    if not isinstance(block_mask, flex.BlockMask):
        raise InvalidArgumentError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got "
                                   f"{describe(block_mask)}")
    batch, heads, q_len, kv_len = block_mask.shape
    device = block_mask.kv_num_blocks.device
    block = tuple(block_mask.BLOCK_SIZE)
    n_kv = -(-kv_len // block[1])
    tokens = flex.create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device=device)
    allowed = _blocks_to_tokens(torch, block_mask.kv_num_blocks, block_mask.kv_indices, n_kv, block, q_len)
    allowed = allowed[..., :kv_len] & tokens
    if block_mask.full_kv_num_blocks is not None:
        full = _blocks_to_tokens(torch, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv, block, q_len)
        allowed = allowed | full[..., :kv_len]
    return block_causal_mask_to_segment_ids(allowed, sliding_window, check=check)


# ---- one index per sequence of the whole batch ---------------------------------------------------------------------


def segment_ids_to_batch_seq_idx(segment_ids: Any, *, check: bool = True) -> Any:
    """``(batch, seq)`` segment ids -> ``(batch, seq) int64``: the sequence of every token, counted over the whole
    batch row after row — ``seq_idx`` with each row continuing the count of the rows before it, so that one
    ``bincount`` / ``index_add`` reduces per sequence across the batch. Values are below ``batch * seq``.

    A row's padding tail counts as one more sequence, as in :func:`segment_ids_to_seq_idx`. With ``check=False``
    any integers are read as runs (a sequence starts at every row start and wherever the value changes), and
    nothing syncs.

    >>> segment_ids_to_batch_seq_idx(np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0]])).tolist()
    [[0, 0, 1, 1, 1, 2], [3, 4, 4, 5, 5, 5], [6, 6, 6, 6, 6, 6]]
    """
    xp, seg = _ints(segment_ids, "segment_ids", 2, bool_ok=True)
    if check:
        _check_segment_ids(xp, seg, "segment_ids")
    start = xp.zeros(tuple(seg.shape), xp.bool_, seg) == 0
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return start.reshape(-1).cumsum(0).reshape(tuple(seg.shape)) - 1
