"""Arrow IPC stream files written around the page cache: ``O_DIRECT`` from two staging buffers, record batch
messages laid out in place by a flatbuffer template, and the page-cache writer for filesystems without ``O_DIRECT``.

The private machinery of :mod:`padfree.data._arrow_writer`'s ``direct`` writer. Every stream writes exactly the bytes
pyarrow's stream writer would write (the tests compare them byte for byte).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["BufferedStream", "DirectStream", "MessageLayout", "cache_message_headers", "open_stream"]

logger = logging.getLogger("padfree")

_BLOCK = 1 << 12  # O_DIRECT alignment of memory, sizes and file offsets: a page, >= any logical block size
_WRITE_BYTES = 1 << 26  # bytes per disk write, at most
_ALIGNMENT = 8  # Arrow IPC pads every buffer of a message body to a multiple of this


def cache_message_headers(path: str, offsets: list[int]) -> None:
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


def open_stream(path: str, schema: Any, size_hint: int, max_message_bytes: int,
                direct: bool = True) -> DirectStream | BufferedStream:
    """A stream of ``schema`` written to ``path``: with ``O_DIRECT`` when ``direct`` and the filesystem allows it.

    ``size_hint`` is about the size of the whole stream, ``max_message_bytes`` an upper bound on one record batch
    message.
    """
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return DirectStream(path, schema, size_hint, max_message_bytes)
        except OSError as exc:  # tmpfs, some network filesystems: no O_DIRECT
            logger.debug("O_DIRECT unavailable for %s (%s): writing through the page cache", path, exc)
    return BufferedStream(path, schema)


class DirectStream:
    """An Arrow IPC stream file written with ``O_DIRECT`` from two reused, page-aligned staging buffers.

    The output is written once and read later, so it has no business in the page cache: ``O_DIRECT`` moves it from
    a staging buffer to the disk by DMA. Through the page cache the kernel would copy it again, allocate a page per
    4 kB and write them back, which costs about as much CPU as building the rows (and, on virtual machines whose
    fresh memory is slow to fault in, several times that). The file holds exactly the bytes pyarrow's stream writer
    would write: the schema message, one message per batch, the end-of-stream marker.

    Each record batch goes into the current staging buffer right after the bytes still pending there (less than
    one block): :meth:`write_rows` lays its rows out right there, inside the message (see :class:`MessageLayout`),
    so that no byte of the output is copied after the gather. Once enough bytes have accumulated, their whole
    blocks go to disk on a thread of their own (``pwrite`` at their offset, so that the other buffer's write may
    still be in flight) while the remainder moves to the front of the other buffer, where the next batch goes:
    building overlaps with the disk. (Where the message layout cannot be trusted,
    :meth:`write_batch` has pyarrow serialize a batch built elsewhere into the same spot instead; a fresh stream
    writer there puts its schema message before the batch, so the few bytes it covers are saved and put back.)
    """

    def __init__(self, path: str, schema: Any, size_hint: int, max_message_bytes: int) -> None:
        self.schema = schema
        self.header = schema.serialize().to_pybytes()
        self.margin = -(-len(self.header) // _BLOCK) * _BLOCK
        # disks write large requests much faster (virtio: 1.7 GB/s at 16 MB, ~3 GB/s at 64-128 MB): batches
        # accumulate up to this many bytes before they go; 1/32 of the output at most, so small outputs stay small
        self.largest = max(_BLOCK, min(_WRITE_BYTES, size_hint // 32))
        # ... but the disk idles until the first write: the first ones are small, then each is twice the last
        self.threshold = max(_BLOCK, self.largest // 16)
        size = -(-(self.margin + self.largest + max_message_bytes + 64) // _BLOCK) * _BLOCK
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
        self.layout = MessageLayout.of(schema, self.header)
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

    def write_rows(self, offsets: Sequence[np.ndarray], fill: Callable[[list[np.ndarray]], None]) -> None:
        """Lay out one record batch message in place in the staging buffer (only with a :attr:`layout`).

        ``offsets[k]`` (``(rows + 1,) int32``, from 0) are the list offsets of column ``k``; ``fill`` is then given
        every column's values buffer, as an array of the column's value type right inside the message, to write.
        """
        layout = self.layout
        rows = offsets[0].shape[0] - 1
        head, buffers, body = layout.message(rows, [int(o[-1]) for o in offsets])
        at = self.margin + self.pending
        stage = self.arrays[self.current]
        if at + len(head) + body > stage.shape[0]:  # pragma: no cover - max_message_bytes bounds every message
            raise AssertionError(f"a record batch of {len(head) + body} bytes overflows the staging buffer")
        stage[at : at + len(head)] = np.frombuffer(head, np.uint8)
        base = at + len(head)
        values = []
        for k, column_offsets in enumerate(offsets):
            (offsets_at, offsets_len), (values_at, values_len) = buffers[4 * k + 1], buffers[4 * k + 3]
            stage[base + offsets_at : base + offsets_at + offsets_len].view(np.int32)[:] = column_offsets
            values.append(stage[base + values_at : base + values_at + values_len].view(layout.dtypes[k]))
            for start, length in (buffers[4 * k + 1], buffers[4 * k + 3]):  # the zero padding after each buffer
                stage[base + start + length : base + start + _padded(length)] = 0
        fill(values)
        del values, stage
        self.messages.append(self.size)
        self.pending += len(head) + body
        self.size += len(head) + body
        if self.pending >= self.threshold:
            self._ship()

    def write_batch(self, batch: Any) -> None:
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

    def __enter__(self) -> DirectStream:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(complete=kind is None)


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


class MessageLayout:
    """Arrow IPC record batch messages of one schema of list columns without nulls, for any sizes, without pyarrow.

    A message is an 8-byte prefix, a flatbuffer of metadata (``Message`` holding a ``RecordBatch``: its row count,
    one ``FieldNode`` per array and one ``Buffer`` (offset, length) per buffer, and the body length), then the body:
    the buffers of every column back to back — list validity (empty), list offsets (int32), values validity
    (empty), values — each padded to 8 bytes with zeros. Only numbers change from one batch to the next, in
    fields a flatbuffer stores at fixed places; so one message that pyarrow serializes is a template, patched for
    other sizes, and :meth:`DirectStream.write_rows` lays the rows out right where the body will hold them.

    :meth:`of` checks the result against pyarrow on a second batch, byte for byte (and returns None, so that the
    writer lets pyarrow serialize, should a future pyarrow write messages another way).
    """

    def __init__(self, schema: Any, prefix: bytes, meta: bytes, patch: dict[str, Any]) -> None:
        self.dtypes = [np.dtype(f.type.value_type.to_pandas_dtype()) for f in schema]
        self.prefix, self.meta, self.patch = prefix, meta, patch

    @classmethod
    def of(cls, schema: Any, header: bytes) -> MessageLayout | None:
        """The layout of ``schema`` (whose stream header is ``header``); None when the template cannot be read or
        does not reproduce pyarrow."""
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


class BufferedStream:
    """The same stream through the page cache, for filesystems without ``O_DIRECT``.

    After each batch, ``POSIX_FADV_DONTNEED`` on its bytes starts their write-back, and on the bytes of two batches
    ago (written back by then) drops them from the page cache: the cache holds a few chunks of the file, not all
    of it, and the kernel never throttles the writer for too many dirty pages.
    """

    def __init__(self, path: str, schema: Any) -> None:
        self.sink = pa.OSFile(path, "wb")
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.writer_header = schema.serialize().size  # written with the first batch
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

    def __enter__(self) -> BufferedStream:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(complete=kind is None)

