"""Pack a Hugging Face ``datasets.Dataset`` into packed rows: one global plan, Arrow in and Arrow out.

:func:`pack_dataset` packs every sequence of the dataset at once (not block by block: TRL's ``pack_dataset`` packs
each block of 1,000 rows on its own and loses 0.3–1.7 points of efficiency to it), then writes the packed rows as a
new ``datasets.Dataset``, one chunk of rows at a time, straight from flat buffers into Arrow list columns:

>>> ds = pack_dataset([[11, 12, 13], [21, 22], [31, 32, 33, 34]], capacity=6)
>>> ds.column_names
['input_ids', 'attention_mask', 'labels', 'position_ids', 'seq_lens']
>>> rows = ds[:]
>>> rows["input_ids"]  # two rows of 6: [31..34] + [21, 22], then [11, 12, 13] + padding
[[31, 32, 33, 34, 21, 22], [11, 12, 13, 0, 0, 0]]
>>> rows["labels"]  # Hugging Face aligned (the model shifts); every sequence's first token is never a target
[[-100, 32, 33, 34, -100, 22], [-100, 12, 13, -100, -100, -100]]
>>> rows["position_ids"]  # restart at every sequence; the padding tail counts 0, 1, ... as one more sequence
[[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
>>> rows["attention_mask"], rows["seq_lens"]
([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], [[4, 2], [3]])

Unpadded rows (``padding=None``) are the smallest on disk, and what a padding-free collator wants:

>>> pack_dataset([[11, 12, 13], [21, 22], [31, 32, 33, 34]], capacity=6, padding=None,
...              columns=["input_ids", "seq_lens"])[:]["input_ids"]
[[31, 32, 33, 34, 21, 22], [11, 12, 13]]

What goes in
    A ``datasets.Dataset`` with an ``input_ids`` column of integer lists, plus optionally ``labels`` (aligned with
    ``input_ids``, ``-100`` on tokens that are not targets), or TRL's 0/1 columns ``completion_mask`` /
    ``assistant_masks`` (used when there is no ``labels`` column, exactly as TRL's ``SFTTrainer`` builds labels: a
    token is a target only where every present mask is nonzero). The columns are read from the dataset's Arrow
    table without copying, chunk by chunk, through any indices mapping (after ``select``/``shuffle``/``sort``), so
    a memory-mapped dataset stays memory-mapped. Also accepted: a ``pyarrow.Table``, a dict of columns, a pyarrow
    list array, or a list of token-id lists (with ``labels=`` for their labels). Other columns are not carried over:
    a packed row mixes several input rows.

What comes out
    One row per bin of the plan, with the columns of ``columns`` (default: ``input_ids``, ``attention_mask``,
    ``labels``, ``position_ids``, ``seq_lens``; also available: ``sequence_ids``):

    ================  ===================  =======================================================================
    column            Arrow type           per row
    ================  ===================  =======================================================================
    input_ids         list<int32>          the tokens of the row's pieces, back to back, then ``padding_value``
    attention_mask    list<int8>           ``"binary"``: 1 on real tokens, 0 on padding; ``"segments"``
                      (list<int32>)        (int32): the 1-based index of the piece in the row, 0 on padding (the
                                           LLaMA-Factory integer mask, see :mod:`padfree.layout`)
    labels            list<int32>          ``labels`` of the input (or the token ids), with the first token of every
                                           piece and every padding token set to ``label_padding_value``
    position_ids      list<int32>          0, 1, ... restarting at every piece; the padding tail counts 0, 1, ...
    seq_lens          list<int32>          the tokens of every piece, left to right (padding not included), so
                                           ``cu_seqlens`` = ``[0] + cumsum(seq_lens)``
    sequence_ids      list<int64>          the input row each piece comes from (row of ``data``, after indices)
    ================  ===================  =======================================================================

    Token ids and labels are int64 instead of int32 only when a value does not fit int32. Compact types keep the
    dataset small on disk; ``datasets``' torch formatter and the usual collators turn them into ``torch.long``.
    A piece is a whole input sequence or, after ``overlong="split"``, one piece of a split sequence, which becomes a
    sequence of its own (positions restart, first label masked), as in :mod:`padfree.rows`.

Memory and disk
    The output is built ``chunk_tokens`` row slots at a time, in reusable buffers, by several threads. Small
    results (``keep_in_memory=None`` and at most :data:`IN_MEMORY_MAX_BYTES`) stay in memory; larger ones are
    written to an Arrow file that the returned dataset memory-maps: ``cache_file_name`` if given, else next to the
    input dataset's own cache files (as ``datasets.Dataset.map`` does; ``padfree-pack-<fingerprint>.arrow``), else
    in ``datasets``' temporary directory, which is deleted when the Python session ends (``save_to_disk`` the
    result to keep it). The file is written while the next chunks are built, with ``O_DIRECT`` where the filesystem
    allows it (the output is written once, read later, and has no business in the page cache; the rows are then
    laid out right inside the Arrow messages in the disk's buffers, so no output byte is copied after the gather),
    and atomically: a failed call leaves no file. Peak memory grows by the input pages the gather reads (1x the
    token bytes at most) plus a working set that does not grow with the data — two staging buffers for the disk of
    64 MB plus a chunk each, ~0.25 GB with the defaults (without ``O_DIRECT``: two chunks of rows more) — never by
    the size of the output.

The plan
    ``return_result=True`` returns ``(dataset, result)``: the :class:`~padfree.PackResult` whose bins are the
    dataset's rows (sequence ids are rows of ``data``), for metrics (``result.efficiency``), for
    :func:`pack_dataset_from_result` on another column set, or to keep with the dataset. Nothing is stored in the
    dataset's ``info``: the plan is arrays, and the ``sequence_ids`` column carries it row by row when asked for.

Differences from SeqPacker's ``hf_utils.pack_dataset`` (same name, arguments and columns) and TRL's
``pack_dataset``: nothing is dropped or cut silently (an empty sequence, a sequence longer than ``capacity`` under
``overlong="error"``, a label column that does not match its ``input_ids`` are errors naming the row); the padding
tail's ``position_ids`` count 0, 1, ... instead of continuing or repeating, so position-based packing detection
never glues padding to the last sequence; ``seq_lens`` gives the boundaries back (TRL calls it ``seq_lengths``:
pass ``columns={"input_ids": "input_ids", "seq_lens": "seq_lengths"}`` for TRL's padding-free collator).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.errors import (
    BackendUnavailableError,
    DataLoadError,
    InvalidArgumentError,
    InvalidTokensError,
    OverlongSequenceError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.packing import DEFAULT_STRATEGY, PackResult, pack_sequences
from padfree.packing.inputs import OVERLONG_POLICIES, as_capacity, as_choice, as_positive_int
from padfree.rows import fill_rows, mask_labels
from padfree.samples import as_fill_value, read_arrow_chunks, read_tokens, refuse_empty

__all__ = [
    "COLUMNS",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_COLUMNS",
    "IN_MEMORY_MAX_BYTES",
    "LABEL_MASK_COLUMNS",
    "pack_dataset",
    "pack_dataset_from_result",
]

logger = logging.getLogger("padfree")

#: Every column :func:`pack_dataset` can write, in the order it writes them.
COLUMNS = ("input_ids", "attention_mask", "labels", "position_ids", "seq_lens", "sequence_ids")
#: The columns written by default: SeqPacker's four, plus ``seq_lens`` to rebuild ``cu_seqlens``.
DEFAULT_COLUMNS = ("input_ids", "attention_mask", "labels", "position_ids", "seq_lens")
#: TRL's 0/1 loss-mask columns, folded into the labels when the input has no ``labels`` column.
LABEL_MASK_COLUMNS = ("completion_mask", "assistant_masks")
#: Row slots (tokens + padding) built per chunk: ~13 bytes each with the default columns, i.e. ~55 MB per chunk:
#: large enough that per-chunk costs vanish (~100 chunks for 1M sequences), small enough for a small working set.
DEFAULT_CHUNK_TOKENS = 1 << 22
#: With ``keep_in_memory=None``, results up to this many bytes stay in memory; larger ones go to an Arrow file.
IN_MEMORY_MAX_BYTES = 1 << 26

_MAX_THREADS = 8  # the gather is latency-bound: threads help until memory bandwidth runs out
_MIN_SLOTS_PER_THREAD = 1 << 16  # below this a chunk is built by one thread: a task costs ~10 us

_INT32 = np.iinfo(np.int32)
_PADDINGS = ("capacity", "longest")
_MASKS = ("binary", "segments")


# --------------------------------------------------------------------------------------------------
# Optional dependencies
# --------------------------------------------------------------------------------------------------


def _import_hf() -> tuple[Any, Any]:
    try:
        import datasets
        import pyarrow as pa
    except ImportError as exc:
        raise BackendUnavailableError(
            f"pack_dataset needs datasets and pyarrow, which could not be imported ({exc}); "
            "install them with: pip install 'padfree[hf]'"
        ) from exc
    return datasets, pa


# --------------------------------------------------------------------------------------------------
# Reading: per-token columns as one flat view, whatever their chunking
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Source:
    """One per-token input column. Physical row ``i`` is ``values[starts[i]:starts[i] + lengths[i]]``.

    ``values`` is one read-only array over every chunk of the column (see :func:`_one_view`), so a kernel reads any
    row of any chunk without a Python loop over chunks; ``lengths`` is -1 for a null row.
    """

    name: str
    values: np.ndarray  # (span,) read-only
    starts: np.ndarray  # (rows,) int64
    lengths: np.ndarray  # (rows,) int64
    chunks: tuple[np.ndarray, ...]  # the real arrays behind ``values``: range checks, and kept alive

    def fits_int32(self) -> bool:
        """Whether every value fits int32 (one pass over the values, only for 64-bit and uint32 columns)."""
        dtype = self.values.dtype
        if dtype.kind == "b" or (dtype.kind in "iu" and dtype.itemsize < 4) or dtype == np.int32:
            return True
        return all(c.size == 0 or (c.min() >= _INT32.min and c.max() <= _INT32.max) for c in self.chunks)


class _Span:
    """``__array_interface__`` over ``nbytes`` bytes at ``address``; keeps the arrays that own them alive."""

    def __init__(self, address: int, length: int, dtype: np.dtype, owners: tuple[np.ndarray, ...]) -> None:
        self.__array_interface__ = {"version": 3, "shape": (length,), "typestr": dtype.str, "data": (address, True)}
        self.owners = owners


def _one_view(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One read-only array through which every array of ``arrays`` (same dtype) is visible, without a copy.

    Returns ``(view, first)`` with ``view[first[k]:first[k] + arrays[k].size]`` equal to ``arrays[k]``.

    A memory-mapped dataset is a thousand Arrow chunks (one per 1,000 rows) lying in one mapping per file, a few
    kilobytes apart; ``combine_chunks`` would copy all of them into fresh memory. Instead the view spans from the
    lowest to the highest chunk address and each chunk is an offset into it. The gaps between chunks are never
    read: every index the kernels use comes from a chunk's own offsets. Falls back to one concatenated copy when an
    array is not aligned to its item size within the span.
    """
    dtype = arrays[0].dtype
    if len(arrays) == 1 or any(a.dtype != dtype for a in arrays):
        if len(arrays) == 1:
            view = arrays[0].view()
            first = np.zeros(1, np.int64)
        else:
            view = np.concatenate(arrays)
            first = np.concatenate(([0], np.cumsum([a.size for a in arrays[:-1]]))).astype(np.int64)
        view.flags.writeable = False
        return view, first
    item = dtype.itemsize
    addresses = [a.__array_interface__["data"][0] for a in arrays]
    low = min(addresses)
    high = max(addr + a.nbytes for addr, a in zip(addresses, arrays, strict=True))
    if any((addr - low) % item for addr in addresses) or any(not a.flags.c_contiguous for a in arrays):
        logger.debug("column chunks are not aligned to their item size: concatenating them")
        view = np.concatenate(arrays)
        view.flags.writeable = False
        first = np.concatenate(([0], np.cumsum([a.size for a in arrays[:-1]]))).astype(np.int64)
        return view, first
    view = np.asarray(_Span(low, (high - low) // item, dtype, tuple(arrays)))
    return view, np.array([(addr - low) // item for addr in addresses], np.int64)


def _arrow_source(column: Any, name: str, *, kind: str = "ids", mask: bool = False) -> _Source:
    """A :class:`_Source` over a pyarrow (chunked) list array: read and checked chunk by chunk by
    :func:`padfree.samples.read_arrow_chunks`, values never copied.

    A dataset on disk is a thousand chunks or more: each is read straight from its Arrow buffers (a few
    microseconds), and everything per row is then computed once over all chunks.
    """
    chunks = read_arrow_chunks(column, name, kind=kind, mask=mask)
    if not chunks:
        empty = np.zeros(0, np.int64)
        return _Source(name, empty, empty, empty, ())
    values = [c.values for c in chunks]
    view, first = _one_view(values)
    starts = np.concatenate([c.offsets[:-1] + base for c, base in zip(chunks, first.tolist(), strict=True)])
    lengths = np.concatenate([c.lengths for c in chunks])
    return _Source(name, view, starts, lengths, tuple(values))


def _buffer_source(tokens: Any, name: str, *, kind: str = "ids", mask: bool = False) -> _Source:
    """A :class:`_Source` over anything :func:`padfree.samples.read_tokens` reads (lists, arrays, pairs)."""
    if mask:  # a 0/1 mask may come as booleans, which token ids may not: one array per row (never per token)
        rows = [np.asarray(row) for row in tokens]
        if not all(r.ndim == 1 and r.dtype.kind in "biu" for r in rows):
            raise InvalidTokensError(f"{name} must hold one list of 0/1 integers or booleans per row")
        tokens = [r.astype(np.int8) for r in rows]
    buf = read_tokens(tokens, name, kind="labels" if mask else kind)
    view = buf.values.view()
    view.flags.writeable = False
    return _Source(name, view, buf.offsets[:-1], buf.lengths, (buf.values,))


def _any_source(column: Any, name: str, *, kind: str = "ids", mask: bool = False) -> _Source:
    if type(column).__module__.startswith("pyarrow"):
        return _arrow_source(column, name, kind=kind, mask=mask)
    return _buffer_source(column, name, kind=kind, mask=mask)


@dataclass(frozen=True, eq=False)
class _Data:
    """The token columns of the input, aligned row by row, and where the result may be cached."""

    ids: _Source
    labels: _Source | None
    masks: tuple[_Source, ...]
    indices: np.ndarray | None  # (rows,) int64: row i of the input is physical row indices[i]
    fingerprint: str | None
    cache_dir: str | None
    split: Any = None

    @property
    def num_rows(self) -> int:
        return int(self.ids.lengths.shape[0] if self.indices is None else self.indices.shape[0])

    def logical(self, physical: np.ndarray) -> np.ndarray:
        return physical if self.indices is None else physical[self.indices]


def _read(data: Any, labels: Any, label_masks: Sequence[str]) -> _Data:
    datasets, pa = _import_hf()
    if isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise InvalidArgumentError(
            f"data is a {type(data).__name__}; pack each split on its own, e.g. "
            "DatasetDict({name: pack_dataset(split, capacity) for name, split in data.items()})"
        )
    if isinstance(data, datasets.IterableDataset):
        raise InvalidArgumentError(
            "data is a streaming datasets.IterableDataset, which has no global plan; pack it online with "
            "padfree.StreamPacker, or load it as a map-style datasets.Dataset"
        )
    if isinstance(data, datasets.Dataset):
        table, names = data.data, data.column_names
        raw_indices = getattr(data, "_indices", None)
        indices = None
        if raw_indices is not None:
            indices = raw_indices.column(0).to_numpy().astype(np.int64)
        cache_dir = None
        if data.cache_files and datasets.is_caching_enabled():
            cache_dir = os.path.dirname(os.path.abspath(data.cache_files[0]["filename"]))
        return _table_data(table, names, indices, labels, label_masks, "data",
                           getattr(data, "_fingerprint", None), cache_dir, data.split)
    if isinstance(data, pa.Table):
        return _table_data(data, data.column_names, None, labels, label_masks, "data", None, None)
    if isinstance(data, Mapping):
        return _table_data(data, list(data), None, labels, label_masks, "data", None, None)
    ids = _any_source(data, "data")
    label_source = None if labels is None else _any_source(labels, "labels", kind="labels")
    return _Data(ids, label_source, (), None, None, None)


def _table_data(table: Any, names: list[str], indices: np.ndarray | None, labels: Any, label_masks: Sequence[str],
                what: str, fingerprint: str | None, cache_dir: str | None, split: Any = None) -> _Data:
    if "input_ids" not in names:
        raise DataLoadError(f"{what} has no 'input_ids' column (its columns: {', '.join(map(repr, names))}); "
                            "tokenize it first, e.g. with dataset.map(lambda row: tokenizer(row['text']))")
    if labels is not None:
        raise InvalidArgumentError(
            f"labels= is for token-id lists; {what} is a table, so add a 'labels' column to it instead"
        )

    def column(name: str) -> Any:
        return table[name] if isinstance(table, Mapping) else table.column(name)

    ids = _any_source(column("input_ids"), "input_ids")
    label_source = _any_source(column("labels"), "labels", kind="labels") if "labels" in names else None
    masks: tuple[_Source, ...] = ()
    if label_source is None:
        masks = tuple(_any_source(column(m), m, mask=True) for m in label_masks if m in names)
    return _Data(ids, label_source, masks, indices, fingerprint, cache_dir, split)


def _check(data: _Data) -> np.ndarray:
    """Validate the input rows; return their lengths ``(rows,) int64`` in input order."""
    lengths = data.logical(data.ids.lengths)
    name = data.ids.name
    refuse_empty(lengths, lambda i: f"{name}[{i}]")
    for other in ((data.labels,) if data.labels is not None else ()) + data.masks:
        if other.lengths.shape[0] != data.ids.lengths.shape[0]:
            raise InvalidTokensError(
                f"{other.name} has {other.lengths.shape[0]} rows but {name} has {data.ids.lengths.shape[0]}"
            )
        theirs = data.logical(other.lengths)
        if not np.array_equal(theirs, lengths):
            i = int(np.argmax(theirs != lengths))
            got = "null" if theirs[i] < 0 else f"{theirs[i]} entries"
            raise InvalidTokensError(f"{other.name}[{i}] has {got} but {name}[{i}] has {lengths[i]} tokens; "
                                     f"every {other.name} row must match its {name} row token for token")
    return lengths


# --------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    padding_value: int
    label_padding_value: int
    padding: str | int | None
    pad_to_multiple_of: int | None
    attention_mask: str | None
    columns: tuple[tuple[str, str], ...]  # (what, output name)
    label_masks: tuple[str, ...]
    chunk_tokens: int
    keep_in_memory: bool | None
    cache_file_name: str | None
    num_threads: int | None

    def wants(self, what: str) -> bool:
        return any(w == what for w, _ in self.columns)


def _options(padding_value: Any, label_padding_value: Any, padding: Any, pad_to_multiple_of: Any,
             attention_mask: Any, columns: Any, label_masks: Any, chunk_tokens: Any, keep_in_memory: Any,
             cache_file_name: Any, num_threads: Any) -> _Options:
    if padding is not None and not isinstance(padding, str):
        if isinstance(padding, bool) or not isinstance(padding, (int, np.integer)) or padding < 1:
            raise InvalidArgumentError(f"padding must be 'capacity', 'longest', None or an int >= 1, got "
                                       f"{describe(padding)}")
        padding = int(padding)
    elif isinstance(padding, str):
        padding = as_choice(padding, "padding", _PADDINGS)
    if attention_mask is not None:
        attention_mask = as_choice(attention_mask, "attention_mask", _MASKS)
    if columns is None:
        pairs = tuple((c, c) for c in DEFAULT_COLUMNS if c != "attention_mask" or attention_mask is not None)
    else:
        if isinstance(columns, str) or not isinstance(columns, Sequence | Mapping):
            raise InvalidArgumentError(f"columns must be a list of column names or a dict {{name: output name}}, "
                                       f"got {describe(columns)}")
        items = list(columns.items()) if isinstance(columns, Mapping) else [(c, c) for c in columns]
        for what, out in items:
            if what not in COLUMNS:
                raise InvalidArgumentError(f"columns names {what!r}, which pack_dataset does not write; choose "
                                           f"from {', '.join(map(repr, COLUMNS))}")
            if not isinstance(out, str) or not out:
                raise InvalidArgumentError(f"columns[{what!r}] must be a non-empty output column name, got "
                                           f"{describe(out)}")
        if not items:
            raise InvalidArgumentError("columns is empty; name at least one of " + ", ".join(map(repr, COLUMNS)))
        if len({w for w, _ in items}) != len(items) or len({o for _, o in items}) != len(items):
            raise InvalidArgumentError(f"columns names a column (or an output name) twice: {describe(columns)}")
        if attention_mask is None and any(w == "attention_mask" for w, _ in items):
            raise InvalidArgumentError("columns asks for 'attention_mask' but attention_mask=None; pass "
                                       "attention_mask='binary' or 'segments', or leave the column out")
        order = {c: i for i, c in enumerate(COLUMNS)}
        pairs = tuple(sorted(items, key=lambda item: order[item[0]]))
    if isinstance(label_masks, str) or not isinstance(label_masks, Sequence) or not all(
            isinstance(m, str) for m in label_masks):
        raise InvalidArgumentError(f"label_masks must be a sequence of column names, got {describe(label_masks)}")
    if chunk_tokens is not None:
        chunk_tokens = as_positive_int(chunk_tokens, "chunk_tokens")
    if keep_in_memory not in (None, True, False):
        raise InvalidArgumentError(f"keep_in_memory must be None, True or False, got {describe(keep_in_memory)}")
    if cache_file_name is not None:
        if not isinstance(cache_file_name, (str, os.PathLike)):
            raise InvalidArgumentError(f"cache_file_name must be a path or None, got {describe(cache_file_name)}")
        if keep_in_memory:
            raise InvalidArgumentError("keep_in_memory=True and a cache_file_name contradict each other; pass one")
        cache_file_name = os.fspath(cache_file_name)
    return _Options(
        padding_value=as_fill_value(padding_value, "padding_value", np.int32),
        label_padding_value=as_fill_value(label_padding_value, "label_padding_value", np.int32),
        padding=padding,
        pad_to_multiple_of=as_positive_int(pad_to_multiple_of, "pad_to_multiple_of", allow_none=True),
        attention_mask=attention_mask,
        columns=pairs,
        label_masks=tuple(label_masks),
        chunk_tokens=DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens,
        keep_in_memory=keep_in_memory,
        cache_file_name=cache_file_name,
        num_threads=as_positive_int(num_threads, "num_threads", allow_none=True),
    )


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def pack_dataset(
    data: Any,
    capacity: int,
    strategy: str = DEFAULT_STRATEGY,
    seed: int | None = None,
    padding_value: int = 0,
    label_padding_value: int = IGNORE_INDEX,
    *,
    overlong: str = "error",
    max_sequences_per_bin: int | None = None,
    padding: str | int | None = "capacity",
    pad_to_multiple_of: int | None = None,
    attention_mask: str | None = "binary",
    columns: Sequence[str] | Mapping[str, str] | None = None,
    labels: Any = None,
    label_masks: Sequence[str] = LABEL_MASK_COLUMNS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    keep_in_memory: bool | None = None,
    cache_file_name: str | os.PathLike[str] | None = None,
    num_threads: int | None = None,
    return_result: bool = False,
) -> Any:
    """Pack every sequence of ``data`` into rows of ``capacity`` tokens; return a ``datasets.Dataset`` of the rows.

    Args:
        data: a ``datasets.Dataset`` with an ``input_ids`` column (optional ``labels``, or ``completion_mask`` /
            ``assistant_masks``; an indices mapping is honoured), a ``pyarrow.Table`` or dict of such columns, a
            pyarrow list array, or ``num_sequences`` sequences of token ids.
        capacity: tokens per packed row, ``>= 1``.
        strategy, seed, overlong, max_sequences_per_bin: the packing, as in :func:`padfree.pack_sequences`
            (default ``obfd``: best fit decreasing over the whole dataset). ``overlong="error"`` refuses a sequence
            longer than ``capacity``; ``"truncate"``, ``"split"`` and ``"drop"`` are counted in the plan.
        padding_value: token id written into padding.
        label_padding_value: the ignored-label value written on the first token of every piece and on padding
            (and on tokens a ``completion_mask``/``assistant_masks`` excludes).
        padding: row length — ``"capacity"`` (every row ``capacity`` slots), ``"longest"`` (the longest row), an
            int (at least the longest row), or None (no padding: each row as long as its tokens, smallest on disk).
        pad_to_multiple_of: round every row length up to a multiple of this (with ``padding=None``: each row's own).
        attention_mask: ``"binary"`` (int8, 1 real / 0 padding), ``"segments"`` (int32, 1-based piece index, 0
            padding) or None (no such column). Note: an all-ones mask makes transformers ignore ``position_ids``
            boundaries; :mod:`padfree.layout` explains the spellings.
        columns: the columns to write, from :data:`COLUMNS`; or a dict ``{column: output name}`` to rename them.
            Default :data:`DEFAULT_COLUMNS` (without ``attention_mask`` when ``attention_mask=None``).
        labels: labels for token-id lists (same lengths as their sequences); tables carry a ``labels`` column.
        label_masks: 0/1 columns that, in a table without ``labels``, exclude tokens from the loss (TRL's names by
            default; ``()`` to ignore them).
        chunk_tokens: row slots built per chunk; bounds the working memory, never changes the result.
        keep_in_memory: True keeps the result in memory, False writes an Arrow file, None decides by size
            (:data:`IN_MEMORY_MAX_BYTES`).
        cache_file_name: where to write the Arrow file (implies ``keep_in_memory=False``).
        num_threads: threads that build rows (default: the CPU count, at most 8); one more writes the file.
        return_result: also return the plan: ``(dataset, PackResult)``. The plan's sequence ids are rows of
            ``data`` (after its indices mapping), bins are the rows of the dataset.

    Returns:
        A ``datasets.Dataset`` with one row per bin (see the module docstring for the columns), or
        ``(dataset, result)`` with ``return_result=True``.

    Raises:
        InvalidTokensError: non-integer token ids, a null row, a sequence with no tokens, or ``labels`` /
            mask rows whose lengths differ from their ``input_ids`` (the message names the first such row).
        OverlongSequenceError: a sequence longer than ``capacity`` under ``overlong="error"``.
        DataLoadError: a table without an ``input_ids`` column.
        InvalidArgumentError: an option out of range.

    >>> ds, plan = pack_dataset({"input_ids": [[1, 2], [3, 4, 5], [6]], "labels": [[-100, 2], [-100, 4, 5], [6]]},
    ...                         capacity=4, padding=None, return_result=True)
    >>> plan.bins, ds[:]["labels"]
    ([[1, 2], [0]], [[-100, 4, 5, -100], [-100, 2]])
    """
    capacity = as_capacity(capacity)
    as_choice(overlong, "overlong", OVERLONG_POLICIES)
    opts = _options(padding_value, label_padding_value, padding, pad_to_multiple_of, attention_mask, columns,
                    label_masks, chunk_tokens, keep_in_memory, cache_file_name, num_threads)
    source = _read(data, labels, opts.label_masks)
    lengths = _check(source)
    if overlong == "error" and lengths.size and lengths.max() > capacity:
        over = lengths > capacity
        i = int(np.argmax(over))
        raise OverlongSequenceError(
            f"{source.ids.name}[{i}] has {lengths[i]} tokens, more than capacity={capacity} ({int(over.sum())} of "
            f"{lengths.size} sequences are longer, the longest has {int(lengths.max())}); raise capacity or pass "
            "overlong='truncate', 'split' or 'drop'"
        )
    result = pack_sequences(lengths, capacity, strategy, seed, overlong=overlong,
                            max_sequences_per_bin=max_sequences_per_bin)
    dataset = _write(result, source, opts)
    return (dataset, result) if return_result else dataset


def pack_dataset_from_result(
    result: PackResult,
    data: Any,
    padding_value: int = 0,
    label_padding_value: int = IGNORE_INDEX,
    *,
    padding: str | int | None = "capacity",
    pad_to_multiple_of: int | None = None,
    attention_mask: str | None = "binary",
    columns: Sequence[str] | Mapping[str, str] | None = None,
    labels: Any = None,
    label_masks: Sequence[str] = LABEL_MASK_COLUMNS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    keep_in_memory: bool | None = None,
    cache_file_name: str | os.PathLike[str] | None = None,
    num_threads: int | None = None,
) -> Any:
    """Lay ``data`` out in the rows planned by ``result`` (a plan made over the lengths of ``data``).

    The arguments after ``data`` are those of :func:`pack_dataset`; ``padding="capacity"`` pads to the plan's
    capacity. Raises :class:`~padfree.errors.InvalidTokensError` when ``data`` does not have the plan's number of
    sequences or a sequence has another number of tokens than the plan says.

    >>> from padfree import pack_sequences
    >>> token_ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    >>> plan = pack_sequences([3, 2, 4], capacity=5, strategy="nf")
    >>> pack_dataset_from_result(plan, token_ids, padding=None)[:]["input_ids"]
    [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    """
    if not isinstance(result, PackResult):
        raise InvalidArgumentError(f"result must be a PackResult (from pack_sequences), got {describe(result)}")
    opts = _options(padding_value, label_padding_value, padding, pad_to_multiple_of, attention_mask, columns,
                    label_masks, chunk_tokens, keep_in_memory, cache_file_name, num_threads)
    source = _read(data, labels, opts.label_masks)
    name = source.ids.name
    if source.num_rows != result.num_sequences:
        raise InvalidTokensError(
            f"{name} has {source.num_rows} sequences but the plan was made for {result.num_sequences}"
        )
    lengths = _check(source)
    if not np.array_equal(lengths, result.lengths):
        i = int(np.argmax(lengths != result.lengths))
        raise InvalidTokensError(f"{name}[{i}] has {lengths[i]} tokens but the plan says lengths[{i}] = "
                                 f"{result.lengths[i]}; make the plan from these sequences' lengths")
    return _write(result, source, opts)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _row_widths(result: PackResult, opts: _Options) -> np.ndarray:
    """``(num_bins,) int64`` — the length of every output row."""
    fill = result.bin_fill
    longest = int(fill.max()) if fill.size else 0
    if opts.padding is None:
        widths = fill.copy()
    elif opts.padding == "capacity":
        widths = np.full(fill.shape, result.capacity, np.int64)
    elif opts.padding == "longest":
        widths = np.full(fill.shape, longest, np.int64)
    else:
        if opts.padding < longest:
            raise InvalidArgumentError(f"padding={opts.padding} is shorter than the longest row ({longest} tokens); "
                                       "pass an int >= it, 'longest', 'capacity' or None")
        widths = np.full(fill.shape, opts.padding, np.int64)
    multiple = opts.pad_to_multiple_of
    if multiple is not None:
        widths = -(-widths // multiple) * multiple
    return widths


def _chunks(row_offsets: np.ndarray, chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive bins ``[a, b)`` of at most ``chunk_tokens`` slots each (at least one bin per chunk).

    The first chunks are smaller (1/8 of ``chunk_tokens``, then twice the last): the disk starts writing as soon
    as the first one is built.
    """
    bounds, a, num_bins = [], 0, row_offsets.shape[0] - 1
    size = max(1, chunk_tokens // 8)
    while a < num_bins:
        b = int(np.searchsorted(row_offsets, row_offsets[a] + size, side="right")) - 1
        b = min(max(b, a + 1), num_bins)
        bounds.append((a, b))
        a = b
        size = min(chunk_tokens, 2 * size)
    return bounds


@dataclass(frozen=True)
class _Plan:
    """What the writer needs, decided once: output dtypes, row offsets, chunks, the Arrow schema."""

    ids_dtype: np.dtype
    labels_dtype: np.dtype
    mask_dtype: np.dtype
    row_offsets: np.ndarray  # (num_bins + 1,) int64 over all rows
    ramp: np.ndarray  # (longest row,) int32: 0, 1, 2, ...
    chunks: list[tuple[int, int]]
    max_slots: int
    schema: Any
    bytes_estimate: int
    max_batch_bytes: int  # an upper bound on one serialized chunk
    columns: tuple[str, ...]  # what each column of the schema holds (COLUMNS names)


def _plan(result: PackResult, source: _Data, opts: _Options) -> _Plan:
    _, pa = _import_hf()
    widths = _row_widths(result, opts)
    row_offsets = np.zeros(widths.shape[0] + 1, np.int64)
    np.cumsum(widths, out=row_offsets[1:])
    chunks = _chunks(row_offsets, opts.chunk_tokens)
    max_slots = max((int(row_offsets[b] - row_offsets[a]) for a, b in chunks), default=0)
    if max_slots >= _INT32.max:
        raise InvalidArgumentError(f"chunk_tokens={opts.chunk_tokens} makes chunks of {max_slots} slots; Arrow list "
                                   "offsets are int32, pass chunk_tokens < 2**31")
    ids32 = source.ids.fits_int32() and _INT32.min <= opts.padding_value <= _INT32.max
    ids_dtype = np.dtype(np.int32 if ids32 else np.int64)
    labels32 = ids32 if source.labels is None else source.labels.fits_int32()
    labels_dtype = np.dtype(np.int32 if labels32 else np.int64)
    mask_dtype = np.dtype(np.int8 if opts.attention_mask == "binary" else np.int32)
    types = {"input_ids": ids_dtype, "attention_mask": mask_dtype, "labels": labels_dtype,
             "position_ids": np.dtype(np.int32), "seq_lens": np.dtype(np.int32), "sequence_ids": np.dtype(np.int64)}
    schema = pa.schema([(out, pa.list_(pa.from_numpy_dtype(types[what]))) for what, out in opts.columns])
    slots = int(row_offsets[-1])
    per_slot = sum(types[w].itemsize for w, _ in opts.columns if w not in ("seq_lens", "sequence_ids"))
    per_piece = sum(types[w].itemsize for w, _ in opts.columns if w in ("seq_lens", "sequence_ids"))
    estimate = slots * per_slot + result.num_pieces * per_piece + 4 * len(opts.columns) * result.num_bins
    first, last = np.array(chunks, np.int64).reshape(-1, 2).T
    chunk_bytes = ((row_offsets[last] - row_offsets[first]) * per_slot
                   + (result.bin_offsets[last] - result.bin_offsets[first]) * per_piece
                   + (last - first + 1) * 4 * len(opts.columns))
    # + 64 bytes of alignment padding per Arrow buffer (two per column) + the flatbuffer metadata
    max_batch = int(chunk_bytes.max(initial=0)) + 128 * len(opts.columns) + (1 << 16)
    ramp = np.arange(int(widths.max()) if widths.size else 0, dtype=np.int32)
    return _Plan(ids_dtype, labels_dtype, mask_dtype, row_offsets, ramp, chunks, max_slots, schema, estimate,
                 max_batch, tuple(what for what, _ in opts.columns))


class _Buffers:
    """The flat output arrays of one chunk: views of the first ``slots`` entries of reusable allocations."""

    def __init__(self, plan: _Plan, opts: _Options, size: int) -> None:
        self.ids = np.empty(size, plan.ids_dtype) if opts.wants("input_ids") else None
        self.labels = np.empty(size, plan.labels_dtype) if opts.wants("labels") else None
        self.positions = np.empty(size, np.int32) if opts.wants("position_ids") else None
        self.mask = np.empty(size, plan.mask_dtype) if opts.wants("attention_mask") else None

    def window(self, slots: int) -> dict[str, np.ndarray]:
        arrays = {"input_ids": self.ids, "labels": self.labels, "position_ids": self.positions,
                  "attention_mask": self.mask}
        return {what: array[:slots] for what, array in arrays.items() if array is not None}


#: The columns with one value per row slot (the others have one per piece).
_TOKEN_COLUMNS = ("input_ids", "attention_mask", "labels", "position_ids")


class _Builder:
    """Lays out the rows of a range of bins; the rows of a chunk are split between ``threads`` threads.

    Each thread lays out its own rows with :func:`padfree.rows.fill_rows` (which releases the GIL): the gather from
    the input is bound by the latency of random reads (one per piece), which several threads overlap.
    """

    def __init__(self, result: PackResult, source: _Data, opts: _Options, plan: _Plan, pool: Any, threads: int):
        self.result, self.source, self.opts, self.plan, self.pool, self.threads = result, source, opts, plan, pool, \
            threads

    def counts(self, a: int, b: int) -> tuple[int, int, int]:
        """``(rows, slots, pieces)`` of bins ``[a, b)``."""
        pieces = int(self.result.bin_offsets[b] - self.result.bin_offsets[a])
        return b - a, int(self.plan.row_offsets[b] - self.plan.row_offsets[a]), pieces

    def fill(self, a: int, b: int, out: Mapping[str, np.ndarray]) -> None:
        """Lay out the rows of bins ``[a, b)`` into ``out``: ``{column: (slots,) array}`` for the per-token columns
        of the output (``input_ids``, ``labels``, ``position_ids``, ``attention_mask``; absent ones are not
        written)."""
        result, source, opts, plan = self.result, self.source, self.opts, self.plan
        p0, p1 = int(result.bin_offsets[a]), int(result.bin_offsets[b])
        seq = result.order[p0:p1]
        physical = seq if source.indices is None else source.indices[seq]
        piece_len = result.placed_lengths[p0:p1]
        piece_offsets = result.bin_offsets[a : b + 1] - p0
        row_offsets = plan.row_offsets[a : b + 1] - plan.row_offsets[a]
        slots = int(row_offsets[-1])
        skip = result.piece_starts[p0:p1] if result.piece_starts is not None else 0
        ids, labels = out.get("input_ids"), out.get("labels")
        positions, mask = out.get("position_ids"), out.get("attention_mask")
        ids_start = source.ids.starts[physical] + skip
        label_values = label_start = None
        if labels is not None and source.labels is not None:
            label_values, label_start = source.labels.values, source.labels.starts[physical] + skip
        mask_starts = [m.starts[physical] + skip for m in source.masks] if labels is not None else []

        def fill(x: int, y: int) -> None:  # rows [x, y) of the chunk
            pieces, rows = piece_offsets[x : y + 1], row_offsets[x : y + 1]
            fill_rows(source.ids.values, ids_start, label_values, label_start, piece_len, pieces, rows, plan.ramp,
                      ids, labels, positions, mask, opts.padding_value, opts.label_padding_value,
                      opts.attention_mask == "segments")
            for m, starts in zip(source.masks, mask_starts, strict=False):
                mask_labels(m.values, starts, piece_len, pieces, rows, labels, opts.label_padding_value)

        parts = self.threads if slots >= _MIN_SLOTS_PER_THREAD * self.threads else 1
        cuts = np.searchsorted(row_offsets, np.arange(1, parts) * (slots // parts))
        bounds = [0, *cuts.tolist(), b - a]
        jobs = [(x, y) for x, y in itertools.pairwise(bounds) if y > x]
        if len(jobs) == 1:
            fill(*jobs[0])
        else:
            for future in [self.pool.submit(fill, x, y) for x, y in jobs]:
                future.result()

    def offsets(self, a: int, b: int) -> dict[str, np.ndarray]:
        """The per-row and per-piece arrays of bins ``[a, b)``: ``tokens`` and ``pieces`` (``(rows + 1,)`` list
        offsets, int32), ``seq_lens`` (int32) and ``sequence_ids`` (int64), one per piece."""
        result = self.result
        p0, p1 = int(result.bin_offsets[a]), int(result.bin_offsets[b])
        return {
            "tokens": (self.plan.row_offsets[a : b + 1] - self.plan.row_offsets[a]).astype(np.int32),
            "pieces": (result.bin_offsets[a : b + 1] - p0).astype(np.int32),
            "seq_lens": result.placed_lengths[p0:p1].astype(np.int32),
            "sequence_ids": result.order[p0:p1].astype(np.int64, copy=False),
        }

    def batch(self, a: int, b: int, buffers: _Buffers) -> Any:
        """Build the rows of bins ``[a, b)`` in ``buffers`` and return them as an Arrow record batch (no copy)."""
        _, pa = _import_hf()
        flat = buffers.window(self.counts(a, b)[1])
        self.fill(a, b, flat)
        small = self.offsets(a, b)
        token_offsets, piece_offsets = pa.array(small["tokens"]), pa.array(small["pieces"])
        arrays = []
        for what, _ in self.opts.columns:
            if what in _TOKEN_COLUMNS:
                arrays.append(pa.ListArray.from_arrays(token_offsets, pa.array(flat[what])))
            else:
                arrays.append(pa.ListArray.from_arrays(piece_offsets, pa.array(small[what])))
        return pa.RecordBatch.from_arrays(arrays, schema=self.plan.schema)


def _fingerprint(result: PackResult, source: _Data, opts: _Options) -> str:
    """A content fingerprint when the input has one (datasets' own, plus the plan and the options), else random."""
    import xxhash
    from datasets.fingerprint import generate_random_fingerprint

    if source.fingerprint is None:
        return generate_random_fingerprint()
    h = xxhash.xxh64()
    content = (opts.padding_value, opts.label_padding_value, opts.padding, opts.pad_to_multiple_of,
               opts.attention_mask, opts.columns, opts.label_masks, result.capacity)  # not how it is written
    h.update(f"padfree.pack_dataset|{source.fingerprint}|{content!r}".encode())
    for array in (result.order, result.bin_offsets, result.piece_starts, result.piece_lengths):
        if array is not None:
            h.update(np.ascontiguousarray(array).data)
    return h.hexdigest()


def _write(result: PackResult, source: _Data, opts: _Options) -> Any:
    datasets, pa = _import_hf()
    from datasets.table import InMemoryTable

    plan = _plan(result, source, opts)
    fingerprint = _fingerprint(result, source, opts)
    in_memory = opts.keep_in_memory
    if in_memory is None:
        in_memory = opts.cache_file_name is None and plan.bytes_estimate <= IN_MEMORY_MAX_BYTES
    info = datasets.DatasetInfo()
    threads = opts.num_threads or min(os.cpu_count() or 1, _MAX_THREADS)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="padfree-rows") as pool:
        builder = _Builder(result, source, opts, plan, pool, threads)
        if in_memory:
            batches = [builder.batch(a, b, _Buffers(plan, opts, int(plan.row_offsets[b] - plan.row_offsets[a])))
                       for a, b in plan.chunks]
            table = pa.Table.from_batches(batches, schema=plan.schema)
            dataset = datasets.Dataset(InMemoryTable(table), info=info, split=source.split, fingerprint=fingerprint)
        else:
            path = opts.cache_file_name or os.path.join(
                source.cache_dir or datasets.fingerprint.get_temporary_cache_files_directory(),
                f"padfree-pack-{fingerprint}.arrow",
            )
            _write_file(path, builder)
            dataset = datasets.Dataset(_memory_mapped_table(path), info=info, split=source.split,
                                       fingerprint=fingerprint)
    logger.info("packed %d sequences into %d rows of %d (efficiency %.2f%%)%s", result.num_sequences,
                result.num_bins, result.capacity, 100 * result.efficiency, "" if in_memory else f" in {path}")
    return dataset


def _memory_mapped_table(path: str) -> Any:
    """``datasets``' ``MemoryMappedTable.from_file(path)``, minus pyarrow's read-ahead advice.

    ``pyarrow.memory_map`` advises the kernel to read every record batch it hands out (``MADV_WILLNEED``), so
    opening a file of gigabytes that is not in the page cache (ours never is, see :class:`_DirectStream`) reads
    most of it from disk. A plain ``mmap`` of the file, read through a ``BufferReader``, maps the same bytes
    without the advice; pages are read when rows are.
    """
    import mmap

    _, pa = _import_hf()
    from datasets.table import MemoryMappedTable

    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    table = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(mapped))).read_all()
    return MemoryMappedTable(table, path)


def _write_file(path: str, builder: _Builder) -> None:
    """Write every chunk to an Arrow stream file at ``path`` (atomically), overlapping writing with building.

    With ``O_DIRECT`` the rows are laid out straight into the buffers the disk reads (see
    :meth:`_DirectStream.write_rows`). Otherwise two sets of buffers alternate: while a thread writes chunk ``k``
    (pyarrow and ``os.write`` release the GIL), the kernels (``nogil``) build chunk ``k + 1`` in the other set; a
    set is reused only once its write is done.
    """
    plan = builder.plan
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with _open_stream(tmp, plan) as stream:
            if getattr(stream, "layout", None) is not None:
                for a, b in plan.chunks:  # built straight into the disk buffers: nothing to overlap but the disk
                    stream.write_rows(builder, a, b)
            else:
                _write_batches(stream, builder)
        _cache_message_headers(tmp, stream.messages)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_batches(stream: _DirectStream | _BufferedStream, builder: _Builder) -> None:
    """Build record batches and hand them to ``stream.write_batch``, building chunk ``k + 1`` while ``k`` is
    written."""
    plan, opts = builder.plan, builder.opts
    pending: list[Future | None] = [None, None]
    sets: list[_Buffers | None] = [None, None]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="padfree-write") as pool:
        for k, (a, b) in enumerate(plan.chunks):
            slot = k % 2
            if pending[slot] is not None:
                pending[slot].result()  # that set's write is done: its buffers are free again
            if sets[slot] is None:
                sets[slot] = _Buffers(plan, opts, plan.max_slots)
            batch = builder.batch(a, b, sets[slot])
            pending[slot] = pool.submit(stream.write_batch, batch)
            del batch
        for future in pending:
            if future is not None:
                future.result()


def _cache_message_headers(path: str, offsets: list[int]) -> None:
    """Read the first pages of every IPC message of ``path`` into the page cache, and nothing else.

    The file was written around the page cache. Opening it (``datasets`` reads every message's metadata through a
    memory map) would then fault on one page per message, and each fault reads ahead the device's whole window
    (often megabytes): hundreds of megabytes read to open a file. With ``POSIX_FADV_RANDOM`` these reads stay small.
    """
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # only a speed-up
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            starts = [offset - offset % _BLOCK for offset in offsets]
            for start in starts:  # all the reads queued at once (the device serves them together) ...
                os.posix_fadvise(fd, start, 2 * _BLOCK, os.POSIX_FADV_WILLNEED)
            for start in starts:  # ... then waited for: the message prefix and metadata (~1 kB)
                os.pread(fd, 2 * _BLOCK, start)
    finally:
        os.close(fd)


#: Write large outputs with ``O_DIRECT`` where the filesystem allows it (see :class:`_DirectStream`).
_DIRECT_IO = hasattr(os, "O_DIRECT")
_BLOCK = 1 << 12  # O_DIRECT alignment of memory, sizes and file offsets: a page, >= any logical block size
_WRITE_BYTES = 1 << 26  # bytes per disk write, at most


def _open_stream(path: str, plan: _Plan) -> _DirectStream | _BufferedStream:
    if _DIRECT_IO:
        try:
            return _DirectStream(path, plan)
        except OSError as exc:  # tmpfs, some network filesystems: no O_DIRECT
            logger.debug("O_DIRECT unavailable for %s (%s): writing through the page cache", path, exc)
    return _BufferedStream(path, plan)


class _DirectStream:
    """An Arrow IPC stream file written with ``O_DIRECT`` from two reused, page-aligned staging buffers.

    The output is written once and read later, so it has no business in the page cache: ``O_DIRECT`` moves it from
    a staging buffer to the disk by DMA. Through the page cache the kernel would copy it again, allocate a page per
    4 kB and write them back, which costs about as much CPU as building the rows (and, on virtual machines whose
    fresh memory is slow to fault in, several times that). The file holds exactly the bytes pyarrow's stream writer
    would write: the schema message, one message per batch, the end-of-stream marker.

    Each record batch goes into the current staging buffer right after the bytes still pending there (less than
    one block): :meth:`write_rows` lays its rows out right there, inside the message (see :class:`_MessageLayout`),
    so that no byte of the output is copied after the gather. Once enough bytes have accumulated, their whole
    blocks go to disk on a thread of their own (``pwrite`` at their offset, so that the other buffer's write may
    still be in flight) while the remainder moves to the front of the other buffer, where the next batch goes:
    building overlaps with the disk. (Where the message layout cannot be trusted,
    :meth:`write_batch` has pyarrow serialize a batch built elsewhere into the same spot instead; a fresh stream
    writer there puts its schema message before the batch, so the few bytes it covers are saved and put back.)
    """

    def __init__(self, path: str, plan: _Plan) -> None:
        import mmap

        self.schema = plan.schema
        self.header = plan.schema.serialize().to_pybytes()
        self.margin = -(-len(self.header) // _BLOCK) * _BLOCK
        # disks write large requests much faster (virtio: 1.7 GB/s at 16 MB, ~3 GB/s at 64-128 MB): batches
        # accumulate up to this many bytes before they go; 1/32 of the output at most, so small outputs stay small
        self.largest = max(_BLOCK, min(_WRITE_BYTES, plan.bytes_estimate // 32))
        # ... but the disk idles until the first write: the first ones are small, then each is twice the last
        self.threshold = max(_BLOCK, self.largest // 16)
        size = -(-(self.margin + self.largest + plan.max_batch_bytes + 64) // _BLOCK) * _BLOCK
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            self.stages = [mmap.mmap(-1, size), mmap.mmap(-1, size)]  # anonymous memory: page-aligned
            self.views = [memoryview(m) for m in self.stages]
            os.write(self.fd, self.views[0][:_BLOCK])  # EINVAL here if the filesystem refuses O_DIRECT
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)
        except OSError:
            os.close(self.fd)
            raise
        self.arrays = [np.frombuffer(m, np.uint8) for m in self.stages]
        self.layout = _MessageLayout.of(plan.schema, self.header, plan.columns)
        # two writes in flight (one per buffer): the device queue does not drain between them (~+20% here)
        self.disk = ThreadPoolExecutor(max_workers=2, thread_name_prefix="padfree-disk")
        self.shipped = 0  # bytes of the stream handed to the disk
        self.busy: list[Future | None] = [None, None]  # the disk write still reading each buffer
        self.current = 0
        self.pending = 0  # bytes at views[current][margin:margin + pending] not yet on disk
        self.size = 0  # bytes of the stream so far
        self.messages = [0]  # where each message starts in the file
        self._append(self.header)

    def _append(self, data: bytes) -> None:
        at = self.margin + self.pending
        self.views[self.current][at : at + len(data)] = data
        self.pending += len(data)
        self.size += len(data)

    def write_rows(self, builder: _Builder, a: int, b: int) -> None:
        """Lay out the rows of bins ``[a, b)`` as one record batch message, in place in the staging buffer."""
        layout = self.layout
        rows, slots, pieces = builder.counts(a, b)
        head, buffers, body = layout.message(rows, [slots if what in _TOKEN_COLUMNS else pieces
                                                    for what in layout.columns])
        at = self.margin + self.pending
        stage = self.arrays[self.current]
        if at + len(head) + body > stage.shape[0]:  # pragma: no cover - max_batch_bytes bounds every message
            raise AssertionError(f"a record batch of {len(head) + body} bytes overflows the staging buffer")
        stage[at : at + len(head)] = np.frombuffer(head, np.uint8)
        base = at + len(head)
        small = builder.offsets(a, b)
        out = {}
        for k, what in enumerate(layout.columns):
            per_token = what in _TOKEN_COLUMNS
            (offsets_at, offsets_len), (values_at, values_len) = buffers[4 * k + 1], buffers[4 * k + 3]
            stage[base + offsets_at : base + offsets_at + offsets_len].view(np.int32)[:] = small[
                "tokens" if per_token else "pieces"]
            values = stage[base + values_at : base + values_at + values_len].view(layout.dtypes[k])
            if per_token:
                out[what] = values
            else:
                values[:] = small[what]
            for start, length in (buffers[4 * k + 1], buffers[4 * k + 3]):  # the zero padding after each buffer
                stage[base + start + length : base + start + _padded(length)] = 0
        builder.fill(a, b, out)
        del out, stage
        self.messages.append(self.size)
        self.pending += len(head) + body
        self.size += len(head) + body
        if self.pending >= self.threshold:
            self._ship()

    def write_batch(self, batch: Any) -> None:
        _, pa = _import_hf()
        view = self.views[self.current]
        at = self.margin + self.pending - len(self.header)  # where this writer's schema message goes
        covered = bytes(view[at : self.margin + self.pending])
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(view[at:]))
        with pa.ipc.new_stream(sink, self.schema) as writer:
            writer.write_batch(batch)
            length = sink.tell() - len(self.header)  # the batch message; closing adds an end marker after it
        del sink
        view[at : at + len(covered)] = covered
        self.messages.append(self.size)
        self.pending += length
        self.size += length
        if self.pending >= self.threshold:
            self._ship()

    def _ship(self, final: bool = False) -> None:
        """Send the whole blocks of the current buffer to disk; carry the rest over to the other buffer."""
        view, margin = self.views[self.current], self.margin
        whole = self.pending - self.pending % _BLOCK
        rest = self.pending - whole
        if final and rest:
            view[margin + self.pending : margin + whole + _BLOCK] = bytes(_BLOCK - rest)  # zeros, truncated later
            whole, rest = whole + _BLOCK, 0
        other = 1 - self.current
        if whole:  # submitted before waiting for the other buffer: the disk gets the next request while busy
            self.busy[self.current] = self.disk.submit(self._write, view, margin, margin + whole, self.shipped)
            self.shipped += whole
            self.threshold = min(self.largest, 2 * self.threshold)
        if self.busy[other] is not None:
            self.busy[other].result()  # the other buffer's last disk write is done: it may be overwritten
            self.busy[other] = None
        if rest:  # bytes past the blocks under DMA: copied while the disk reads the blocks before them
            self.views[other][margin : margin + rest] = view[margin + whole : margin + whole + rest]
        self.current, self.pending = other, rest

    def _write(self, view: memoryview, start: int, end: int, offset: int) -> None:
        while start < end:
            done = os.pwrite(self.fd, view[start:end], offset)
            start, offset = start + done, offset + done

    def close(self, complete: bool = True) -> None:
        """Finish the file (``complete``), or just stop (after an error: the caller deletes the file)."""
        if self.fd < 0:
            return
        try:
            if complete:
                self._append(b"\xff\xff\xff\xff\x00\x00\x00\x00")  # end of stream
                self._ship(final=True)
                for future in self.busy:
                    if future is not None:
                        future.result()
                os.ftruncate(self.fd, self.size)  # drop the zero padding of the last block
        finally:
            self.disk.shutdown(wait=True)  # no DMA may still read the buffers released below
            os.close(self.fd)
            self.fd = -1
            self.arrays = []
            for view, stage in zip(self.views, self.stages, strict=True):
                view.release()
                # after an error, the traceback's frames may still hold views of a buffer: it is unmapped with them
                with contextlib.suppress(BufferError):
                    stage.close()

    def __enter__(self) -> _DirectStream:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(complete=kind is None)


_ALIGNMENT = 8  # Arrow IPC pads every buffer of a message body to a multiple of this


def _padded(length: int) -> int:
    return -(-length // _ALIGNMENT) * _ALIGNMENT


def _flat_field(meta: bytes, table: int, index: int) -> int | None:
    """Where field ``index`` of the flatbuffer table at ``table`` lies in ``meta``; None when it is absent."""
    vtable = table - int.from_bytes(meta[table : table + 4], "little", signed=True)
    if 4 + 2 * index + 2 > int.from_bytes(meta[vtable : vtable + 2], "little"):
        return None
    offset = int.from_bytes(meta[vtable + 4 + 2 * index : vtable + 6 + 2 * index], "little")
    return table + offset if offset else None


def _flat_target(meta: bytes, at: int) -> int:
    """The table or vector an offset field at ``at`` points to."""
    return at + int.from_bytes(meta[at : at + 4], "little")


class _MessageLayout:
    """Arrow IPC record batch messages of one schema of list columns without nulls, for any sizes, without pyarrow.

    A message is an 8-byte prefix, a flatbuffer of metadata (``Message`` holding a ``RecordBatch``: its row count,
    one ``FieldNode`` per array and one ``Buffer`` (offset, length) per buffer, and the body length), then the body:
    the buffers of every column back to back — list validity (empty), list offsets (int32), values validity
    (empty), values — each padded to 8 bytes with zeros. Only numbers change from one batch to the next, in
    fields a flatbuffer stores at fixed places; so one message that pyarrow serializes is a template, patched for
    other sizes, and :meth:`_DirectStream.write_rows` lays the rows out right where the body will hold them.

    :meth:`of` checks the result against pyarrow on a second batch, byte for byte (and returns None, so that the
    writer lets pyarrow serialize, should a future pyarrow write messages another way).
    """

    def __init__(self, schema: Any, prefix: bytes, meta: bytes, patch: dict[str, Any]) -> None:
        self.columns = [f.name for f in schema]  # renamed below to what each column holds
        self.dtypes = [np.dtype(f.type.value_type.to_pandas_dtype()) for f in schema]
        self.prefix, self.meta, self.patch = prefix, meta, patch

    @classmethod
    def of(cls, schema: Any, header: bytes, columns: Sequence[str] | None = None) -> _MessageLayout | None:
        """The layout of ``schema`` (whose stream header is ``header``); ``columns`` names what each column holds
        (default: the schema's names). None when the template cannot be read or does not reproduce pyarrow."""
        _, pa = _import_hf()
        if not all(pa.types.is_list(f.type) for f in schema):
            return None

        def message(batch: Any) -> bytes:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, schema) as writer:
                writer.write_batch(batch)
            data = sink.getvalue().to_pybytes()
            return data[len(header) : -8]  # neither the schema message nor the end-of-stream marker

        def batch(offsets: list[int]) -> Any:
            arrays = [pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                               pa.array(np.arange(offsets[-1]) % 100 + 1, f.type.value_type))
                      for f in schema]
            return pa.RecordBatch.from_arrays(arrays, schema=schema)

        try:
            template = message(batch([0, 1]))  # every number nonzero: no field left out as a default
            if template[:4] != b"\xff\xff\xff\xff":
                return None
            size = int.from_bytes(template[4:8], "little")
            meta = template[8 : 8 + size]
            root = int.from_bytes(meta[0:4], "little")
            kind, body, header_at = (_flat_field(meta, root, i) for i in (1, 3, 2))
            if kind is None or meta[kind] != 3 or body is None or header_at is None:  # 3: RecordBatch
                return None
            record = _flat_target(meta, header_at)
            rows, nodes, buffers = (_flat_field(meta, record, i) for i in (0, 1, 2))
            if rows is None or nodes is None or buffers is None or any(
                    _flat_field(meta, record, i) is not None for i in (3, 4)):  # compression, variadic counts
                return None
            nodes, buffers = _flat_target(meta, nodes), _flat_target(meta, buffers)
            n = len(schema)
            if (int.from_bytes(meta[nodes : nodes + 4], "little") != 2 * n
                    or int.from_bytes(meta[buffers : buffers + 4], "little") != 4 * n):
                return None
            layout = cls(schema, template[:8], meta, {"rows": rows, "body": body, "nodes": nodes + 4,
                                                      "buffers": buffers + 4})
            check = [0, 3, 3, 8]  # 3 rows, 8 values: a padded tail in every buffer of every type
            head, spans, body_len = layout.message(3, [8] * n)
            out = bytearray(len(head) + body_len)
            out[: len(head)] = head
            for k, array in enumerate(batch(check).columns):
                for (start, length), buf in zip(spans[4 * k : 4 * k + 4], array.buffers(), strict=True):
                    if length:
                        out[len(head) + start : len(head) + start + length] = buf.to_pybytes()[:length]
            if bytes(out) != message(batch(check)):
                return None
        except (ValueError, IndexError, TypeError):  # pragma: no cover - an unreadable template
            return None
        if columns is not None:
            layout.columns = list(columns)
        return layout

    def message(self, rows: int, values: Sequence[int]) -> tuple[bytes, list[tuple[int, int]], int]:
        """The prefix and metadata of a batch of ``rows`` rows with ``values[k]`` values in column ``k``; the
        ``(offset, length)`` of every buffer in the body; the body length."""
        spans, at = [], 0
        for count, dtype in zip(values, self.dtypes, strict=True):
            for length in (0, 4 * (rows + 1), 0, count * dtype.itemsize):
                spans.append((at, length))
                at += _padded(length)
        meta = bytearray(self.meta)
        patch = self.patch
        meta[patch["rows"] : patch["rows"] + 8] = rows.to_bytes(8, "little")
        meta[patch["body"] : patch["body"] + 8] = at.to_bytes(8, "little")
        for k, count in enumerate(values):
            for j, length in enumerate((rows, count)):  # (length, null_count = 0) per array
                node = patch["nodes"] + 16 * (2 * k + j)
                meta[node : node + 16] = length.to_bytes(8, "little") + bytes(8)
        for j, (start, length) in enumerate(spans):
            buffer = patch["buffers"] + 16 * j
            meta[buffer : buffer + 16] = start.to_bytes(8, "little") + length.to_bytes(8, "little")
        return self.prefix + bytes(meta), spans, at


class _BufferedStream:
    """The same stream through the page cache, for filesystems without ``O_DIRECT``.

    After each batch, ``POSIX_FADV_DONTNEED`` on its bytes starts their write-back, and on the bytes of two batches
    ago (written back by then) drops them from the page cache: the cache holds a few chunks of the file, not all
    of it, and the kernel never throttles the writer for too many dirty pages.
    """

    def __init__(self, path: str, plan: _Plan) -> None:
        _, pa = _import_hf()
        self.sink = pa.OSFile(path, "wb")
        self.writer = pa.ipc.new_stream(self.sink, plan.schema)
        self.writer_header = plan.schema.serialize().size  # written with the first batch
        self.fd = self.sink.fileno() if hasattr(os, "posix_fadvise") else None
        self.marks = [0]
        self.messages = [0]

    def write_batch(self, batch: Any) -> None:
        self.messages.append(self.sink.tell() + (len(self.marks) == 1) * self.writer_header)
        self.writer.write_batch(batch)
        self._drop(self.sink.tell())

    def _drop(self, end: int) -> None:
        if self.fd is None:
            return
        start = self.marks[-1]
        self.marks.append(end)
        try:
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
            if len(self.marks) > 3:
                old, old_end = self.marks[-4], self.marks[-3]
                os.posix_fadvise(self.fd, old, old_end - old, os.POSIX_FADV_DONTNEED)
        except OSError:  # pragma: no cover - no fadvise here: keep the pages, lose nothing else
            self.fd = None

    def close(self, complete: bool = True) -> None:
        try:
            if complete:
                self.writer.close()
                if self.fd is not None:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            self.sink.close()

    def __enter__(self) -> _BufferedStream:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(complete=kind is None)
