"""``pack_dataset`` on a streaming ``datasets.IterableDataset``: rows packed online, written as the same columns.

A stream has no global plan; its rows come from :class:`padfree.IterablePackingDataset` (a :class:`StreamPacker`
over a buffer of ``buffer_size`` sequences, exact boundaries, nothing dropped silently), laid out with the options of
:func:`padfree.pack_dataset` — padding, ``pad_to_multiple_of``, the attention-mask kind, the columns and their
names — and handed back as a ``datasets.IterableDataset`` that packs while it is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError
from padfree.packing.spec import PackingSpec
from padfree.rows import PackedRows

__all__ = ["pack_stream"]

_STREAM_COLUMNS = ("input_ids", "attention_mask", "labels", "position_ids", "seq_lens")


def pack_stream(data: Any, packing: PackingSpec, opts: Any, buffer_size: int, *, refuse_per_token: bool = False,
                not_carried: frozenset[str] = frozenset()) -> Any:
    """The packed rows of the stream ``data`` as a ``datasets.IterableDataset`` (``packing``: the plan's settings,
    ``opts``: pack_dataset's layout options).

    ``refuse_per_token``: a stream's rows are packed without their other columns, so a per-token column (a list as
    long as the row's ``input_ids``, outside ``not_carried``) is refused when the rows holding it are read, rather
    than dropped without a word (``pack_dataset(carry=None)``; ``carry=[]`` leaves them out knowingly).
    """
    import datasets

    capacity = packing.capacity
    if packing.cuts_at_row_edges:
        raise InvalidArgumentError(f"strategy={packing.strategy!r} cuts the sequences at the rows' edges of one plan "
                                   f"over the whole input; a stream is packed as it is read: choose another strategy "
                                   f"(e.g. 'nf', which also keeps the input order) or load the data as a map-style "
                                   f"datasets.Dataset")
    if opts.padding == "longest":
        raise InvalidArgumentError("padding='longest' needs every row before the first is written; a stream has no "
                                   "end to wait for: use padding='capacity', an int, or None")
    if isinstance(opts.padding, int) and opts.padding < capacity:
        raise InvalidArgumentError(f"padding={opts.padding} is shorter than capacity={capacity}, which a row of the "
                                   f"stream may fill; pass padding >= capacity, 'capacity' or None")
    extra = [what for what, _ in opts.columns if what not in _STREAM_COLUMNS]
    if extra:
        raise InvalidArgumentError(f"columns {extra} cannot be written for a stream (a stream's sequences have no "
                                   f"row index); choose from {list(_STREAM_COLUMNS)}")
    names = getattr(data, "column_names", None) or []
    masks = [m for m in opts.label_masks if m in names]
    if masks and "labels" not in names:
        raise InvalidArgumentError(f"the stream has {masks} but no labels: pack_dataset folds those masks into labels "
                                   f"for a map-style dataset only; map them into a 'labels' column first")
    if refuse_per_token:
        data = data.map(_refuse_per_token_columns, batched=True, with_indices=True,
                        fn_kwargs={"not_carried": not_carried})
    kwargs = {"data": data, "packing": packing, "opts": opts, "buffer_size": buffer_size}
    return datasets.IterableDataset.from_generator(_rows, gen_kwargs=kwargs)


def _refuse_per_token_columns(batch: dict[str, list[Any]], indices: list[int], *,
                              not_carried: frozenset[str]) -> dict[str, list[Any]]:
    """Pass a batch of the stream through unchanged, or refuse its first per-token column (one ``len`` per row)."""
    ids = batch.get("input_ids")
    if ids is None:
        return {}
    want = [None if row is None else len(row) for row in ids]
    for name, values in batch.items():
        if name in not_carried:
            continue
        lengths = [len(v) if isinstance(v, (list, tuple, np.ndarray)) else None for v in values]
        if any(n is not None for n in lengths) and all(n is None or n == w for n, w in zip(lengths, want,
                                                                                            strict=True)):
            row = indices[next(i for i, n in enumerate(lengths) if n is not None)]
            raise InvalidArgumentError(
                f"the stream's column {name!r} holds one value per token (row {row} is as long as its input_ids), "
                f"which pack_dataset cannot carry into the packed rows of a stream yet; pass carry=[] to leave it "
                f"out, remove it first (stream.remove_columns([{name!r}])), or load the data as a map-style "
                f"datasets.Dataset (which carries it)"
            )
    return {}


def _rows(data: Any, packing: PackingSpec, opts: Any, buffer_size: int) -> Iterator[dict[str, list[int]]]:
    from padfree.data.datasets import IterablePackingDataset

    rows = IterablePackingDataset(data, buffer_size=buffer_size, shuffle=False, spec=packing,
                                  label_padding_value=opts.label_padding_value)
    for row in rows:
        yield _layout(row, packing.capacity, opts)


def _layout(row: dict[str, Any], capacity: int, opts: Any) -> dict[str, list[int]]:
    """One unpadded row of tensors as the columns pack_dataset writes, padded as asked by the rows' own padding
    (:meth:`padfree.rows.PackedRows.padded`: the tail's positions count 0, 1, ..., its labels are ignored, mask 0)."""
    ids = row["input_ids"].numpy()
    seq_lens = row["seq_lens"].numpy()
    n, k = ids.shape[0], seq_lens.shape[0]
    rows = PackedRows(input_ids=ids, labels=row["labels"].numpy(), position_ids=row["position_ids"].numpy(),
                      row_offsets=np.array([0, n]), seq_lens=seq_lens, piece_offsets=np.array([0, k]),
                      sequence_ids=np.arange(k), capacity=capacity, label_padding_value=opts.label_padding_value)
    pad_to = n if opts.padding is None else opts.padding
    values = {name: column[0] for name, column in rows.padded(
        pad_to, pad_to_multiple_of=opts.pad_to_multiple_of, padding_value=opts.padding_value,
        attention_mask=opts.attention_mask).items()}
    values["seq_lens"] = seq_lens
    return {name: values[what].tolist() for what, name in opts.columns if what in values}
