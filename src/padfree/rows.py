"""PackResult + token ids -> packed rows: one compiled gather over flat buffers.

Conventions (shared with :mod:`padfree.layout`):

- Rows are stored flat, as CSR: row ``r`` is ``flat[row_offsets[r]:row_offsets[r + 1]]``. Padding is a separate,
  explicit step (:meth:`PackedRows.padded`), so the same rows serve padded batches, padding-free batches and Arrow
  list columns without copies of Python lists.
- ``position_ids`` restart at 0 at every placed piece. A piece is a whole sequence, or — after
  ``overlong="split"`` — one piece of a split sequence, which becomes a sequence of its own: its positions restart
  and its first label is masked, exactly like a separate example.
- ``labels`` follow the Hugging Face convention: aligned with ``input_ids`` (the model shifts them), with the first
  token of every piece set to ``label_padding_value`` so no token is predicted from the previous sequence. Label
  masks present in the input (``-100`` on prompt tokens for completion-only training) are kept as they are.
- ``shift_labels`` (built on request) is the pre-shifted form a hand-written loop feeds to cross-entropy:
  ``shift_labels[t]`` is the target of the logits at ``t``; the last token of every piece has none.
- Padding (when asked for) fills the tail of a row with ``padding_value``, ``label_padding_value`` labels, attention
  mask 0 and segment id 0; its ``position_ids`` count ``0, 1, ...`` as if the tail were one more sequence, so that
  position-based packing detection never glues the tail to the last real sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from padfree.errors import InvalidArgumentError, InvalidTokensError, describe
from padfree.layout import IGNORE_INDEX
from padfree.packing.inputs import MAX_CAPACITY, as_choice, as_positive_int
from padfree.packing.result import PackResult, as_pack_result
from padfree.packing.spec import resolve_spec
from padfree.samples import as_fill_value, read_tokens

__all__ = ["PackedRows", "RowSpec", "fill_rows", "mask_labels", "packed_rows"]

ROW_PADDINGS = ("capacity", "longest")
ROW_MASKS = ("binary", "segments")


@dataclass(frozen=True)
class RowSpec:
    """How a packed row is laid out, validated on construction with the errors the keywords give; passed as
    ``rows=`` to :func:`~padfree.pack_dataset`, :func:`~padfree.pack_dataset_from_result` and the collators
    (:func:`~padfree.packed_collate_fn`) in place of their layout keywords.

    Args:
        padding: the row length: ``"capacity"`` (every row the plan's capacity), ``"longest"`` (the fullest row),
            an int, or None (no padding: every row as long as its tokens). The collators call it ``pad_to`` and
            take no None.
        pad_to_multiple_of: round every row length up to a multiple of this (None: no rounding).
        padding_value: the token id written into padding (an int that fits int32).
        label_padding_value: the ignored label, on padding and on the first token of every sequence (int32 too).
        attention_mask: ``"binary"`` (1 real / 0 padding), ``"segments"`` (1-based sequence index, 0 padding) or
            None (none; the collators' default, see :meth:`padfree.PackedBatch.model_inputs`).

    A :class:`RowSpec` states every setting: a route's own defaults do not fill it in (``RowSpec()`` writes a
    ``"binary"`` mask on every route).

    >>> from padfree import pack_dataset
    >>> rows = RowSpec(padding=None, attention_mask="segments")
    >>> pack_dataset([[1, 2], [3, 4, 5], [6]], capacity=4, rows=rows)[:]["attention_mask"]
    [[1, 1, 1, 2], [1, 1]]
    >>> RowSpec(padding=0)
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidArgumentError: padding must be 'capacity', 'longest', None or an int >= 1, got 0 (type int)
    """

    padding: str | int | None = "capacity"
    pad_to_multiple_of: int | None = None
    padding_value: int = 0
    label_padding_value: int = IGNORE_INDEX
    attention_mask: str | None = "binary"

    def __post_init__(self) -> None:
        for name, value in checked_rows(dataclasses.asdict(self), {}).items():
            object.__setattr__(self, name, value)

    @classmethod
    def resolve(cls, rows: Any, keywords: Mapping[str, Any], *, names: Mapping[str, str] | None = None,
                defaults: Mapping[str, Any] | None = None) -> RowSpec:
        """The layout a route runs with: ``rows`` (passed as ``rows=``), or one built from the route's ``keywords``
        (:func:`padfree.packing.spec.resolve_spec`: a setting given both ways is refused, naming both)."""
        return resolve_spec(cls, rows, "rows", keywords, checked_rows, names=names, defaults=defaults)


def checked_rows(values: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """``values`` (the fields of a :class:`RowSpec`) validated, one error naming the route's argument (``names``:
    ``{field: argument}``)."""
    name = {f.name: names.get(f.name, f.name) for f in dataclasses.fields(RowSpec)}
    padding = values["padding"]
    if isinstance(padding, str):
        padding = as_choice(padding, name["padding"], ROW_PADDINGS)
    elif padding is not None:
        if isinstance(padding, bool) or not isinstance(padding, (int, np.integer)) or padding < 1:
            raise InvalidArgumentError(f"{name['padding']} must be 'capacity', 'longest', None or an int >= 1, got "
                                       f"{describe(padding)}")
        padding = int(padding)
    mask = values["attention_mask"]
    return {
        "padding": padding,
        "pad_to_multiple_of": as_positive_int(values["pad_to_multiple_of"], name["pad_to_multiple_of"],
                                              allow_none=True),
        # int32: the type of the token and label columns pack_dataset writes
        "padding_value": as_fill_value(values["padding_value"], name["padding_value"], np.int32),
        "label_padding_value": as_fill_value(values["label_padding_value"], name["label_padding_value"], np.int32),
        "attention_mask": None if mask is None else as_choice(mask, name["attention_mask"], ROW_MASKS),
    }


# --------------------------------------------------------------------------------------------------
# The layout kernel: the one implementation of every rule above, used by packed_rows, PackedRows.padded,
# PackedRows.segment_ids and padfree.data._arrow_writer (which runs it in threads, straight into its chunk buffers)
# --------------------------------------------------------------------------------------------------


@intrinsic
def _memcpy(typingctx, dst, d, src, s, n):  # pragma: no cover - compiled
    """``dst[d:d + n] = src[s:s + n]`` as one ``llvm.memcpy`` (same dtype, contiguous arrays).

    numba compiles a slice assignment into an element loop with index arithmetic: 2x slower than libc's memcpy on
    the pieces of a packed row (hundreds of tokens each).
    """
    sig = types.void(dst, d, src, s, n)

    def codegen(context, builder, signature, args):
        dst_type, _, src_type, _, n_type = signature.args
        dst_ptr = builder.gep(context.make_array(dst_type)(context, builder, args[0]).data, [args[1]])
        src_ptr = builder.gep(context.make_array(src_type)(context, builder, args[2]).data, [args[3]])
        count = context.cast(builder, args[4], n_type, types.intp)
        itemsize = context.get_abi_sizeof(context.get_data_type(dst_type.dtype))
        cgutils.raw_memcpy(builder, dst_ptr, src_ptr, count, itemsize)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _prefetch(typingctx, array, i):  # pragma: no cover - compiled
    """Ask the CPU to start loading ``array[i]`` (``llvm.prefetch``; never faults, whatever the address)."""
    sig = types.void(array, i)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), cgutils.voidptr_t)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [cgutils.voidptr_t], fnty)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data
        return context.get_dummy_value()

    return sig, codegen


def _copy(dst, d, src, s, n):  # pragma: no cover - the Python stand-in of the overload below
    dst[d : d + n] = src[s : s + n]


@overload(_copy, inline="always")
def _copy_overload(dst, d, src, s, n):  # pragma: no cover - compiled
    if dst.dtype == src.dtype and dst.layout == "C" and src.layout == "C":
        def impl(dst, d, src, s, n):
            _memcpy(dst, d, src, s, n)
    else:  # a conversion (int32 ids into int64 labels, ...) or a strided array: one element at a time
        def impl(dst, d, src, s, n):
            for k in range(n):
                dst[d + k] = src[s + k]
    return impl


#: Pieces ahead whose first tokens are prefetched: a piece starts at a random place of the input (one cache and
#: TLB miss each); asking for it while the pieces before it are copied overlaps that latency (~15% on 1M pieces).
_PREFETCH_AHEAD = 16


@njit(cache=True, nogil=True)
def fill_rows(ids_src, ids_start, label_src, label_start, piece_len, piece_offsets, row_offsets, ramp,
              out_ids, out_labels, out_pos, out_mask, padding_value, label_pad, segments):  # pragma: no cover
    """Lay out the pieces of every row, then its padding tail: the row layout of this module, in one pass.

    Args:
        ids_src: ``(span,)`` flat source token ids; piece ``p`` is ``ids_src[ids_start[p]:ids_start[p] +
            piece_len[p]]``.
        ids_start, piece_len: ``(pieces,)`` integers.
        label_src, label_start: the same for the source labels, or ``(None, None)``: labels are the token ids.
        piece_offsets, row_offsets: ``(rows + 1,)`` — row ``r`` holds pieces ``piece_offsets[r]:piece_offsets[r + 1]``
            and output slots ``row_offsets[r]:row_offsets[r + 1]`` (its tokens, then padding). Either may be a
            window of a larger CSR: only differences and absolute indices are used.
        ramp: ``(longest piece or tail,)`` 0, 1, 2, ... in ``out_pos``'s dtype: positions are copied from it.
        out_ids, out_labels, out_pos, out_mask: ``(slots,)`` outputs, or None (not written; compiled out).
        padding_value, label_pad: written into the padding of ``out_ids`` / ``out_labels``; ``label_pad`` also on
            the first label of every piece, so that no token is predicted from the previous sequence.
        segments: ``out_mask`` holds the 1-based index of the piece in its row (True) or 1 (False); 0 on padding.

    Positions restart at 0 at every piece and count 0, 1, ... over the padding tail, as if it were one more
    sequence.
    """
    num_rows = row_offsets.shape[0] - 1
    end_piece = piece_offsets[num_rows]
    for r in range(num_rows):
        d = row_offsets[r]
        first = piece_offsets[r]
        for p in range(first, piece_offsets[r + 1]):
            ahead = p + _PREFETCH_AHEAD
            if ahead < end_piece:
                if out_ids is not None or (out_labels is not None and label_src is None):
                    _prefetch(ids_src, ids_start[ahead])
                if out_labels is not None and label_src is not None:
                    _prefetch(label_src, label_start[ahead])
            n = piece_len[p]
            if out_ids is not None:
                _copy(out_ids, d, ids_src, ids_start[p], n)
            if out_labels is not None:
                if label_src is None:
                    _copy(out_labels, d, ids_src, ids_start[p], n)
                else:
                    _copy(out_labels, d, label_src, label_start[p], n)
                out_labels[d] = label_pad
            if out_pos is not None:
                _copy(out_pos, d, ramp, 0, n)
            if out_mask is not None:
                out_mask[d : d + n] = p - first + 1 if segments else 1
            d += n
        end = row_offsets[r + 1]
        if out_ids is not None:
            out_ids[d:end] = padding_value
        if out_labels is not None:
            out_labels[d:end] = label_pad
        if out_pos is not None:
            _copy(out_pos, d, ramp, 0, end - d)
        if out_mask is not None:
            out_mask[d:end] = 0


@njit(cache=True, nogil=True)
def mask_labels(mask_src, mask_start, piece_len, piece_offsets, row_offsets, out_labels,
                label_pad):  # pragma: no cover
    """Set ``out_labels`` to ``label_pad`` wherever the piece's 0/1 mask is 0 (the layout of :func:`fill_rows`)."""
    num_rows = row_offsets.shape[0] - 1
    for r in range(num_rows):
        d = row_offsets[r]
        for p in range(piece_offsets[r], piece_offsets[r + 1]):
            s = mask_start[p]
            for k in range(piece_len[p]):
                if mask_src[s + k] == 0:
                    out_labels[d + k] = label_pad
            d += piece_len[p]


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PackedRows:
    """Packed rows as flat buffers. Row ``r`` holds tokens ``row_offsets[r]:row_offsets[r + 1]`` and pieces
    ``piece_offsets[r]:piece_offsets[r + 1]``.

    Attributes:
        input_ids: ``(total,)`` token ids, row after row, no padding.
        labels: ``(total,) int64`` — Hugging Face aligned labels, first token of every piece masked.
        position_ids: ``(total,) int64`` — restart at 0 at every piece.
        row_offsets: ``(num_rows + 1,) int64``.
        seq_lens: ``(num_pieces,) int64`` — tokens of every piece, row after row.
        piece_offsets: ``(num_rows + 1,) int64`` — CSR of pieces per row.
        sequence_ids: ``(num_pieces,) int64`` — the input sequence each piece comes from.
        capacity: the row capacity of the plan.
        label_padding_value: the ignored-label value used for masking.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    row_offsets: np.ndarray
    seq_lens: np.ndarray
    piece_offsets: np.ndarray
    sequence_ids: np.ndarray
    capacity: int
    label_padding_value: int = IGNORE_INDEX

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.shape[0] - 1)

    @property
    def row_lengths(self) -> np.ndarray:
        """``(num_rows,) int64`` — real tokens per row."""
        return np.diff(self.row_offsets)

    def row(self, r: int) -> dict[str, np.ndarray]:
        """The unpadded arrays of row ``r`` (input_ids, labels, position_ids, seq_lens, cu_seqlens)."""
        a, b = self.row_offsets[r], self.row_offsets[r + 1]
        lens = self.seq_lens[self.piece_offsets[r] : self.piece_offsets[r + 1]]
        return {
            "input_ids": self.input_ids[a:b],
            "labels": self.labels[a:b],
            "position_ids": self.position_ids[a:b],
            "seq_lens": lens,
            "cu_seqlens": np.concatenate(([0], np.cumsum(lens))).astype(np.int32),
        }

    def shift_labels(self) -> np.ndarray:
        """``(total,) int64`` — pre-shifted targets: ``shift_labels[t]`` is what the logits at ``t`` predict.

        The last token of every piece (and so of every row) has no target within its sequence.
        """
        return _shifted(self.labels, self.row_offsets[1:], self.label_padding_value)

    def segment_ids(self) -> np.ndarray:
        """``(total,) int64`` — 1-based index of the piece within its row (the LLaMA-Factory mask values)."""
        out = np.empty(self.input_ids.shape[0], np.int64)
        starts = self._piece_starts()
        fill_rows(self.input_ids, starts, None, None, self.seq_lens, self.piece_offsets, self.row_offsets,
                  _ramp(0), None, None, None, out, 0, self.label_padding_value, True)
        return out

    def _piece_starts(self) -> np.ndarray:
        """``(num_pieces,) int64`` — where each piece starts in the flat arrays."""
        starts = np.zeros(self.seq_lens.shape[0], np.int64)
        np.cumsum(self.seq_lens[:-1], out=starts[1:])
        return starts

    def padded(
        self,
        pad_to: int | str = "capacity",
        *,
        pad_to_multiple_of: int | None = None,
        padding_value: int = 0,
        attention_mask: str | None = "binary",
        shift_labels: bool = False,
    ) -> dict[str, np.ndarray]:
        """Rows as a dict of ``(num_rows, row_len)`` arrays.

        Args:
            pad_to: ``"capacity"`` (every row ``capacity`` long), ``"longest"`` (the longest row) or an int.
            pad_to_multiple_of: round the row length up to a multiple of this (e.g. 8 or 64 for tensor cores).
            padding_value: token id written into padding.
            attention_mask: ``"binary"`` (1 real, 0 padding), ``"segments"`` (1-based piece index, 0 padding) or
                None (no mask column).
            shift_labels: also return ``shift_labels``.

        >>> from padfree import pack_sequences
        >>> plan = pack_sequences([3, 2, 2], capacity=6)
        >>> rows = packed_rows(plan, [[11, 12, 13], [21, 22], [31, 32]])
        >>> batch = rows.padded("capacity", attention_mask="segments", shift_labels=True)
        >>> batch["input_ids"].tolist()
        [[11, 12, 13, 21, 22, 0], [31, 32, 0, 0, 0, 0]]
        >>> batch["position_ids"].tolist()
        [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
        >>> batch["labels"].tolist()
        [[-100, 12, 13, -100, 22, -100], [-100, 32, -100, -100, -100, -100]]
        >>> batch["shift_labels"].tolist()
        [[12, 13, -100, 22, -100, -100], [32, -100, -100, -100, -100, -100]]
        >>> batch["attention_mask"].tolist()
        [[1, 1, 1, 2, 2, 0], [1, 1, 0, 0, 0, 0]]
        """
        width = self.row_width(pad_to, pad_to_multiple_of)
        if attention_mask is not None and not (isinstance(attention_mask, str) and attention_mask in _MASKS):
            raise InvalidArgumentError(
                f"attention_mask must be 'binary', 'segments' or None, got {describe(attention_mask)}"
            )
        padding_value = as_fill_value(padding_value, "padding_value")
        shape = (self.num_rows, width)
        # int64 whatever the source dtype: result_type(uint64, int64) would be float64
        out = {"input_ids": np.empty(shape, np.int64), "labels": np.empty(shape, np.int64),
               "position_ids": np.empty(shape, np.int64)}
        mask = np.empty(shape, np.int64) if attention_mask is not None else None
        # the rows are laid out again from the pieces, by the kernel that laid them out flat: the padding rules
        # (tail positions 0, 1, ..., masked labels, mask 0) live there and only there; the first label of every
        # piece, already masked in self.labels, is masked again
        fill_rows(self.input_ids, self._piece_starts(), self.labels, self._piece_starts(), self.seq_lens,
                  self.piece_offsets, np.arange(self.num_rows + 1, dtype=np.int64) * width, _ramp(width),
                  out["input_ids"].reshape(-1), out["labels"].reshape(-1), out["position_ids"].reshape(-1),
                  None if mask is None else mask.reshape(-1), padding_value, self.label_padding_value,
                  attention_mask == "segments")
        if mask is not None:
            out["attention_mask"] = mask
        if shift_labels:  # the padded rows shifted as one flat buffer, each padded row ending where its slots do
            ends = np.arange(1, self.num_rows + 1, dtype=np.int64) * width
            out["shift_labels"] = _shifted(out["labels"].reshape(-1), ends, self.label_padding_value).reshape(shape)
        return out

    def row_width(self, pad_to: int | str = "capacity", pad_to_multiple_of: int | None = None) -> int:
        """The padded row length :meth:`padded` lays out, from its arguments (checked here, before anything is
        allocated): at least the longest row, at most ``MAX_CAPACITY`` tokens (the bound of a capacity, far beyond
        any context length) — an int ``pad_to`` is a row length, not a count of rows to allocate.

        >>> from padfree import pack_sequences
        >>> rows = packed_rows(pack_sequences([3, 2, 2], capacity=6), [[1, 2, 3], [4, 5], [6, 7]])
        >>> rows.row_width(), rows.row_width("longest"), rows.row_width("longest", pad_to_multiple_of=8)
        (6, 5, 8)
        """
        longest = int(self.row_lengths.max()) if self.num_rows else 0
        accepted = f"'capacity', 'longest' or an int in [{longest} (the longest row), {MAX_CAPACITY}]"
        if isinstance(pad_to, str) and pad_to == "capacity":
            width = self.capacity
        elif isinstance(pad_to, str) and pad_to == "longest":
            width = longest
        elif isinstance(pad_to, (int, np.integer)) and not isinstance(pad_to, bool) and \
                longest <= pad_to <= MAX_CAPACITY:
            width = int(pad_to)
        else:
            raise InvalidArgumentError(f"pad_to must be {accepted}, got {describe(pad_to)}")
        if pad_to_multiple_of is not None:
            multiple = pad_to_multiple_of
            if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or not \
                    1 <= multiple <= MAX_CAPACITY:
                raise InvalidArgumentError(f"pad_to_multiple_of must be None or an int in [1, {MAX_CAPACITY}] (a "
                                           f"row length is rounded up to a multiple of it, e.g. 64), got "
                                           f"{describe(multiple)}")
            base, width = width, -(-width // int(multiple)) * int(multiple)
            if width > MAX_CAPACITY:
                raise InvalidArgumentError(
                    f"pad_to_multiple_of={int(multiple)} rounds rows of {base} tokens up to {width}, more than the "
                    f"{MAX_CAPACITY} tokens a row may hold; pass a multiple of at most {MAX_CAPACITY} (e.g. 64)"
                )
        return width


def packed_rows(
    result: PackResult,
    token_ids: Any,
    *,
    labels: Any = None,
    label_padding_value: int = IGNORE_INDEX,
    bins: slice | None = None,
) -> PackedRows:
    """Lay the tokens of ``token_ids`` out in the rows planned by ``result``.

    Args:
        result: the plan, from :func:`padfree.pack_sequences` over the lengths of ``token_ids``.
        token_ids: ``num_sequences`` sequences of token ids (any form :func:`padfree.samples.read_tokens` reads).
        labels: optional per-token labels with the same lengths (e.g. ``-100`` on prompt tokens); default: the
            token ids themselves.
        label_padding_value: written on the first token of every piece (and on padding, later).
        bins: a contiguous range of bins (``slice(start, stop)``, step 1) to lay out instead of all of them, so
            that a large dataset can be written chunk by chunk with bounded memory.

    Cost: O(tokens laid out) in one pass of :func:`fill_rows` (a memcpy per piece) — no Python loop over sequences
    or tokens — plus one O(num_sequences) check that the token lengths match the plan.

    >>> from padfree import pack_sequences
    >>> plan = pack_sequences([5, 2], capacity=4, overlong="split")
    >>> rows = packed_rows(plan, [[1, 2, 3, 4, 5], [6, 7]])
    >>> [rows.row(r)["input_ids"].tolist() for r in range(rows.num_rows)]
    [[1, 2, 3, 4], [6, 7, 5]]
    >>> rows.position_ids.tolist()  # [5], the second piece of the split sequence, restarts at 0
    [0, 1, 2, 3, 0, 1, 0]
    >>> rows.labels.tolist()
    [-100, 2, 3, 4, -100, 7, -100]
    """
    result = as_pack_result(result)
    label_padding_value = as_fill_value(label_padding_value, "label_padding_value")
    tokens = read_tokens(token_ids)
    if len(tokens) != result.num_sequences:
        raise InvalidTokensError(
            f"token_ids has {len(tokens)} sequences but the plan was made for {result.num_sequences}"
        )
    lengths = tokens.lengths
    if not np.array_equal(lengths, result.lengths):
        i = int(np.argmax(lengths != result.lengths))
        raise InvalidTokensError(
            f"token_ids[{i}] has {lengths[i]} tokens but the plan says lengths[{i}] = {result.lengths[i]}"
        )
    label_buf = None
    if labels is not None:
        label_buf = read_tokens(labels, "labels", kind="labels", ignored=(IGNORE_INDEX, label_padding_value))
        if len(label_buf) != len(tokens) or not np.array_equal(label_buf.lengths, lengths):
            diff = np.flatnonzero(label_buf.lengths != lengths) if len(label_buf) == len(tokens) else [len(label_buf)]
            i = int(diff[0]) if len(diff) else 0
            got = label_buf.lengths[i] if i < len(label_buf) else "no"
            raise InvalidTokensError(f"labels[{i}] has {got} entries but token_ids[{i}] has {lengths[i]} tokens")

    first, last = _bin_range(bins, result.num_bins)
    p0, p1 = int(result.bin_offsets[first]), int(result.bin_offsets[last])
    seq = result.order[p0:p1]
    piece_len = result.placed_lengths[p0:p1]
    piece_start = result.piece_starts[p0:p1] if result.piece_starts is not None else 0
    piece_offsets = result.bin_offsets[first : last + 1] - p0
    row_offsets = np.zeros(last - first + 1, np.int64)
    np.cumsum(result.bin_fill[first:last], out=row_offsets[1:])
    total = int(row_offsets[-1])
    input_ids = np.empty(total, tokens.values.dtype)
    out_labels = np.empty(total, np.int64)
    position_ids = np.empty(total, np.int64)
    label_values = label_start = None
    if label_buf is not None:
        label_values, label_start = label_buf.values, label_buf.offsets[:-1][seq] + piece_start
    ramp = _ramp(int(piece_len.max(initial=0)))
    fill_rows(tokens.values, tokens.offsets[:-1][seq] + piece_start, label_values, label_start, piece_len,
              piece_offsets, row_offsets, ramp, input_ids, out_labels, position_ids, None, 0, label_padding_value,
              False)
    return PackedRows(
        input_ids=input_ids,
        labels=out_labels,
        position_ids=position_ids,
        row_offsets=row_offsets,
        seq_lens=piece_len,
        piece_offsets=piece_offsets,
        sequence_ids=seq,
        capacity=result.capacity,
        label_padding_value=label_padding_value,
    )


_MASKS = ("binary", "segments")


def _shifted(labels: np.ndarray, row_ends: np.ndarray, label_padding_value: int) -> np.ndarray:
    """Pre-shifted targets of flat rows ending at ``row_ends``: ``out[t] = labels[t + 1]``, masked at every row end.

    ``labels[t + 1]`` is already masked at every piece start, so only row ends need masking.
    """
    out = np.empty_like(labels)
    out[:-1] = labels[1:]
    out[row_ends - 1] = label_padding_value
    return out


def _ramp(n: int) -> np.ndarray:
    """``(n,) int64`` — 0, 1, ..., n - 1: the positions :func:`fill_rows` copies from."""
    return np.arange(n, dtype=np.int64)


def _bin_range(bins: slice | None, num_bins: int) -> tuple[int, int]:
    if bins is None:
        return 0, num_bins
    if not isinstance(bins, slice) or bins.step not in (None, 1):
        raise InvalidArgumentError(f"bins must be a slice of consecutive bins (step 1) or None, got {describe(bins)}")
    first, last, _ = bins.indices(num_bins)
    return first, max(first, last)
