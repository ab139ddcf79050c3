"""The Arrow writer of :func:`padfree.data.hf.pack_dataset`: packed rows built chunk by chunk from flat input
buffers, returned as an in-memory Arrow table or written to an Arrow IPC stream file and memory-mapped back.

:func:`plan` decides everything once (column types, row offsets, chunks, the schema); a builder lays out the rows of
a chunk with :func:`padfree.rows.fill_rows` on several threads; :func:`table` keeps the chunks in memory,
:func:`write_file` writes them with pyarrow's own stream writer, atomically (a temporary file renamed into place: a
failed call leaves no file, a killed process a temporary file that the next call in that directory removes).

Two things are added to pyarrow's writer: chunk ``k + 1`` is built while chunk ``k`` is written, and the pages
written are dropped from the page cache behind the writer (``POSIX_FADV_DONTNEED``). Together they make a call on
1M rows (5.1 GB of padded rows) 1.75x faster in wall time, with half the CPU time, than the bare writer
(``BENCHMARKS.md``, "Arrow file writers of ``pack_dataset``"). The same benchmark retired an
``O_DIRECT`` writer that laid the rows out inside hand-patched IPC messages in its staging buffers: it used 2x less
CPU, but was 1.8x slower in wall time than this writer, as slow as the bare one, and no lighter in peak memory.

The file is an Arrow IPC *stream*, not the IPC file format: ``datasets`` opens its cache files with
``pyarrow.ipc.open_stream`` (also when a memory-mapped dataset is pickled to another process and reopened there).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from padfree.data._scratch import ScratchFile, remove_stale, with_path
from padfree.errors import InvalidArgumentError
from padfree.packing import PackResult
from padfree.packing.inputs import MAX_CAPACITY
from padfree.rows import fill_rows, mask_labels

__all__ = ["plan", "table", "write_file"]

#: The columns with one value per row slot (the others have one per piece).
_TOKEN_COLUMNS = ("input_ids", "attention_mask", "labels", "position_ids")

_MAX_THREADS = 8  # the gather is latency-bound: threads help until memory bandwidth runs out
_MIN_SLOTS_PER_THREAD = 1 << 16  # below this a chunk is built by one thread: a task costs ~10 us
_INT32 = np.iinfo(np.int32)
_PAGE = 1 << 12


# --------------------------------------------------------------------------------------------------
# What the writer reads (``padfree.data.hf`` builds them)
# --------------------------------------------------------------------------------------------------


class Column(Protocol):
    """One per-token input column: row ``i`` (a physical row of the input) starts at ``values[starts[i]]``."""

    values: np.ndarray  # (span,) read-only
    starts: np.ndarray  # (rows,) int64

    def fits_int32(self) -> bool: ...


class Source(Protocol):
    """The token columns of the input, aligned row by row."""

    ids: Column
    labels: Column | None
    masks: tuple[Column, ...]  # 0/1 columns that exclude tokens from the labels
    carried: tuple[tuple[str, Column], ...]  # other per-token columns, laid out like input_ids (padding 0)
    indices: np.ndarray | None  # (rows,) int64: row i of the input is physical row indices[i]


class Options(Protocol):
    """How the rows are laid out (the options of ``pack_dataset``, checked)."""

    padding_value: int
    label_padding_value: int
    padding: str | int | None
    pad_to_multiple_of: int | None
    attention_mask: str | None
    columns: tuple[tuple[str, str], ...]  # (what, output name), in the order of padfree.data.hf.COLUMNS
    chunk_tokens: int
    num_threads: int | None


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Plan:
    """What the writer needs, decided once: output dtypes, row offsets, chunks, the Arrow schema."""

    result: PackResult
    source: Source
    opts: Options
    ids_dtype: np.dtype
    labels_dtype: np.dtype
    mask_dtype: np.dtype
    row_offsets: np.ndarray  # (num_bins + 1,) int64 over all rows
    ramp: np.ndarray  # (longest row,) int32: 0, 1, 2, ...
    chunks: list[tuple[int, int]]
    max_slots: int
    schema: Any
    bytes_estimate: int  # of the Arrow data: what keep_in_memory=None weighs
    columns: tuple[str, ...]  # what each column of the schema holds (COLUMNS names, then carried columns)
    carried: dict[str, np.dtype]  # the carried input columns and their output dtypes

    def wants(self, what: str) -> bool:
        return what in self.columns

    def per_token(self, what: str) -> bool:
        return what in _TOKEN_COLUMNS or what in self.carried


def _row_widths(result: PackResult, opts: Options) -> np.ndarray:
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
    widest = int(widths.max()) if widths.size else 0
    if widest > MAX_CAPACITY:  # refused before a slot is allocated
        what = f"padding={opts.padding}" if isinstance(opts.padding, int) else f"padding={opts.padding!r}"
        if multiple is not None:
            what += f" with pad_to_multiple_of={multiple}"
        raise InvalidArgumentError(f"{what} makes rows of {widest} tokens; a row holds at most {MAX_CAPACITY} "
                                   f"(pass a smaller padding or pad_to_multiple_of)")
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


def plan(result: PackResult, source: Source, opts: Options) -> Plan:
    """The plan of the rows of ``result`` over ``source``; refuses a ``padding`` shorter than the longest row."""
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
    carried = {name: np.dtype(np.int32 if column.fits_int32() else np.int64) for name, column in source.carried}
    types.update(carried)
    fields = [(out, types[what]) for what, out in opts.columns] + list(carried.items())
    schema = pa.schema([(out, pa.list_(pa.from_numpy_dtype(dtype))) for out, dtype in fields])
    slots = int(row_offsets[-1])
    per_slot = sum(types[w].itemsize for w, _ in opts.columns if w in _TOKEN_COLUMNS)
    per_slot += sum(dtype.itemsize for dtype in carried.values())
    per_piece = sum(types[w].itemsize for w, _ in opts.columns if w not in _TOKEN_COLUMNS)
    estimate = slots * per_slot + result.num_pieces * per_piece + 4 * len(opts.columns) * result.num_bins
    ramp = np.arange(int(widths.max()) if widths.size else 0, dtype=np.int32)
    return Plan(result, source, opts, ids_dtype, labels_dtype, mask_dtype, row_offsets, ramp, chunks, max_slots,
                schema, estimate, tuple(what for what, _ in opts.columns) + tuple(carried), carried)


# --------------------------------------------------------------------------------------------------
# Building the rows of a chunk
# --------------------------------------------------------------------------------------------------


class _Buffers:
    """The flat per-token output arrays of one chunk: views of the first ``slots`` entries of reusable allocations."""

    def __init__(self, plan: Plan, size: int) -> None:
        dtypes = {"input_ids": plan.ids_dtype, "attention_mask": plan.mask_dtype, "labels": plan.labels_dtype,
                  "position_ids": np.dtype(np.int32)}
        dtypes.update(plan.carried)
        self.arrays = {what: np.empty(size, dtype) for what, dtype in dtypes.items() if plan.wants(what)}

    def window(self, slots: int) -> dict[str, np.ndarray]:
        return {what: array[:slots] for what, array in self.arrays.items()}


class _Builder:
    """Lays out the rows of a range of bins; the rows of a chunk are split between ``threads`` threads.

    Each thread lays out its own rows with :func:`padfree.rows.fill_rows` (which releases the GIL): the gather from
    the input is bound by the latency of random reads (one per piece), which several threads overlap.
    """

    def __init__(self, plan: Plan, pool: ThreadPoolExecutor, threads: int) -> None:
        self.plan, self.pool, self.threads = plan, pool, threads

    def slots(self, a: int, b: int) -> int:
        """The row slots (tokens + padding) of bins ``[a, b)``."""
        return int(self.plan.row_offsets[b] - self.plan.row_offsets[a])

    def fill(self, a: int, b: int, out: Mapping[str, np.ndarray]) -> None:
        """Lay out the rows of bins ``[a, b)`` into ``out``: ``{column: (slots,) array}`` for the per-token columns
        of the output (``input_ids``, ``labels``, ``position_ids``, ``attention_mask``; absent ones are not
        written)."""
        plan = self.plan
        result, source, opts = plan.result, plan.source, plan.opts
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
        carried = [(column, column.starts[physical] + skip, out[name]) for name, column in source.carried]

        def fill(x: int, y: int) -> None:  # rows [x, y) of the chunk
            pieces, rows = piece_offsets[x : y + 1], row_offsets[x : y + 1]
            fill_rows(source.ids.values, ids_start, label_values, label_start, piece_len, pieces, rows, plan.ramp,
                      ids, labels, positions, mask, opts.padding_value, opts.label_padding_value,
                      opts.attention_mask == "segments")
            for m, starts in zip(source.masks, mask_starts, strict=False):
                mask_labels(m.values, starts, piece_len, pieces, rows, labels, opts.label_padding_value)
            for column, starts, target in carried:  # laid out like the ids; 0 on padding
                fill_rows(column.values, starts, None, None, piece_len, pieces, rows, plan.ramp, target, None, None,
                          None, 0, 0, False)

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
        result = self.plan.result
        p0, p1 = int(result.bin_offsets[a]), int(result.bin_offsets[b])
        return {
            "tokens": (self.plan.row_offsets[a : b + 1] - self.plan.row_offsets[a]).astype(np.int32),
            "pieces": (result.bin_offsets[a : b + 1] - p0).astype(np.int32),
            "seq_lens": result.placed_lengths[p0:p1].astype(np.int32),
            "sequence_ids": result.order[p0:p1].astype(np.int64, copy=False),
        }

    def batch(self, a: int, b: int, buffers: _Buffers) -> Any:
        """Build the rows of bins ``[a, b)`` in ``buffers`` and return them as an Arrow record batch (no copy)."""
        flat = buffers.window(self.slots(a, b))
        self.fill(a, b, flat)
        small = self.offsets(a, b)
        token_offsets, piece_offsets = pa.array(small["tokens"]), pa.array(small["pieces"])
        arrays = []
        for what in self.plan.columns:
            if self.plan.per_token(what):
                arrays.append(pa.ListArray.from_arrays(token_offsets, pa.array(flat[what])))
            else:
                arrays.append(pa.ListArray.from_arrays(piece_offsets, pa.array(small[what])))
        return pa.RecordBatch.from_arrays(arrays, schema=self.plan.schema)


@contextlib.contextmanager
def _builder(plan: Plan) -> Iterator[_Builder]:
    threads = plan.opts.num_threads or min(os.cpu_count() or 1, _MAX_THREADS)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="padfree-rows") as pool:
        yield _Builder(plan, pool, threads)


# --------------------------------------------------------------------------------------------------
# Out: a table in memory, or a file
# --------------------------------------------------------------------------------------------------


def table(plan: Plan) -> Any:
    """The rows of ``plan`` as an in-memory ``pyarrow.Table``, one record batch per chunk."""
    with _builder(plan) as builder:
        batches = [builder.batch(a, b, _Buffers(plan, builder.slots(a, b))) for a, b in plan.chunks]
    return pa.Table.from_batches(batches, schema=plan.schema)


def write_file(path: str, plan: Plan) -> Any:
    """Write the rows of ``plan`` to an Arrow stream file at ``path``, atomically; return it memory-mapped.

    The file is written as ``.<name>.padfree-<pid>-<random>.tmp`` beside ``path`` (:mod:`padfree.data._scratch`:
    locked while this process lives, so that a later call removes it if this process is killed) and renamed into
    place when complete. An ``OSError`` (a full disk, a file-size limit) names the file it could not write.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise with_path(exc, directory) from exc
    remove_stale(directory)
    try:
        tmp = ScratchFile(directory, os.path.basename(path))
    except OSError as exc:
        raise with_path(exc, directory) from exc
    try:
        with _builder(plan) as builder:
            messages = _write_stream(tmp.path, builder)
        _cache_message_headers(tmp.path, messages)
        os.replace(tmp.path, path)
    except OSError as exc:
        tmp.discard()
        raise with_path(exc, tmp.path) from exc
    except BaseException:
        tmp.discard()
        raise
    finally:
        tmp.close()
    return _memory_mapped_table(path)


def _write_stream(path: str, builder: _Builder) -> list[int]:
    """Write every chunk to ``path`` with pyarrow's stream writer; return where each IPC message starts.

    Two sets of buffers alternate: while a thread writes chunk ``k`` (pyarrow releases the GIL), the kernels
    (``nogil``) build chunk ``k + 1`` in the other set; a set is reused only once its write is done.
    """
    plan = builder.plan
    pending: list[Future | None] = [None, None]
    sets: list[_Buffers | None] = [None, None]
    with (
        _Stream(path, plan.schema) as stream,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="padfree-write") as disk,
    ):
        for k, (a, b) in enumerate(plan.chunks):
            slot = k % 2
            if pending[slot] is not None:
                pending[slot].result()  # that set's write is done: its buffers are free again
            if sets[slot] is None:
                sets[slot] = _Buffers(plan, plan.max_slots)
            batch = builder.batch(a, b, sets[slot])
            pending[slot] = disk.submit(stream.write_batch, batch)
            del batch
        for future in pending:
            if future is not None:
                future.result()
    return stream.messages


class _Stream:
    """pyarrow's IPC stream writer on a file, which keeps a few chunks of the file in the page cache, not all of it.

    The output is written once and read later. After each batch, ``POSIX_FADV_DONTNEED`` on its bytes starts their
    write-back, and on the bytes of two batches ago (written back by then) drops them from the page cache: the
    kernel never throttles the writer for too many dirty pages, and reuses the pages it drops for the next chunks
    instead of taking fresh memory (which virtual machines can be slow to fault in).
    """

    def __init__(self, path: str, schema: Any) -> None:
        self.sink = pa.OSFile(path, "wb")
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.schema_bytes = schema.serialize().size  # written with the first batch
        self.fd: int | None = self.sink.fileno() if hasattr(os, "posix_fadvise") else None
        self.marks = [0]
        self.messages = [0]  # where each message starts in the file

    def write_batch(self, batch: Any) -> None:
        self.messages.append(self.sink.tell() + (len(self.marks) == 1) * self.schema_bytes)
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

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        """Finish the file, or after an error just close it (the caller deletes it)."""
        try:
            if kind is None:
                self.writer.close()
                if self.fd is not None:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            self.sink.close()


def _cache_message_headers(path: str, offsets: list[int]) -> None:
    """Read the first pages of every IPC message of ``path`` into the page cache, and nothing else.

    The file was written around the page cache. Opening it (``datasets`` reads every message's metadata through a
    memory map) would then fault on one page per message, and each fault reads ahead the device's whole window
    (8 MB on the benchmark's VM): hundreds of megabytes read to open a file. With ``POSIX_FADV_RANDOM`` these
    reads stay small.
    """
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # only a speed-up
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            starts = [offset - offset % _PAGE for offset in offsets]
            for start in starts:  # all the reads queued at once (the device serves them together) ...
                os.posix_fadvise(fd, start, 2 * _PAGE, os.POSIX_FADV_WILLNEED)
            for start in starts:  # ... then waited for: the message prefix and metadata (~1 kB)
                os.pread(fd, 2 * _PAGE, start)
    finally:
        os.close(fd)


def _memory_mapped_table(path: str) -> Any:
    """The Arrow stream file at ``path`` as a memory-mapped ``pyarrow.Table``, without pyarrow's read-ahead advice.

    ``pyarrow.memory_map`` advises the kernel to read every record batch it hands out (``MADV_WILLNEED``), so
    opening a file of gigabytes that is not in the page cache (ours is not, see :class:`_Stream`) reads most of it
    from disk. A plain ``mmap`` of the file, read through a ``BufferReader``, maps the same bytes without the
    advice; pages are read when rows are.
    """
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(mapped))).read_all()
