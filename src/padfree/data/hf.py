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
    list array, or a list of token-id lists (with ``labels=`` for their labels).

Other columns
    Every other *per-token* column — a list column whose every row is as long as its ``input_ids`` row, such as
    ``token_type_ids``, or ``completion_mask`` / ``assistant_masks`` (which also build the labels, see above) — is
    carried into the packed rows by default, as TRL's ``pack_dataset`` packs every list column: laid out exactly
    like ``input_ids`` (the same pieces in the same order, the same truncation and splitting), ``0`` on padding,
    ``list<int32>`` (int64 when a value does not fit), after the columns of ``columns``, under its own name. A
    per-token column that cannot be carried (floats, strings, nested lists) is refused, naming it and ``carry=``,
    rather than dropped; ``carry=`` chooses instead (``[]``: none). Columns that are not per-token (text, scalars,
    lists of another length such as ``messages``) are not carried: a packed row mixes several input rows.

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
    result to keep it). The file is written by pyarrow's stream writer while the next chunk is built, atomically
    (a failed call leaves no file; a killed process leaves ``.<name>.padfree-<pid>-<random>.tmp``, which the next
    call writing into that directory removes once that process is gone; a full disk is an ``OSError`` naming the
    file), and its pages leave the page cache behind the writer (the output is written once and read later). Peak
    memory grows by the input pages the gather reads (1x the token bytes at most) plus a working set that does not
    grow with the data — two chunks of rows, ~0.1 GB with the defaults — never by the size of the output.

The plan
    :func:`plan_dataset` returns the :class:`~padfree.PackResult` that :func:`pack_dataset` lays out (sequence ids are
    rows of ``data``, bins are the packed rows), for metrics (``plan.efficiency``), for
    :func:`pack_dataset_from_result` on one column set or several, or to keep with the dataset. Nothing is stored in
    the dataset's ``info``: the plan is arrays, and the ``sequence_ids`` column carries it row by row when asked for.

Differences from SeqPacker's ``hf_utils.pack_dataset`` (same name, arguments and columns) and TRL's
``pack_dataset``: nothing is dropped or cut silently (an empty sequence, a sequence longer than ``capacity`` under
``overlong="error"``, a label column that does not match its ``input_ids`` are errors naming the row); the padding
tail's ``position_ids`` count 0, 1, ... instead of continuing or repeating, so position-based packing detection
never glues padding to the last sequence; ``seq_lens`` gives the boundaries back (TRL calls it ``seq_lengths``:
pass ``columns={"input_ids": "input_ids", "seq_lens": "seq_lengths"}`` for TRL's padding-free collator).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from padfree.data._stream import pack_stream
from padfree.errors import (
    BackendUnavailableError,
    DataLoadError,
    InvalidArgumentError,
    InvalidSampleError,
    InvalidTokensError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.packing import DEFAULT_STRATEGY, PackResult, pack_sequences
from padfree.packing.inputs import as_positive_int, refuse_overlong
from padfree.packing.result import as_pack_result
from padfree.packing.spec import PackingSpec
from padfree.rows import RowSpec
from padfree.samples import read_arrow_chunks, read_tokens, refuse_empty

__all__ = [
    "COLUMNS",
    "DEFAULT_COLUMNS",
    "LABEL_MASK_COLUMNS",
    "NOT_CARRIED",
    "pack_dataset",
    "pack_dataset_from_result",
    "plan_dataset",
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

_INT32 = np.iinfo(np.int32)


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

    ``values`` is one read-only array over every chunk of the column (see :func:`one_view`), so a kernel reads any
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


def one_view(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
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
    nulls: list[np.ndarray] = []  # refused by _check only where the rows are selected (an indices mapping)
    chunks = read_arrow_chunks(column, name, kind=kind, mask=mask, nulls=nulls)
    if not chunks:
        empty = np.zeros(0, np.int64)
        return _Source(name, empty, empty, empty, ())
    values = [c.values for c in chunks]
    view, first = one_view(values)
    starts = np.concatenate([c.offsets[:-1] + base for c, base in zip(chunks, first.tolist(), strict=True)])
    lengths = np.concatenate([c.lengths for c in chunks])
    if nulls:
        lengths[np.concatenate(nulls)] = -1
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
    format: dict[str, Any] | None = None  # a datasets.Dataset's format (type, kwargs), given to the packed rows
    carried: tuple[tuple[str, _Source], ...] = ()  # other per-token columns, packed in parallel with input_ids

    @property
    def num_rows(self) -> int:
        return int(self.ids.lengths.shape[0] if self.indices is None else self.indices.shape[0])

    def logical(self, physical: np.ndarray) -> np.ndarray:
        return physical if self.indices is None else physical[self.indices]


def _read(data: Any, labels: Any, label_masks: Sequence[str], carry: Any = None) -> _Data:
    datasets, pa = _import_hf()
    if isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise InvalidArgumentError(
            f"data is a {type(data).__name__}; pack each split on its own, e.g. "
            "DatasetDict({name: pack_dataset(split, capacity) for name, split in data.items()})"
        )
    if isinstance(data, datasets.IterableDataset):
        raise InvalidArgumentError(
            "data is a streaming datasets.IterableDataset, which has no global plan to lay out: pack_dataset packs "
            "it online, pack_dataset_from_result needs a map-style datasets.Dataset"
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
        source = _table_data(table, names, indices, labels, label_masks, "data",
                             getattr(data, "_fingerprint", None), cache_dir, data.split, carry)
        return replace(source, format=dict(data.format))
    if isinstance(data, pa.Table):
        return _table_data(data, data.column_names, None, labels, label_masks, "data", None, None, None, carry)
    if isinstance(data, Mapping):
        return _table_data(data, list(data), None, labels, label_masks, "data", None, None, None, carry)
    if carry is not None and not _carries_none(carry):
        raise InvalidArgumentError("carry= names columns of a table; data is a list of sequences, which has none")
    ids = _any_source(data, "data")
    label_source = None if labels is None else _any_source(labels, "labels", kind="labels")
    return _Data(ids, label_source, (), None, None, None)


def _table_data(table: Any, names: list[str], indices: np.ndarray | None, labels: Any, label_masks: Sequence[str],
                what: str, fingerprint: str | None, cache_dir: str | None, split: Any = None,
                carry: Any = None) -> _Data:
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
    if carry is None:
        carried = _per_token_columns(table, names, column, ids, indices)
    else:
        carried = tuple((name, _carried_source(column(name), name)) for name in _carried_names(carry, table, names))
    return _Data(ids, label_source, masks, indices, fingerprint, cache_dir, split, carried=carried)


#: What pack_dataset reads or writes itself: never carried as an input column (an input ``attention_mask`` or
#: ``position_ids`` is replaced by the packed rows' own).
NOT_CARRIED = frozenset({*COLUMNS, "seq_lengths"})


def _per_token_columns(table: Any, names: list[str], column: Any, ids: _Source,
                       indices: np.ndarray | None) -> tuple[tuple[str, _Source], ...]:
    """``carry=None``: every per-token column of the table — a list column whose every row (null rows aside) is as
    long as its ``input_ids`` row, other than :data:`NOT_CARRIED` — read for carrying; refuse one that cannot be.

    Rows are compared through the indices mapping (the rows that will be packed). A list column of another length
    (messages, a list of tags) and a non-list column (text, scalars) is not per-token and is left out, as before.
    A per-token column of floats, strings or nested lists cannot be laid out as an integer list column: refused,
    naming the column and ``carry=``, rather than dropped without a word.
    """
    want = ids.lengths if indices is None else ids.lengths[indices]
    carried = []
    for name in names:
        if name in NOT_CARRIED:
            continue
        values = column(name)
        lengths = _row_lengths(values, len(ids.lengths))
        if lengths is None:
            continue
        theirs = lengths if indices is None else lengths[indices]
        present = theirs >= 0
        if not present.any() or not np.array_equal(theirs[present], want[present]):
            continue
        try:
            carried.append((name, _carried_source(values, name)))
        except (InvalidTokensError, InvalidSampleError) as exc:
            raise InvalidArgumentError(
                f"column {name!r} holds one value per token (each row as long as its input_ids row), so "
                f"pack_dataset would carry it into the packed rows, but it cannot: {exc}. Pass carry= naming the "
                f"columns to carry without it (carry=[] carries none), or remove it first "
                f"(dataset.remove_columns([{name!r}]))"
            ) from exc
    return tuple(carried)


def _row_lengths(values: Any, rows: int) -> np.ndarray | None:
    """``(rows,) int64``: the length of every row of a list column (-1 for a null row), or None when ``values`` is
    not a list column of ``rows`` rows. One vectorized call for Arrow; one ``len`` per row (never per token) else."""
    if type(values).__module__.startswith("pyarrow"):
        import pyarrow as pa
        import pyarrow.compute as pc

        kind = values.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
            return None
        if len(values) != rows:
            return None
        return pc.fill_null(pc.list_value_length(values), -1).to_numpy(zero_copy_only=False).astype(np.int64)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence | np.ndarray) or len(values) != rows:
        return None
    lengths = np.empty(rows, np.int64)
    for i, row in enumerate(values):
        if row is None:
            lengths[i] = -1
        elif isinstance(row, (str, bytes, Mapping)) or not hasattr(row, "__len__"):
            return None
        else:
            lengths[i] = len(row)
    return lengths


def _carried_source(values: Any, name: str) -> _Source:
    """A carried column, read without value checks (its values are copied, never interpreted): integers as they
    are, booleans as 0/1."""
    if type(values).__module__.startswith("pyarrow"):
        import pyarrow as pa

        inner = values.type.value_type
        if not (pa.types.is_integer(inner) or pa.types.is_boolean(inner)):
            raise InvalidTokensError(f"{name} holds {inner} values, and only integers or booleans can be carried")
        return _arrow_source(values, name, mask=True)  # mask=True: integers or booleans, no value checks
    rows, lengths = [], np.empty(len(values), np.int64)
    for i, row in enumerate(values):  # one array per row, never a Python loop per token
        array = np.zeros(0, np.int64) if row is None else np.asarray(row)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "biu") or (
                array.size and array.dtype.kind == "u" and array.max() > np.iinfo(np.int64).max):
            raise InvalidTokensError(f"{name}[{i}] is {describe(row)}, and only lists of integers (int64) or "
                                     f"booleans can be carried")
        lengths[i] = -1 if row is None else array.size
        rows.append(array.astype(np.int64))
    flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    starts = np.concatenate(([0], np.cumsum(np.maximum(lengths, 0))[:-1])).astype(np.int64)
    flat.flags.writeable = False
    return _Source(name, flat, starts, lengths, (flat,))


def _carried_names(carry: Any, table: Any, names: list[str]) -> list[str]:
    """The input columns ``carry`` names (``"all"``: every list column of integers or booleans of the table that
    pack_dataset does not read or write itself)."""
    if carry is None:
        return []
    if carry == "all":
        if isinstance(table, Mapping):
            raise InvalidArgumentError("carry='all' needs a typed table (a datasets.Dataset or pyarrow.Table); "
                                       "name the columns to carry instead")
        import pyarrow as pa

        def per_token(kind: Any) -> bool:
            listed = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
            return listed and (pa.types.is_integer(kind.value_type) or pa.types.is_boolean(kind.value_type))

        return [n for n in names if n not in NOT_CARRIED and per_token(table.schema.field(n).type)]
    if isinstance(carry, str) or not isinstance(carry, Sequence) or not all(isinstance(c, str) for c in carry):
        raise InvalidArgumentError(f"carry must be 'all', None or a list of column names, got {describe(carry)}")
    for name in carry:
        if name in NOT_CARRIED:
            raise InvalidArgumentError(f"carry names {name!r}, which pack_dataset reads or writes itself; carry "
                                       f"other per-token columns (e.g. 'completion_mask', 'token_type_ids')")
        if name not in names:
            raise DataLoadError(f"carry names {name!r}, which data does not have (its columns: "
                                f"{', '.join(map(repr, names))})")
    return list(dict.fromkeys(carry))


def _is_bool_list(column: Any) -> bool:
    kind = getattr(column, "type", None)
    return kind is not None and getattr(kind, "value_type", None) is not None and str(kind.value_type) == "bool"


def _check(data: _Data) -> np.ndarray:
    """Validate the input rows; return their lengths ``(rows,) int64`` in input order."""
    lengths = data.logical(data.ids.lengths)
    name = data.ids.name
    if lengths.size and lengths.min() < 0:
        i = int(np.argmax(lengths < 0))
        raise InvalidSampleError(f"{name}[{i}] is null ({int((lengths < 0).sum())} of {lengths.size} rows are); every "
                                 f"row needs a list of token ids")
    refuse_empty(lengths, lambda i: f"{name}[{i}]")
    for other in ((data.labels,) if data.labels is not None else ()) + data.masks + tuple(c for _, c in data.carried):
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


def _options(rows: RowSpec, columns: Any, label_masks: Any, chunk_tokens: Any, keep_in_memory: Any,
             cache_file_name: Any, num_threads: Any) -> _Options:
    attention_mask = rows.attention_mask
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
        padding_value=rows.padding_value,  # int32, as the columns (RowSpec checks it)
        label_padding_value=rows.label_padding_value,
        padding=rows.padding,
        pad_to_multiple_of=rows.pad_to_multiple_of,
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
    data: Any = None,
    capacity: int | None = None,
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
    spec: PackingSpec | None = None,
    rows: RowSpec | None = None,
    columns: Sequence[str] | Mapping[str, str] | None = None,
    labels: Any = None,
    label_masks: Sequence[str] = LABEL_MASK_COLUMNS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    keep_in_memory: bool | None = None,
    cache_file_name: str | os.PathLike[str] | None = None,
    num_threads: int | None = None,
    token_ids: Any = None,
    buffer_size: int = 10_000,
    carry: Sequence[str] | str | None = None,
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
            ``strategy="wrapped"`` (TRL's name) keeps the input order and cuts the stream into full rows; each piece
            of a cut sequence is a sequence of its own (:func:`padfree.packing.wrapped.wrap_sequences`), so nothing
            is attended or predicted across a cut.
        padding_value: token id written into padding.
        label_padding_value: the ignored-label value written on the first token of every piece and on padding
            (and on tokens a ``completion_mask``/``assistant_masks`` excludes).
        padding: row length — ``"capacity"`` (every row ``capacity`` slots), ``"longest"`` (the longest row), an
            int (at least the longest row), or None (no padding: each row as long as its tokens, smallest on disk).
        pad_to_multiple_of: round every row length up to a multiple of this (with ``padding=None``: each row's own).
        attention_mask: ``"binary"`` (int8, 1 real / 0 padding), ``"segments"`` (int32, 1-based piece index, 0
            padding) or None (no such column). Note: an all-ones mask makes transformers ignore ``position_ids``
            boundaries; :mod:`padfree.layout` explains the spellings.
        spec: ``capacity``, ``strategy``, ``seed``, ``overlong`` and ``max_sequences_per_bin`` as one
            :class:`~padfree.PackingSpec`, in place of those keywords (a keyword given too is refused, naming both).
        rows: ``padding_value``, ``label_padding_value``, ``padding``, ``pad_to_multiple_of`` and
            ``attention_mask`` as one :class:`~padfree.RowSpec`, in place of those keywords.
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
        token_ids: SeqPacker's name for ``data`` (``pack_dataset(token_ids=..., capacity=...)`` as its documents
            write it); give one of the two.
        carry: other per-token columns of ``data`` to pack in parallel with ``input_ids`` (each row of them must have
            its ``input_ids`` row's length; padding writes 0), as TRL's ``pack_dataset`` packs every list column.
            None (default): every per-token column of the table (a list column whose every row — null rows aside,
            which are then refused — is as long as its ``input_ids`` row) other than :data:`NOT_CARRIED`; one of
            floats, strings or nested lists is refused, naming it. A list of names: exactly those (``[]``: none;
            a column of another length is refused). ``"all"``: every list column of integers or booleans of a typed
            table that pack_dataset does not read or write itself. Kept under their own names, after the columns of
            ``columns``. A stream carries none: with None, a per-token column of the stream is refused when its
            rows are read (pass ``carry=[]`` to leave such columns out).
        buffer_size: for a streaming ``datasets.IterableDataset``: the sequences a :class:`~padfree.StreamPacker`
            holds while it packs (the result is then an ``IterableDataset`` packed as it is read, through
            :class:`~padfree.IterablePackingDataset`; ``padding="longest"``, ``sequence_ids`` and
            ``strategy="wrapped"`` are refused, and label masks must be folded into ``labels`` first).

    Returns:
        A ``datasets.Dataset`` with one row per bin (see the module docstring for the columns). For the plan too,
        make it with :func:`plan_dataset` and lay it out with :func:`pack_dataset_from_result`.

    Raises:
        InvalidTokensError: non-integer token ids, a null row, a sequence with no tokens, or ``labels`` /
            mask rows whose lengths differ from their ``input_ids`` (the message names the first such row).
        OverlongSequenceError: a sequence longer than ``capacity`` under ``overlong="error"``.
        DataLoadError: a table without an ``input_ids`` column.
        InvalidArgumentError: an option out of range.

    >>> from padfree import PackingSpec, RowSpec
    >>> data = {"input_ids": [[1, 2], [3, 4, 5], [6]], "labels": [[-100, 2], [-100, 4, 5], [6]]}
    >>> pack_dataset(data, spec=PackingSpec(capacity=4), rows=RowSpec(padding=None))[:]["labels"]
    [[-100, 4, 5, -100], [-100, 2]]
    """
    data = _data_or_token_ids(data, token_ids)
    packing = PackingSpec.resolve(spec, {"capacity": capacity, "strategy": strategy, "seed": seed,
                                         "overlong": overlong, "max_sequences_per_bin": max_sequences_per_bin})
    opts = _options(_row_spec(rows, padding_value, label_padding_value, padding, pad_to_multiple_of, attention_mask),
                    columns, label_masks, chunk_tokens, keep_in_memory, cache_file_name, num_threads)
    datasets, _ = _import_hf()
    if isinstance(data, datasets.IterableDataset):
        if carry is not None and not _carries_none(carry):
            raise InvalidArgumentError("carry= is not supported for a stream yet; map the stream to the columns "
                                       "it needs, load it as a map-style datasets.Dataset, or pass carry=[] to "
                                       "leave its other per-token columns out")
        return pack_stream(data, packing, opts, as_positive_int(buffer_size, "buffer_size"),
                           refuse_per_token=carry is None, not_carried=NOT_CARRIED)
    source = _read(data, labels, opts.label_masks, carry)
    _refuse_name_clash(source, opts)
    return _write(_plan(source, packing), source, opts)


def plan_dataset(
    data: Any = None,
    capacity: int | None = None,
    strategy: str = DEFAULT_STRATEGY,
    seed: int | None = None,
    *,
    overlong: str = "error",
    max_sequences_per_bin: int | None = None,
    spec: PackingSpec | None = None,
    token_ids: Any = None,
) -> PackResult:
    """The plan :func:`pack_dataset` would lay ``data`` out in, without writing rows: a :class:`~padfree.PackResult`
    whose sequence ids are rows of ``data`` (after its indices mapping) and whose bins are the packed rows.

    Arguments are those of :func:`pack_dataset`. Keep the plan for its metrics (``plan.efficiency``), to write the
    rows with :func:`pack_dataset_from_result` (on several column sets, or later), or to keep with the dataset.

    >>> plan = plan_dataset({"input_ids": [[1, 2], [3, 4, 5], [6]]}, capacity=4)
    >>> plan.bins, pack_dataset_from_result(plan, {"input_ids": [[1, 2], [3, 4, 5], [6]]}, padding=None)[:]["input_ids"]
    ([[1, 2], [0]], [[3, 4, 5, 6], [1, 2]])
    """
    data = _data_or_token_ids(data, token_ids)
    packing = PackingSpec.resolve(spec, {"capacity": capacity, "strategy": strategy, "seed": seed,
                                         "overlong": overlong, "max_sequences_per_bin": max_sequences_per_bin})
    datasets, _ = _import_hf()
    if isinstance(data, datasets.IterableDataset):
        raise InvalidArgumentError("plan_dataset needs a global plan, which a stream does not have; pack a stream "
                                   "with pack_dataset, or load it as a map-style datasets.Dataset")
    return _plan(_read(data, None, (), []), packing)


def _plan(source: _Data, packing: PackingSpec) -> PackResult:
    """The plan of ``source``'s sequences, refusing an overlong one by its row name first."""
    lengths = _check(source)
    if packing.refuses_overlong:
        refuse_overlong(lengths, packing.capacity, names=lambda i: f"{source.ids.name}[{i}]")
    return pack_sequences(lengths, spec=packing)


def _row_spec(rows: Any, padding_value: Any, label_padding_value: Any, padding: Any, pad_to_multiple_of: Any,
              attention_mask: Any) -> RowSpec:
    return RowSpec.resolve(rows, {"padding": padding, "pad_to_multiple_of": pad_to_multiple_of,
                                  "padding_value": padding_value, "label_padding_value": label_padding_value,
                                  "attention_mask": attention_mask})


def pack_dataset_from_result(
    result: PackResult,
    data: Any = None,
    padding_value: int = 0,
    label_padding_value: int = IGNORE_INDEX,
    *,
    padding: str | int | None = "capacity",
    pad_to_multiple_of: int | None = None,
    attention_mask: str | None = "binary",
    rows: RowSpec | None = None,
    columns: Sequence[str] | Mapping[str, str] | None = None,
    labels: Any = None,
    label_masks: Sequence[str] = LABEL_MASK_COLUMNS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    keep_in_memory: bool | None = None,
    cache_file_name: str | os.PathLike[str] | None = None,
    num_threads: int | None = None,
    token_ids: Any = None,
    carry: Sequence[str] | str | None = None,
) -> Any:
    """Lay ``data`` out in the rows planned by ``result`` (a plan made over the lengths of ``data``, e.g. by
    :func:`plan_dataset`).

    The arguments after ``data`` are those of :func:`pack_dataset` (``token_ids=`` is SeqPacker's name for
    ``data``, so ``pack_dataset_from_result(result=plan, token_ids=ids)`` works as its documents write it);
    ``padding="capacity"`` pads to the plan's capacity. Raises :class:`~padfree.errors.InvalidTokensError` when
    ``data`` does not have the plan's number of sequences or a sequence has another number of tokens than the plan
    says.

    >>> from padfree import pack_sequences
    >>> token_ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    >>> plan = pack_sequences([3, 2, 4], capacity=5, strategy="nf")
    >>> pack_dataset_from_result(plan, token_ids, padding=None)[:]["input_ids"]
    [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    """
    result = as_pack_result(result)
    data = _data_or_token_ids(data, token_ids)
    opts = _options(_row_spec(rows, padding_value, label_padding_value, padding, pad_to_multiple_of, attention_mask),
                    columns, label_masks, chunk_tokens, keep_in_memory, cache_file_name, num_threads)
    source = _read(data, labels, opts.label_masks, carry)
    _refuse_name_clash(source, opts)
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


def _carries_none(carry: Any) -> bool:
    return not isinstance(carry, str) and isinstance(carry, Sequence) and len(carry) == 0


def _refuse_name_clash(source: _Data, opts: _Options) -> None:
    written = {out for _, out in opts.columns}
    clash = [name for name, _ in source.carried if name in written]
    if clash:
        raise InvalidArgumentError(f"carried column {clash[0]!r} has the name of an output column; rename it in "
                                   f"columns={{...: <other name>}} or do not carry it")


def _data_or_token_ids(data: Any, token_ids: Any) -> Any:
    """``data``, or SeqPacker's ``token_ids=`` for it; exactly one of the two."""
    if (data is None) == (token_ids is None):
        got = "both" if data is not None else "neither"
        raise InvalidArgumentError(f"pass the sequences as data (or token_ids=, SeqPacker's name for it), not "
                                   f"{got}")
    return data if data is not None else token_ids


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _fingerprint(result: PackResult, source: _Data, opts: _Options) -> str:
    """A content fingerprint when the input has one (datasets' own, plus the plan and the options), else random."""
    import xxhash
    from datasets.fingerprint import generate_random_fingerprint

    if source.fingerprint is None:
        return generate_random_fingerprint()
    h = xxhash.xxh64()
    content = (opts.padding_value, opts.label_padding_value, opts.padding, opts.pad_to_multiple_of,
               opts.attention_mask, opts.columns, opts.label_masks, result.capacity,
               tuple(name for name, _ in source.carried))  # not how it is written
    h.update(f"padfree.pack_dataset|{source.fingerprint}|{content!r}".encode())
    for array in (result.order, result.bin_offsets, result.piece_starts, result.piece_lengths):
        if array is not None:
            h.update(np.ascontiguousarray(array).data)
    return h.hexdigest()


def _write(result: PackResult, source: _Data, opts: _Options) -> Any:
    """The rows of ``result`` as a ``datasets.Dataset``: in memory, or in an Arrow file it memory-maps."""
    datasets, _ = _import_hf()
    from datasets.table import InMemoryTable, MemoryMappedTable

    from padfree.data import _arrow_writer

    plan = _arrow_writer.plan(result, source, opts)
    fingerprint = _fingerprint(result, source, opts)
    in_memory = opts.keep_in_memory
    if in_memory is None:
        in_memory = opts.cache_file_name is None and plan.bytes_estimate <= IN_MEMORY_MAX_BYTES
    if in_memory:
        table = InMemoryTable(_arrow_writer.table(plan))
    else:
        path = opts.cache_file_name or os.path.join(
            source.cache_dir or datasets.fingerprint.get_temporary_cache_files_directory(),
            f"padfree-pack-{fingerprint}.arrow",
        )
        table = MemoryMappedTable(_arrow_writer.write_file(path, plan), path)
    logger.info("packed %d sequences into %d rows of %d (efficiency %.2f%%)%s", result.num_sequences,
                result.num_bins, result.capacity, 100 * result.efficiency, "" if in_memory else f" in {path}")
    dataset = datasets.Dataset(table, info=datasets.DatasetInfo(), split=source.split, fingerprint=fingerprint)
    if source.format is not None and source.format.get("type") is not None:
        # the input's format (torch, numpy, ...) carries over; its column selection does not: the columns are new
        dataset.set_format(type=source.format["type"], **(source.format.get("format_kwargs") or {}))
    return dataset
