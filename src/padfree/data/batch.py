"""Packed batches as torch tensors, and the DataLoader collators that build them.

The last numpy step of the flow (:mod:`padfree.rows`) lays tokens out in rows; this module turns those rows into a
:class:`PackedBatch` of torch tensors and hands a model exactly the keyword arguments an exact packed forward needs.
Three ways in:

- :func:`pack_result_to_tensors` — a plan you already made (:func:`padfree.pack_sequences`) plus the token ids;
- :func:`packed_collate_fn` — a ``collate_fn`` for a ``torch.utils.data.DataLoader`` that packs the samples of every
  loader batch into rows of ``capacity`` tokens (``B`` = the number of bins, padding only at the end of each row);
- :class:`PaddingFreeCollator` — one row per loader batch, no padding unless ``pad_to_multiple_of`` asks for a tail
  (what transformers' ``DataCollatorWithFlattening`` does, with validation, ``cu_seqlens`` and the same
  :class:`PackedBatch`).

>>> collate = packed_collate_fn(capacity=6)
>>> batch = collate([{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22]}, {"input_ids": [31, 32, 33, 34]}])
>>> batch.input_ids.tolist()  # two rows of 6: [31..34] + [21, 22], then [11, 12, 13] + padding
[[31, 32, 33, 34, 21, 22], [11, 12, 13, 0, 0, 0]]
>>> batch.position_ids.tolist()  # restart at every sequence; the padding tail counts as one more sequence
[[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
>>> batch.labels.tolist()  # the model shifts; the first token of every sequence is never a target
[[-100, 32, 33, 34, -100, 22], [-100, 12, 13, -100, -100, -100]]
>>> batch.cu_seqlens.tolist(), batch.max_seqlen  # flash-attn varlen offsets over the 9 real tokens
([0, 4, 6, 9], 4)
>>> sorted(batch.model_inputs())
['cu_seq_lens_k', 'cu_seq_lens_q', 'input_ids', 'labels', 'max_length_k', 'max_length_q', 'position_ids', 'use_cache']

Conventions (those of :mod:`padfree.layout`, plus two that only a model-facing batch needs):

- ``cu_seqlens``/``max_seqlen`` describe the **real** tokens, flattened row after row without padding: the
  flash-attn varlen convention after unpadding (:func:`padfree.layout.get_unpad_data`).
- :meth:`PackedBatch.model_inputs` gives the flash kwargs ``cu_seq_lens_q/k``, ``max_length_q/k`` over the
  **padded** ``(B·T)`` stream instead — ``cu_seqlens_padded`` and ``max_seqlen_padded`` here — because that is what
  transformers' flash-attention path feeds to ``flash_attn_varlen_func`` after reshaping ``(B, T, ...)`` to
  ``(B·T, ...)`` when no ``attention_mask`` is given: each row's padding tail is one more sequence, exactly what
  ``transformers.modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids(position_ids)`` derives
  (``int32`` offsets), but computed once on the host at collate time, so no layer syncs with the device. The lengths
  are Python ints, as ``DataCollatorWithFlattening`` returns them.
- No all-ones (or 0/1) ``attention_mask`` ever reaches the model: transformers switches packed-sequence detection
  off as soon as a 2-D mask is passed, and would then let sequences of one row attend each other. Padding needs no
  mask: it is a sequence of its own that no real token can see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from padfree import layout
from padfree.data.carry import as_carry, concat_per_sample, per_token_values, split_columns
from padfree.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidSampleError,
    OverlongSequenceError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.packing.inputs import (
    MAX_CAPACITY,
    as_capacity,
    as_choice,
    as_flag,
    as_positive_int,
    as_seed,
    refuse_overlong,
)
from padfree.packing.packer import Packer
from padfree.packing.result import PackResult
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES
from padfree.rows import PackedRows, RowSpec, packed_rows
from padfree.samples import as_fill_value, read_samples

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.data.batch needs torch, which is not installed; pip install 'padfree[torch]'"
    ) from exc

__all__ = [
    "PackedBatch",
    "PackedCollator",
    "PaddingFreeCollator",
    "pack_result_to_tensors",
    "packed_collate_fn",
]

_MASK_KINDS = ("binary", "segments")
_NOT_A_DICT = (
    "a PackedBatch is not a dict of model inputs; call batch.model_inputs() for model(**inputs), or build the "
    "collator with return_dict=True for the Hugging Face Trainer"
)
_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class PackedBatch:
    """A packed batch: ``B`` rows of ``T`` tokens holding ``n`` whole sequences, then right padding.

    Feed a model with ``model(**batch.model_inputs())``. The batch is deliberately not a ``Mapping`` (it carries
    more than a model accepts; see :func:`packed_collate_fn` for the Hugging Face ``Trainer``, which wants
    ``return_dict=True``). ``.to(device)`` and ``.pin_memory()`` return moved copies; the tensors themselves are
    never modified in place.

    Attributes:
        input_ids: ``(B, T) int64`` — token ids; padding holds ``padding_value``.
        labels: ``(B, T) int64`` — Hugging Face aligned labels (the model shifts): the first token of every sequence
            and every padding position hold ``label_padding_value``; masks present in the input (``-100`` on prompt
            tokens) are kept.
        position_ids: ``(B, T) int64`` — ``0, 1, 2, ...`` restarting at every sequence; the padding tail of a row
            counts ``0, 1, ...`` as one more sequence.
        cu_seqlens: ``(n + 1,) int32`` — offsets of the sequences among the real tokens flattened row-major
            (flash-attn varlen after unpadding), leading 0.
        max_seqlen: the longest sequence (a Python int; 0 for an empty batch).
        seq_lens: ``(n,) int64`` — tokens of every sequence, row after row.
        seqs_per_row: ``(B,) int64`` — how many of those sequences each row holds.
        sequence_ids: ``(n,) int64`` — which input sample (index into the collated list, or into ``token_ids``)
            each sequence comes from; a sample split by ``overlong="split"`` appears once per piece.
        cu_seqlens_padded: ``(m + 1,) int32`` — offsets over the whole flattened ``(B·T)`` stream, where each row's
            padding tail (if any) is one more sequence: the flash kwargs of :meth:`model_inputs`.
        max_seqlen_padded: the longest segment of that stream (a Python int).
        attention_mask: ``(B, T) int64`` or None — ``"binary"`` (1 real, 0 padding) or ``"segments"``
            (LLaMA-Factory: 1, 2, 3, ... per sequence of a row, 0 padding), see ``mask_kind``.
        mask_kind: ``"binary"``, ``"segments"`` or None (no mask).
        seq_idx: ``(B, T) int32`` or None — Mamba's ``seq_idx``: 0, 1, 2, ... per row; padding = one more index.
        shift_labels: ``(B, T) int64`` or None — pre-shifted targets: ``shift_labels[:, t]`` is the label of the
            logits at ``t``; the last token of every sequence and all padding hold ``label_padding_value``.
        num_dropped: samples left out by ``overlong="drop"``; ``truncated_tokens``: tokens cut by
            ``overlong="truncate"``. Nothing is dropped without being counted here.
        carried: the columns the collator was asked to ``carry`` (:mod:`padfree.data.carry`): per-token ones
            ``(B, T)`` laid out like ``input_ids`` (0 on padding), per-sample ones (an image's pixels, its grid)
            concatenated in the order the samples sit in the rows. :meth:`model_inputs` passes them on.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: torch.Tensor
    seqs_per_row: torch.Tensor
    sequence_ids: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen_padded: int
    attention_mask: torch.Tensor | None = None
    mask_kind: str | None = None
    seq_idx: torch.Tensor | None = None
    shift_labels: torch.Tensor | None = None
    num_dropped: int = 0
    truncated_tokens: int = 0
    carried: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    # ---- sizes -----------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """``B``, the number of rows."""
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """``T``, the (padded) row length."""
        return int(self.input_ids.shape[1])

    @property
    def num_sequences(self) -> int:
        """``n``, the sequences (or pieces of split samples) in the batch."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens. Reads one value back from the device (a sync on CUDA)."""
        return int(self.cu_seqlens[-1])

    @property
    def num_padding(self) -> int:
        """Padding tokens: ``B·T - num_tokens``."""
        return self.batch_size * self.seq_len - self.num_tokens

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def cu_seqlens_per_row(self) -> list[torch.Tensor]:
        """SeqPacker's ``cu_seqlens``: one ``(sequences in row r + 1,) int32`` tensor of offsets per row, each from
        0 to the row's real tokens, so that its loop ``for i, cu in enumerate(batch.cu_seqlens_per_row)`` runs
        flash-attn varlen on row ``i`` alone. :attr:`cu_seqlens` is the flat form over the whole batch (one varlen
        call). Reads the per-row counts back from the device (a sync on CUDA).

        >>> from padfree import pack_sequences
        >>> batch = pack_result_to_tensors(pack_sequences([3, 2, 2], 4), [[1, 2, 3], [4, 5], [6, 7]])
        >>> [c.tolist() for c in batch.cu_seqlens_per_row]
        [[0, 3], [0, 2, 4]]
        """
        zero = torch.zeros(1, dtype=torch.int32, device=self.seq_lens.device)
        return [torch.cat([zero, lens.cumsum(0).to(torch.int32)])
                for lens in torch.split(self.seq_lens, self.seqs_per_row.tolist())]

    # ---- moving ------------------------------------------------------------------------------------

    def _map_tensors(self, fn: Any) -> PackedBatch:
        changes: dict[str, Any] = {
            f.name: fn(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        changes["carried"] = {key: fn(value) for key, value in self.carried.items()}
        return dataclasses.replace(self, **changes)

    def to(self, device: Any, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on ``device`` (``non_blocking`` as in ``Tensor.to``; pin memory first to
        overlap the copy with compute). Accelerate's ``send_to_device`` calls this method."""
        device = as_device(device)
        return self._map_tensors(lambda t: _moved(t, device, non_blocking))

    def pin_memory(self) -> PackedBatch:
        """A copy in pinned host memory; ``DataLoader(pin_memory=True)`` calls this method."""
        return self._map_tensors(lambda t: t.pin_memory())

    # ---- model side --------------------------------------------------------------------------------

    def model_inputs(
        self, *, include_labels: bool = True, flash_kwargs: bool = True, use_cache: bool | None = False
    ) -> dict[str, Any]:
        """The keyword arguments of an exact packed forward of a Hugging Face causal LM: ``model(**inputs)``.

        Args:
            include_labels: add ``labels`` (and ``shift_labels`` when the batch has them: transformers' causal-LM
                loss then uses them instead of shifting ``labels``, but computes a loss only when ``labels`` is
                given, so both go in).
            flash_kwargs: add ``cu_seq_lens_q``/``cu_seq_lens_k`` (``(m + 1,) int32``, the same tensor) and
                ``max_length_q``/``max_length_k`` (Python ints) over the flattened ``(B·T)`` stream, padding tails
                as sequences of their own — exactly what transformers derives from ``position_ids``, without its
                per-layer device sync, and what makes its flash path exact for ``B > 1`` too (it only infers
                packing from ``position_ids`` when ``B == 1``). Other attention backends ignore them.
            use_cache: ``False`` (default) passes ``use_cache=False``: a cache object switches transformers'
                packed-sequence detection off, and ``config.use_cache`` is often True. None leaves it out.

        Always ``input_ids`` and ``position_ids``; ``seq_idx`` when the batch has it (hybrid / Mamba models read
        it); ``attention_mask`` only when it holds LLaMA-Factory segment ids (``mask_kind == "segments"``) — a
        stock transformers model reads any 2-D mask as a 0/1 padding mask, so that form is for models made to
        honour segment ids (``configure_packing``). A binary mask is never returned: it would switch packed
        detection off.

        >>> batch = PaddingFreeCollator()([[5, 6, 7], [8, 9]])
        >>> inputs = batch.model_inputs()
        >>> inputs["position_ids"].tolist(), inputs["cu_seq_lens_q"].tolist(), inputs["max_length_q"]
        ([[0, 1, 2, 0, 1]], [0, 3, 5], 3)
        """
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if include_labels:
            inputs["labels"] = self.labels
            if self.shift_labels is not None:
                inputs["shift_labels"] = self.shift_labels
        if self.mask_kind == "segments":
            inputs["attention_mask"] = self.attention_mask
        if self.seq_idx is not None:
            inputs["seq_idx"] = self.seq_idx
        if flash_kwargs:
            inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = self.cu_seqlens_padded
            inputs["max_length_q"] = inputs["max_length_k"] = self.max_seqlen_padded
        if use_cache is not None:
            inputs["use_cache"] = use_cache
        inputs.update(self.carried)
        return inputs

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, ...)`` -> ``(num_tokens, ...)``: the real tokens, row after row — the stream ``cu_seqlens``
        indexes. Syncs once on CUDA (boolean indexing).

        >>> batch = packed_collate_fn(capacity=4)([[1, 2, 3], [4, 5]])
        >>> batch.input_ids.tolist(), batch.unpad(batch.input_ids).tolist()
        ([[1, 2, 3, 0], [4, 5, 0, 0]], [1, 2, 3, 4, 5])
        """
        csum = torch.cat([self.seq_lens.new_zeros(1), self.seq_lens.cumsum(0)])
        ends = self.seqs_per_row.cumsum(0)
        fill = csum[ends] - csum[ends - self.seqs_per_row]
        real = torch.arange(self.seq_len, device=fill.device)[None, :] < fill[:, None]
        return x[real.to(x.device)]

    def __contains__(self, key: object) -> bool:
        # the Hugging Face Trainer asks `"labels" in batch`: say what to do instead of Python's "not iterable"
        raise TypeError(_NOT_A_DICT)

    def __iter__(self) -> Any:
        raise TypeError(_NOT_A_DICT)

    def __repr__(self) -> str:
        extras = [name for name in ("attention_mask", "seq_idx", "shift_labels") if getattr(self, name) is not None]
        extras += list(self.carried)
        return (
            f"PackedBatch(rows={self.batch_size}, seq_len={self.seq_len}, sequences={self.num_sequences}, "
            f"max_seqlen={self.max_seqlen}, device={self.device}"
            + (f", with={extras}" if extras else "")
            + ")"
        )



# --------------------------------------------------------------------------------------------------
# numpy rows -> PackedBatch
# --------------------------------------------------------------------------------------------------


def _padded_stream_offsets(seq_lens: np.ndarray, spr: np.ndarray, fill: np.ndarray, width: int) -> np.ndarray:
    """``(m + 1,) int32`` offsets of the flattened ``(B·T)`` stream, each row's padding tail one more segment."""
    rows = fill.shape[0]
    if rows * width > _INT32_MAX:
        raise InvalidArgumentError(
            f"a batch of {rows} rows x {width} tokens has {rows * width} positions, more than int32 flash-attn "
            f"offsets can index ({_INT32_MAX}); use fewer or shorter rows"
        )
    row_of = np.repeat(np.arange(rows, dtype=np.int64), spr)
    row_start = np.cumsum(fill) - fill
    seq_start = np.cumsum(seq_lens) - seq_lens
    starts = row_of * width + (seq_start - row_start[row_of])
    tails = np.flatnonzero(fill < width)
    # a row's padding tail starts after all its sequences: merging by a stable sort keeps row order
    starts = np.sort(np.concatenate([starts, tails * width + fill[tails]]), kind="stable")
    out = np.empty(starts.shape[0] + 1, np.int32)
    out[:-1] = starts
    out[-1] = rows * width
    return out


def _tensor(array: np.ndarray, dtype: Any, device: Any) -> torch.Tensor:
    # from_numpy shares the buffer; the cast copies only when the dtype differs
    t = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    return t if device is None else _moved(t, device)


def as_device(device: Any) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None), or :class:`~padfree.errors.InvalidArgumentError` naming it.

    >>> as_device("cpu"), as_device(None)
    (device(type='cpu'), None)
    """
    if device is None:
        return None
    accepted = "None, a torch.device, a device string such as 'cpu' or 'cuda:0', or a device index"
    if isinstance(device, (bool, np.bool_)) or not isinstance(device, (str, int, np.integer, torch.device)):
        raise InvalidArgumentError(f"device must be {accepted}, got {describe(device)}")
    try:
        return torch.device(int(device) if isinstance(device, np.integer) else device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"device must be {accepted}, got {describe(device)}: {exc}") from None


def _moved(t: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """``t.to(device)``; a device torch parses but cannot reach here (no such accelerator) names the device."""
    try:
        return t.to(device, non_blocking=non_blocking)
    except (RuntimeError, AssertionError) as exc:  # torch built without CUDA raises AssertionError
        raise InvalidArgumentError(f"device={str(device)!r} is not usable on this machine: {exc}") from None


def _to_batch(
    arrays: dict[str, np.ndarray],
    rows: PackedRows,
    *,
    mask_kind: str | None,
    seq_idx: bool,
    device: Any,
    num_dropped: int = 0,
    truncated_tokens: int = 0,
    carried: Mapping[str, torch.Tensor] | None = None,
) -> PackedBatch:
    """Wrap ``(B, T)`` numpy arrays (from :meth:`PackedRows.padded` or built directly) and the row metadata."""
    num_rows, width = arrays["input_ids"].shape
    seq_lens = rows.seq_lens
    spr = np.diff(rows.piece_offsets)
    fill = rows.row_lengths
    cu = layout.lengths_to_cu_seqlens(seq_lens)
    cu_pad = _padded_stream_offsets(seq_lens, spr, fill, width)
    seq_idx_arr = None
    if seq_idx:
        if num_rows == 0 or width == 0:
            seq_idx_arr = np.zeros((num_rows, width), np.int32)
        elif mask_kind == "segments":
            seq_idx_arr = layout.segment_ids_to_seq_idx(arrays["attention_mask"], check=False)
        else:
            seq_idx_arr = layout.lengths_to_seq_idx(seq_lens, spr, width, check=False)
    long, i32 = torch.int64, torch.int32
    return PackedBatch(
        input_ids=_tensor(arrays["input_ids"], long, device),
        labels=_tensor(arrays["labels"], long, device),
        position_ids=_tensor(arrays["position_ids"], long, device),
        cu_seqlens=_tensor(cu, i32, device),
        max_seqlen=int(seq_lens.max()) if seq_lens.shape[0] else 0,
        seq_lens=_tensor(seq_lens, long, device),
        seqs_per_row=_tensor(spr, long, device),
        sequence_ids=_tensor(rows.sequence_ids, long, device),
        cu_seqlens_padded=_tensor(cu_pad, i32, device),
        max_seqlen_padded=int(np.diff(cu_pad).max()) if cu_pad.shape[0] > 1 else 0,
        attention_mask=_tensor(arrays["attention_mask"], long, device) if mask_kind is not None else None,
        mask_kind=mask_kind,
        seq_idx=_tensor(seq_idx_arr, i32, device) if seq_idx_arr is not None else None,
        shift_labels=_tensor(arrays["shift_labels"], long, device) if "shift_labels" in arrays else None,
        num_dropped=num_dropped,
        truncated_tokens=truncated_tokens,
        carried=dict(carried or {}),
    )


def _as_mask_kind(value: Any) -> str | None:
    if value is None:
        return None
    if value is True:
        return "binary"
    return as_choice(value, "attention_mask", _MASK_KINDS)


def _as_pad_to(pad_to: Any, capacity: int) -> int | str:
    """A collator's ``pad_to``: a row is at least ``capacity`` long and, as a capacity, at most ``MAX_CAPACITY``."""
    if isinstance(pad_to, str) and pad_to in ("capacity", "longest"):
        return pad_to
    if isinstance(pad_to, (int, np.integer)) and not isinstance(pad_to, bool) and capacity <= pad_to <= MAX_CAPACITY:
        return int(pad_to)
    raise InvalidArgumentError(f"pad_to must be 'capacity', 'longest' or a row length in [{capacity} (capacity), "
                               f"{MAX_CAPACITY}], got {describe(pad_to)}")


def _as_multiple(value: Any) -> int | None:
    """``pad_to_multiple_of``: None or a rounding of the row length (8, 64, 128, ...), at most ``MAX_CAPACITY``."""
    multiple = as_positive_int(value, "pad_to_multiple_of", allow_none=True)
    if multiple is not None and multiple > MAX_CAPACITY:
        raise InvalidArgumentError(f"pad_to_multiple_of must be None or an integer in [1, {MAX_CAPACITY}] (row lengths "
                                   f"are rounded up to a multiple of it, e.g. 64), got {multiple}")
    return multiple


def _padded(rows: PackedRows, pad_to: Any, multiple: Any, **options: Any) -> dict[str, np.ndarray]:
    """:meth:`PackedRows.padded`, after refusing a batch whose positions int32 flash-attn offsets cannot index —
    before its arrays are allocated, not after."""
    width = rows.row_width(pad_to, multiple)
    if rows.num_rows * width > _INT32_MAX:
        raise InvalidArgumentError(
            f"a batch of {rows.num_rows} rows x {width} tokens (pad_to={pad_to!r}, pad_to_multiple_of={multiple}) "
            f"has {rows.num_rows * width} positions, more than int32 flash-attn offsets can index ({_INT32_MAX}); "
            f"use fewer or shorter rows"
        )
    return rows.padded(width, **options)


def pack_result_to_tensors(
    result: PackResult,
    token_ids: Any,
    padding_value: int = 0,
    label_padding_value: int = IGNORE_INDEX,
    device: Any = None,
    *,
    labels: Any = None,
    pad_to: int | str = "capacity",
    pad_to_multiple_of: int | None = None,
    attention_mask: str | None = None,
    seq_idx: bool = False,
    shift_labels: bool = False,
) -> PackedBatch:
    """Lay ``token_ids`` out in the rows of ``result`` and return them as a :class:`PackedBatch` of tensors.

    Args:
        result: the plan, from :func:`padfree.pack_sequences` over the lengths of ``token_ids``.
        token_ids: the sequences (lists, arrays, a pyarrow list array, ...; see :func:`padfree.samples.read_tokens`).
        padding_value: token id written into padding.
        label_padding_value: the ignored label, on padding and on the first token of every sequence.
        device: where the tensors go (None: stay on the CPU, sharing the numpy buffers).
        labels: per-token labels with the lengths of ``token_ids`` (e.g. ``-100`` on prompt tokens); default: the ids.
        pad_to: ``"capacity"`` (every row ``result.capacity`` long), ``"longest"`` (the fullest row) or an int.
        pad_to_multiple_of: round the row length up to a multiple of this (8 or 64 suit tensor cores).
        attention_mask: None (none; the default, see :meth:`PackedBatch.model_inputs`), ``"binary"`` or
            ``"segments"`` (LLaMA-Factory segment ids).
        seq_idx: also build Mamba's ``seq_idx`` (``(B, T) int32``).
        shift_labels: also build the pre-shifted labels.

    Every row holds whole sequences (or pieces, after ``overlong="split"``), ``B = result.num_bins``. Unlike the
    seed API, the batch also carries ``seq_lens``/``seqs_per_row`` (to go back from ``cu_seqlens`` to rows), the
    flash kwargs over padded rows, and masks the first label of every packed sequence.

    >>> from padfree import pack_sequences
    >>> plan = pack_sequences([3, 2, 2], capacity=4)
    >>> batch = pack_result_to_tensors(plan, [[11, 12, 13], [21, 22], [31, 32]], pad_to_multiple_of=8)
    >>> batch.input_ids.tolist()
    [[11, 12, 13, 0, 0, 0, 0, 0], [21, 22, 31, 32, 0, 0, 0, 0]]
    >>> batch.cu_seqlens.tolist(), batch.seqs_per_row.tolist(), batch.sequence_ids.tolist()
    ([0, 3, 5, 7], [1, 2], [0, 1, 2])
    >>> batch.cu_seqlens_padded.tolist()  # over the 16 positions; each padding tail is a segment of its own
    [0, 3, 8, 10, 12, 16]
    """
    mask_kind = _as_mask_kind(attention_mask)
    device = as_device(device)
    seq_idx, shift_labels = as_flag(seq_idx, "seq_idx"), as_flag(shift_labels, "shift_labels")
    padding_value = as_fill_value(padding_value, "padding_value")
    rows = packed_rows(result, token_ids, labels=labels, label_padding_value=as_fill_value(label_padding_value,
                                                                                      "label_padding_value"))
    arrays = _padded(rows, pad_to, _as_multiple(pad_to_multiple_of), padding_value=padding_value,
                     attention_mask=mask_kind, shift_labels=shift_labels)
    return _to_batch(
        arrays,
        rows,
        mask_kind=mask_kind,
        seq_idx=seq_idx,
        device=device,
        num_dropped=int(result.dropped.shape[0]),
        truncated_tokens=int(result.truncated_tokens),
    )


# --------------------------------------------------------------------------------------------------
# Collators
# --------------------------------------------------------------------------------------------------


class PackedCollator:
    """``collate(samples) -> PackedBatch``: packs each loader batch into rows of ``capacity`` tokens.

    Build it with :func:`packed_collate_fn`, which documents the arguments. A plain class rather than a closure,
    so ``DataLoader(num_workers > 0)`` can pickle it into its workers.
    """

    def __init__(
        self,
        capacity: int | None = None,
        strategy: str = DEFAULT_STRATEGY,
        seed: int | None = None,
        padding_value: int = 0,
        label_padding_value: int = IGNORE_INDEX,
        *,
        overlong: str = "error",
        max_sequences_per_bin: int | None = None,
        pad_to: int | str = "capacity",
        pad_to_multiple_of: int | None = None,
        attention_mask: str | None = None,
        spec: PackingSpec | None = None,
        rows: RowSpec | None = None,
        seq_idx: bool = False,
        shift_labels: bool = False,
        return_dict: bool = False,
        carry: Sequence[str] | None = None,
    ) -> None:
        self.packer = Packer(capacity, strategy, seed, overlong=overlong, max_sequences_per_bin=max_sequences_per_bin,
                             spec=spec)
        if rows is not None:  # the layout keywords are checked below, with the collator's own bounds
            rows = RowSpec.resolve(rows, {"padding": pad_to, "pad_to_multiple_of": pad_to_multiple_of,
                                          "padding_value": padding_value, "label_padding_value": label_padding_value,
                                          "attention_mask": attention_mask},
                                   names={"padding": "pad_to"}, defaults={"attention_mask": None})
            pad_to, pad_to_multiple_of, attention_mask = rows.padding, rows.pad_to_multiple_of, rows.attention_mask
            padding_value, label_padding_value = rows.padding_value, rows.label_padding_value
        self.carry = as_carry(carry)
        self.capacity = self.packer.capacity
        self.padding_value = as_fill_value(padding_value, "padding_value")
        self.label_padding_value = as_fill_value(label_padding_value, "label_padding_value")
        self.pad_to = _as_pad_to(pad_to, self.capacity)
        self.pad_to_multiple_of = _as_multiple(pad_to_multiple_of)
        self.mask_kind = _as_mask_kind(attention_mask)
        self.seq_idx = as_flag(seq_idx, "seq_idx")
        self.shift_labels = as_flag(shift_labels, "shift_labels")
        self.return_dict = as_flag(return_dict, "return_dict")
        self.epoch = 0
        self.calls = 0

    @property
    def seed(self) -> int | None:
        return self.packer.seed

    def set_epoch(self, epoch: int) -> None:
        """Start the per-call seeds of ``epoch`` afresh (call it at the start of every epoch, in the main process,
        before the loader starts its workers; persistent workers keep counting instead)."""
        self.epoch = as_seed(epoch, "epoch") or 0
        self.calls = 0

    def _next_seed(self) -> int | None:
        """A different, reproducible seed per call: ``(seed, epoch, worker, call)`` through a SeedSequence."""
        if self.packer.seed is None or not STRATEGIES[self.packer.strategy].randomized:
            return None
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id + 1
        key = [self.packer.seed, self.epoch, worker, self.calls]
        self.calls += 1
        return int(np.random.SeedSequence(key).generate_state(1, np.uint32)[0])

    def __call__(self, samples: Sequence[Any]) -> PackedBatch | dict[str, Any]:
        read = read_samples(samples, ignored=(IGNORE_INDEX, self.label_padding_value))
        ids, labels = read.ids, read.labels
        lengths = ids.lengths
        if self.packer.spec.refuses_overlong:
            refuse_overlong(lengths, self.capacity, names=lambda i: f"samples[{i}]")
        result = self.packer.pack(lengths, seed=self._next_seed())
        rows = packed_rows(result, ids, labels=labels, label_padding_value=self.label_padding_value)
        arrays = _padded(rows, self.pad_to, self.pad_to_multiple_of, padding_value=self.padding_value,
                         attention_mask=self.mask_kind, shift_labels=self.shift_labels)
        carried = _carried(samples, self.carry, read, rows, lambda values: _padded(
            packed_rows(result, values), self.pad_to, self.pad_to_multiple_of)["input_ids"])
        batch = _to_batch(
            arrays,
            rows,
            mask_kind=self.mask_kind,
            seq_idx=self.seq_idx,
            device=None,
            num_dropped=int(result.dropped.shape[0]),
            truncated_tokens=int(result.truncated_tokens),
            carried=carried,
        )
        return batch.model_inputs() if self.return_dict else batch

    def __repr__(self) -> str:
        return (
            f"PackedCollator(capacity={self.capacity}, strategy={self.packer.strategy!r}, seed={self.packer.seed}, "
            f"overlong={self.packer.overlong!r}, pad_to={self.pad_to!r}, attention_mask={self.mask_kind!r}, "
            f"seq_idx={self.seq_idx}, shift_labels={self.shift_labels}, return_dict={self.return_dict}"
            + (f", carry={list(self.carry)}" if self.carry else "") + ")"
        )


def _carried(samples: Sequence[Any], carry: tuple[str, ...], read: Any, rows: PackedRows,
             lay_out: Any) -> dict[str, torch.Tensor]:
    """The ``carry`` columns of ``samples`` for a batch of ``rows`` (:mod:`padfree.data.carry`); ``lay_out`` turns
    per-sample int64 arrays into the ``(B, T)`` array the tokens' layout gives them."""
    if not carry:
        return {}
    if read.row_offsets is not None:
        raise InvalidSampleError("carry with already-packed samples (several sequences in one): the packer may place "
                                 "their sequences apart from the columns they carry; carry columns of unpacked samples")
    lengths = read.ids.lengths
    per_token, per_sample = split_columns(samples, carry, lengths)
    out = {key: torch.from_numpy(np.ascontiguousarray(lay_out(per_token_values(samples, key))))
           for key in per_token}
    order = rows.sequence_ids
    whole = rows.seq_lens == lengths[order]
    for key in per_sample:
        value = concat_per_sample(samples, key, order, whole)
        if value is not None:
            out[key] = value
    return out


def packed_collate_fn(
    capacity: int | None = None,
    strategy: str = DEFAULT_STRATEGY,
    seed: int | None = None,
    padding_value: int = 0,
    label_padding_value: int = IGNORE_INDEX,
    *,
    overlong: str = "error",
    max_sequences_per_bin: int | None = None,
    pad_to: int | str = "capacity",
    pad_to_multiple_of: int | None = None,
    attention_mask: str | None = None,
    spec: PackingSpec | None = None,
    rows: RowSpec | None = None,
    seq_idx: bool = False,
    shift_labels: bool = False,
    return_dict: bool = False,
    carry: Sequence[str] | None = None,
) -> PackedCollator:
    """A ``collate_fn`` that packs the samples of every loader batch into rows of ``capacity`` tokens.

    Each call packs its samples with :func:`padfree.pack_sequences` (``strategy``, ``overlong``,
    ``max_sequences_per_bin``) and returns a :class:`PackedBatch` with ``B`` = the number of bins. Pick the loader's
    ``batch_size`` so that a batch of samples fills about the rows you want: ``B`` varies with the lengths.

    Args:
        capacity: tokens per row.
        strategy, overlong, max_sequences_per_bin: as in :func:`padfree.pack_sequences`. With
            ``overlong="error"`` an overlong sample raises :class:`~padfree.errors.OverlongSequenceError` naming it.
        seed: for randomized strategies (``ffs``), every call draws its own shuffle from
            ``(seed, epoch, DataLoader worker, call number)``, so a run is reproducible for a fixed
            ``num_workers``; :meth:`PackedCollator.set_epoch` starts an epoch's sequence. None: fresh entropy.
        padding_value, label_padding_value: the padding token id and the ignored label.
        pad_to, pad_to_multiple_of, attention_mask, seq_idx, shift_labels: as in :func:`pack_result_to_tensors`
            (an int ``pad_to`` must be >= ``capacity``).
        spec: ``capacity``, ``strategy``, ``seed``, ``overlong`` and ``max_sequences_per_bin`` as one
            :class:`~padfree.PackingSpec`, in place of those keywords (a keyword given too is refused, naming both).
        rows: ``pad_to`` (as ``padding``, not None here), ``pad_to_multiple_of``, ``padding_value``,
            ``label_padding_value`` and ``attention_mask`` as one :class:`~padfree.RowSpec`, in place of those
            keywords; it states every one of them (``RowSpec()`` asks for a ``"binary"`` mask).
        return_dict: return ``batch.model_inputs()`` (a plain ``dict``) instead of the :class:`PackedBatch`.
        carry: other columns of the samples to carry into the batch (:attr:`PackedBatch.carried`, passed on by
            ``model_inputs``): per-token ones (``mm_token_type_ids``, ...) laid out like the tokens, per-sample ones
            (a vision-language processor's ``pixel_values``, ``image_grid_thw``, ...) concatenated in the order the
            samples sit in the rows (:mod:`padfree.data.carry`).

    Samples are dicts with ``input_ids`` (a list, numpy array or tensor of ints) and optionally ``labels`` (all
    samples or none), or plain token-id sequences. Bad samples raise
    :class:`~padfree.errors.InvalidTokensError` naming the sample: no ``input_ids``, non-integer or negative ids,
    an empty sample, labels of another length.

    Why a :class:`PackedBatch` and not a dict by default: the batch carries more than a model accepts
    (``cu_seqlens`` over real tokens, ``seq_lens``, ``sequence_ids``) and converts itself
    (:meth:`~PackedBatch.model_inputs`, ``.to``, ``.pin_memory``). It is deliberately *not* a ``Mapping``: the
    Hugging Face ``Trainer`` rebuilds every Mapping with ``type(batch)({...})`` and passes it as ``model(**batch)``,
    which a batch with such fields cannot survive (and its ``model(**batch)`` would hand the model keys it does not
    take). For the ``Trainer`` (or any loop that does ``model(**batch)``), pass ``return_dict=True``: the collator
    then returns exactly the model's keyword arguments. A ``PackedBatch`` handed to the Trainer anyway raises a
    ``TypeError`` that says so at its first ``"labels" in batch``.

    >>> import torch
    >>> samples = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([-100, -100, 3])},
    ...            {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([-100, 5])}]
    >>> batch = packed_collate_fn(capacity=8, pad_to="longest", shift_labels=True)(samples)
    >>> batch.labels.tolist(), batch.shift_labels.tolist()
    ([[-100, -100, 3, -100, 5]], [[-100, 3, -100, 5, -100]])
    >>> loader = torch.utils.data.DataLoader(samples, batch_size=2, collate_fn=packed_collate_fn(8, return_dict=True))
    >>> next(iter(loader))["input_ids"].shape
    torch.Size([1, 8])
    >>> from padfree import PackingSpec, RowSpec
    >>> collate = packed_collate_fn(spec=PackingSpec(8), rows=RowSpec(padding="longest", attention_mask=None))
    >>> collate(samples).input_ids.tolist()
    [[1, 2, 3, 4, 5]]
    """
    return PackedCollator(
        capacity,
        strategy,
        seed,
        padding_value,
        label_padding_value,
        overlong=overlong,
        max_sequences_per_bin=max_sequences_per_bin,
        pad_to=pad_to,
        pad_to_multiple_of=pad_to_multiple_of,
        attention_mask=attention_mask,
        spec=spec,
        rows=rows,
        seq_idx=seq_idx,
        shift_labels=shift_labels,
        return_dict=return_dict,
        carry=carry,
    )


class PaddingFreeCollator:
    """Flatten every loader batch into one row: ``B = 1``, ``T`` = all tokens, no padding.

    transformers' ``DataCollatorWithFlattening``, made complete: the same ``input_ids``, ``position_ids`` and
    ``labels`` (the first label of every sample replaced by ``label_padding_value`` — HF's ``separator_id`` —
    and the sample's own label masks kept), plus ``cu_seqlens``/``max_seqlen``, the flash kwargs, and the options of
    :func:`packed_collate_fn` (``attention_mask``, ``seq_idx``, ``shift_labels``, ``return_dict``), in the same
    :class:`PackedBatch`. Where it differs from HF's: bad samples raise (HF gives an empty sample a label without a
    token and misaligns every later label; labels of the wrong length misalign silently), positions always start
    at 0 (HF's ``position_ids_start`` serves RoBERTa-like models, which are not causal LMs), and ``position_ids`` are
    always returned — without them sdpa and eager attention would let the samples of the row attend each other.

    Samples that are already packed rows keep every boundary they carry, in any spelling of
    :data:`padfree.samples.BOUNDARY_KEYS` (``seq_lens``, TRL's ``seq_lengths``, ``cu_seq_lens``, restarting
    ``position_ids``, a LLaMA-Factory segment ``attention_mask``); a sample holds no padding (a 0 in its
    ``attention_mask`` is refused).

    Args:
        label_padding_value: the ignored label put on the first token of every sample (and on padding).
        attention_mask, seq_idx, shift_labels, return_dict: as in :func:`packed_collate_fn`.
        max_tokens: refuse a batch with more tokens than this (:class:`~padfree.errors.OverlongSequenceError`);
            None: no limit.
        pad_to_multiple_of: pad the row with ``padding_value`` tokens up to a multiple of this (as TRL's
            padding-free collator does, for tensor cores); None: no padding. The padding tail follows the
            conventions of :func:`packed_collate_fn`: positions ``0, 1, ...`` as one more sequence, labels
            ``label_padding_value``, left out of ``seq_lens`` / ``cu_seqlens`` and a segment of its own in
            ``cu_seqlens_padded``.
        padding_value: the token id of the padding.
        carry: other columns to carry, as in :func:`packed_collate_fn`.

    >>> collate = PaddingFreeCollator(seq_idx=True)
    >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": None}])
    >>> batch.input_ids.tolist(), batch.labels.tolist(), batch.seq_idx.tolist()
    ([[5, 6, 7, 8, 9]], [[-100, 6, 7, -100, 9]], [[0, 0, 0, 1, 1]])
    >>> batch = PaddingFreeCollator(pad_to_multiple_of=4)([[5, 6, 7], [8, 9]])
    >>> batch.input_ids.tolist(), batch.position_ids.tolist()
    ([[5, 6, 7, 8, 9, 0, 0, 0]], [[0, 1, 2, 0, 1, 0, 1, 2]])
    >>> batch.labels.tolist(), batch.seq_lens.tolist(), batch.cu_seqlens_padded.tolist()
    ([[-100, 6, 7, -100, 9, -100, -100, -100]], [3, 2], [0, 3, 5, 8])
    """

    def __init__(
        self,
        *,
        label_padding_value: int = IGNORE_INDEX,
        attention_mask: str | None = None,
        seq_idx: bool = False,
        shift_labels: bool = False,
        return_dict: bool = False,
        max_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_value: int = 0,
        carry: Sequence[str] | None = None,
    ) -> None:
        self.carry = as_carry(carry)
        self.label_padding_value = as_fill_value(label_padding_value, "label_padding_value")
        self.pad_to_multiple_of = _as_multiple(pad_to_multiple_of)
        self.padding_value = as_fill_value(padding_value, "padding_value")
        self.mask_kind = _as_mask_kind(attention_mask)
        self.seq_idx = as_flag(seq_idx, "seq_idx")
        self.shift_labels = as_flag(shift_labels, "shift_labels")
        self.return_dict = as_flag(return_dict, "return_dict")
        self.max_tokens = as_capacity(max_tokens, "max_tokens") if max_tokens is not None else None

    def __call__(self, samples: Sequence[Any]) -> PackedBatch | dict[str, Any]:
        read = read_samples(samples, ignored=(IGNORE_INDEX, self.label_padding_value))
        ids, labels = read.ids, read.labels
        lengths = ids.lengths
        n, total = int(lengths.shape[0]), int(ids.offsets[-1])
        if self.max_tokens is not None and total > self.max_tokens:
            raise OverlongSequenceError(f"the batch holds {total} tokens, more than max_tokens={self.max_tokens}; "
                                        f"use a smaller batch_size or raise max_tokens")
        starts = ids.offsets[:-1]
        out_labels = (labels.values if labels is not None else ids.values).astype(np.int64, copy=True)
        out_labels[starts] = self.label_padding_value
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
        rows = PackedRows(
            input_ids=ids.values,
            labels=out_labels,
            position_ids=position_ids,
            row_offsets=np.array([0, total], np.int64),
            seq_lens=lengths,
            piece_offsets=np.array([0, n], np.int64),
            sequence_ids=np.arange(n, dtype=np.int64),
            capacity=total,
            label_padding_value=self.label_padding_value,
        )
        multiple = self.pad_to_multiple_of
        width = total if multiple is None else -(-total // multiple) * multiple
        carried = _carried(samples, self.carry, read, rows, lambda values: np.pad(
            np.concatenate(values), (0, width - total))[None])
        if width != total:
            # the padding tail laid out by the rows kernel, which holds the padding rules of every collator
            arrays = _padded(rows, total, multiple, padding_value=self.padding_value,
                             attention_mask=self.mask_kind, shift_labels=self.shift_labels)
            batch = _to_batch(arrays, rows, mask_kind=self.mask_kind, seq_idx=self.seq_idx, device=None,
                              carried=carried)
            return batch.model_inputs() if self.return_dict else batch
        # one row without padding: the flat buffers are the (1, T) arrays, no scatter needed
        arrays = {"input_ids": ids.values[None], "labels": out_labels[None], "position_ids": position_ids[None]}
        if self.mask_kind == "binary":
            arrays["attention_mask"] = np.ones((1, total), np.int64)
        elif self.mask_kind == "segments":
            arrays["attention_mask"] = rows.segment_ids()[None]
        if self.shift_labels:
            arrays["shift_labels"] = rows.shift_labels()[None]
        batch = _to_batch(arrays, rows, mask_kind=self.mask_kind, seq_idx=self.seq_idx, device=None, carried=carried)
        return batch.model_inputs() if self.return_dict else batch

    def __repr__(self) -> str:
        return (
            f"PaddingFreeCollator(label_padding_value={self.label_padding_value}, attention_mask={self.mask_kind!r}, "
            f"seq_idx={self.seq_idx}, shift_labels={self.shift_labels}, return_dict={self.return_dict}, "
            f"max_tokens={self.max_tokens}, pad_to_multiple_of={self.pad_to_multiple_of}, "
            f"padding_value={self.padding_value}" + (f", carry={list(self.carry)}" if self.carry else "") + ")"
        )

