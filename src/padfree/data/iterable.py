"""The streaming packing dataset, :class:`IterablePackingDataset` (see :mod:`padfree.data.datasets` for what its rows
are, how epochs, seeds and resuming work, and the errors it raises)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np

from padfree.data._packing_base import (
    READ_BLOCK,
    SEED_ORDER,
    SEED_PACK,
    PackingBase,
    TorchIterableDataset,
    as_count,
    check_lengths,
    crc32,
    derived_seed,
    get_worker_info,
    hf_class,
    loader_batch_size,
    packed_row,
    packing_spec,
    torch,
)
from padfree.errors import (
    InvalidArgumentError,
    InvalidSampleError,
    StateMismatchError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.packing.inputs import (
    as_positive_int,
)
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import DEFAULT_STRATEGY
from padfree.packing.streaming import StreamBin, StreamPacker
from padfree.samples import (
    concat,
    length_of,
    read_sequence,
    split_sample,
)

__all__ = ["IterablePackingDataset"]

logger = logging.getLogger("padfree")
_READ_BLOCK = READ_BLOCK  # samples read from a stream per step; any value gives the same rows


# Iterable: online packing of a stream, identical in every worker process
# --------------------------------------------------------------------------------------------------


class IterablePackingDataset(PackingBase, TorchIterableDataset):
    """An iterable dataset of packed rows, packed online from a stream with :class:`padfree.StreamPacker`.

    Args:
        iterable: the samples (token-id sequences, or dicts with ``input_ids`` and optional ``labels``), as a
            re-iterable object (a list, a ``datasets.IterableDataset`` or ``datasets.Dataset``, any object whose
            ``__iter__`` starts over) or a callable returning a fresh iterator (``lambda: read_jsonl(path)``). Every
            iteration must give the same samples in the same order (for a ``datasets.IterableDataset``, the same
            epoch: :meth:`set_epoch` is forwarded to it). A one-shot iterator (a generator object) is refused:
            workers and resumption read the stream again.
        max_length: tokens per packed row.
        buffer_size: samples (pieces) held by the packer before each round; larger packs better (10,000 gives
            > 99.5% on long-tailed lengths) and delays the first row longer.
        strategy, seed, shuffle, overlong, max_sequences_per_bin, spec, label_padding_value, input_ids_key,
            labels_key: as in :class:`PackingDataset` (``strategy="wrapped"`` is refused: it needs one plan over the
            whole input). Here ``shuffle`` permutes the rows within each round of the packer, so a
            round's rows do not come out longest-first.

    How workers split the work (``DataLoader(num_workers=W)``): every worker reads the whole stream and packs its
    lengths — the same packer run in every process, so all agree on one global sequence of rows — and lays out
    (converts, gathers, hands to torch) only the rows ``p`` with ``p % W == worker id``. The union over the workers
    is exactly the stream's rows, without duplicates; the rows do not depend on ``W`` (with ``batch_size=None`` the
    loader yields the same rows in the same order for every ``W``), and the loader's round robin over workers never
    stalls, because the workers' row counts differ by at most one. The price: each worker iterates the full source
    (cheap for in-memory data; a source that tokenizes on the fly tokenizes in every worker). A
    ``datasets.IterableDataset`` is read with ``.iter(batch_size=...)``, which does not split itself by worker; a
    torch ``IterableDataset`` that splits itself by ``get_worker_info()`` must not be the source.

    Resume: the saved state is ``(epoch, batches consumed, batch size, num_workers)``. On resume, every worker
    replays the stream's lengths through the packer (no tokens are laid out) to skip what the stopped run's
    workers had yielded; worker ``w`` of the new loader takes the place of worker ``(w + k) % W`` of the old one
    (``k`` batches consumed), since the loader restarts its round robin at worker 0. The new loader must use the
    same ``batch_size`` and ``num_workers`` (``0`` and ``1`` are the same) and the default ``in_order=True``.

    Every worker's packer logs what ``overlong="truncate"/"drop"`` removed at the end of a pass (worker 0 only).

    >>> stream = IterablePackingDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_length=5, buffer_size=8,
    ...                                 shuffle=False)
    >>> [row["input_ids"].tolist() for row in stream]
    [[6, 7, 8, 9], [1, 2, 3, 4, 5]]
    """

    _kind = "IterablePackingDataset"

    def __init__(
        self,
        iterable: Iterable[Any] | Callable[[], Iterable[Any]],
        max_length: int | None = None,
        buffer_size: int = 10_000,
        strategy: str = DEFAULT_STRATEGY,
        seed: int | None = None,
        *,
        shuffle: bool = True,
        overlong: str = "error",
        max_sequences_per_bin: int | None = None,
        spec: PackingSpec | None = None,
        label_padding_value: int = IGNORE_INDEX,
        input_ids_key: str = "input_ids",
        labels_key: str | None = "labels",
    ) -> None:
        self._init_options(packing_spec(spec, max_length, strategy, seed, overlong, max_sequences_per_bin),
                           shuffle, label_padding_value, input_ids_key, labels_key)
        if self.spec.cuts_at_row_edges:
            raise InvalidArgumentError(
                f"IterablePackingDataset: strategy={self.strategy!r} cuts the sequences at the rows' edges of one "
                f"plan over the whole input; a stream is packed as it is read: choose another strategy (e.g. 'nf', "
                f"which also keeps the input order) or use PackingDataset")
        self.buffer_size: int = as_positive_int(buffer_size, "buffer_size")  # type: ignore[assignment]
        if isinstance(iterable, (str, bytes, Mapping)):
            raise InvalidArgumentError(f"iterable must be a stream of samples, got {describe(iterable)}")
        if isinstance(iterable, Iterator):
            raise InvalidArgumentError(
                f"iterable is a one-shot iterator ({describe(iterable)}): it can be read once, but workers and "
                f"resumption read the stream again; pass a re-iterable object (a list, a datasets.IterableDataset)"
                f" or a callable returning a fresh iterator, e.g. lambda: my_generator()"
            )
        if (not hasattr(iterable, "__iter__") and not callable(iterable)) or (
                isinstance(iterable, np.ndarray) and iterable.ndim == 0):
            raise InvalidArgumentError(
                f"iterable must be an iterable of samples or a callable returning one, got {describe(iterable)}"
            )
        self.source = iterable
        self._resume: tuple[int, int, int, int] | None = None  # (epoch, batches, batch_size, workers)

    # ---- epochs and resume ----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (deterministic in ``(seed, epoch)``; forwarded to the source if it has
        ``set_epoch``); a resume point of another epoch is cleared."""
        epoch = as_count(epoch, "epoch")
        if epoch != self.epoch:
            self._resume = None
        self.epoch = epoch

    def state_dict(
        self, batches_consumed: int, *, batch_size: int | None = None, num_workers: int = 0, loader: Any = None
    ) -> dict:
        """The resume point after the training loop took ``batches_consumed`` batches of this epoch from its loader.

        Args:
            batches_consumed: batches taken from the loader in the current epoch (counted from the resume point,
                if this dataset was itself resumed: the two are added).
            batch_size: the loader's ``batch_size`` (``None`` or 1: one row per batch).
            num_workers: the loader's ``num_workers``.
            loader: the ``DataLoader`` over this dataset, instead of ``batch_size`` and ``num_workers``.
        """
        k = as_count(batches_consumed, "batches_consumed")
        if loader is not None:
            size = loader_batch_size(loader, self)
            workers = int(loader.num_workers)
            if not getattr(loader, "in_order", True):
                raise InvalidArgumentError("resuming needs a loader with in_order=True (the default): with "
                                           "in_order=False the batches arrive in no reproducible order")
        else:
            size = 1 if batch_size is None else as_positive_int(batch_size, "batch_size")  # type: ignore[assignment]
            workers = as_count(num_workers, "num_workers")
        workers = max(workers, 1)
        if self._resume is not None and self._resume[0] == self.epoch:
            _, base, base_size, base_workers = self._resume
            if (base_size, base_workers) != (size, workers):
                raise InvalidArgumentError(
                    f"this dataset resumed a run with batch_size={base_size}, num_workers={base_workers} (0 and 1 are"
                    f" the same); state_dict(batch_size={size}, num_workers={workers}) cannot continue it"
                )
            k += base
        return self._new_state(batches_consumed=k, batch_size=size, num_workers=workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) stopped: its epoch, with its consumed batches skipped."""
        self._check_state(state)
        self.seed = int(state["seed"])
        self.epoch = as_count(state["epoch"], "epoch")
        k = as_count(state.get("batches_consumed"), "batches_consumed")
        size = as_positive_int(state.get("batch_size"), "batch_size")
        workers = as_positive_int(state.get("num_workers"), "num_workers")
        self._resume = (self.epoch, k, size, workers) if k else None  # type: ignore[assignment]

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "buffer_size": self.buffer_size}

    def _fingerprint(self, epoch: int) -> dict[str, int]:
        # a stream cannot be measured without reading it: its first block (what every pass reads first) stands for
        # it, read once per epoch and kept (every iteration gives the same samples, see the class docstring)
        cache = self.__dict__.setdefault("_fingerprints", {})
        if epoch not in cache:
            blocks = self._open(epoch)
            try:
                lengths, payloads = next(blocks, (np.zeros(0, np.int64), []))
            finally:
                blocks.close()
            heads = [read_sequence(p[0], f"sample {j} of the stream") for j, p in enumerate(payloads[:8])]
            cache[epoch] = crc32([lengths, *heads])
        return {"stream_crc32": cache[epoch]}

    def _samples(self) -> Iterator[Any]:
        """An iterator over the source's samples: the source's own, or that of what the callable returned."""
        source = self.source
        if hasattr(source, "__iter__"):
            try:
                return iter(source)
            except TypeError as exc:  # an object that declares __iter__ and cannot iterate (a 0-d numpy array)
                raise InvalidArgumentError(f"iterable must be an iterable of samples, got {describe(source)}, which "
                                           f"cannot be iterated ({exc})") from None
        made = source()  # type: ignore[operator]
        accepted = ("iterable is a callable, so each call must return an iterable of samples (a list, a generator, "
                    "a datasets.IterableDataset, ...)")
        if isinstance(made, (str, bytes, Mapping)):
            raise InvalidArgumentError(f"{accepted}; {describe(source)} returned {describe(made)}, which is one "
                                       f"sample or text, not a stream of samples")
        try:
            return iter(made)
        except TypeError:
            raise InvalidArgumentError(f"{accepted}; {describe(source)} returned {describe(made)}, which is not "
                                       f"iterable") from None

    def _position(self, worker: int, num_workers: int) -> tuple[int, int]:
        """``(virtual worker, rows to skip)`` for this worker: whose rows it yields, and how many were consumed."""
        if self._resume is None or self._resume[0] != self.epoch:
            return worker, 0
        _, k, size, saved_workers = self._resume
        if saved_workers != num_workers:
            raise StateMismatchError(
                f"the state was saved from a loader with num_workers={saved_workers} but this one has "
                f"num_workers={num_workers} (0 and 1 are the same); resume with the same num_workers and batch_size"
            )
        virtual = (worker + k) % num_workers
        batches_before = max(0, -(-(k - virtual) // num_workers))  # positions p < k with p % W == virtual
        return virtual, batches_before * size

    # ---- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        virtual, skip = self._position(worker, num_workers)
        skip_global = skip * num_workers  # rows of the global sequence before this worker's first unconsumed one
        rows = 0
        for p, b in enumerate(self._packed_stream(log=worker == 0)):
            rows = p + 1
            if p % num_workers == virtual and p >= skip_global:
                yield self._layout(b)
        if skip and rows < skip_global:
            # the stream ended before the resume point: the state belongs to other (longer) data, or to another
            # configuration of this one; yielding nothing would look like a finished epoch
            raise StateMismatchError(
                f"the resumed state skips {skip_global} rows of epoch {self.epoch}, but the stream packs into "
                f"{rows}; it was saved over other data"
            )

    def _open(self, epoch: int | None = None) -> Iterator[tuple[np.ndarray, list[list[Any]]]]:
        """Blocks of ``(lengths (n,) int64, payloads)`` in stream order, of ``epoch`` (None: the current one); a
        payload is ``[ids, labels or None]``, as read (converted to arrays when first laid out)."""
        source = self.source
        if callable(getattr(source, "set_epoch", None)):
            # the copy in this process: e.g. a shuffled datasets.IterableDataset
            source.set_epoch(self.epoch if epoch is None else epoch)
        ids_key, labels_key = self.input_ids_key, self.labels_key
        hf = tuple(c for c in (hf_class("Dataset"), hf_class("IterableDataset")) if c is not None)
        seen = 0
        if hf and isinstance(source, hf):
            # .iter() reads the whole stream in every process (iterating the dataset itself inside a worker
            # would give this worker only its shards, and the workers would pack different streams)
            for batch in source.iter(batch_size=_READ_BLOCK):
                if ids_key not in batch:
                    raise InvalidSampleError(
                        f"the samples have no {ids_key!r} column (columns: {sorted(batch)}); tokenize them first, or "
                        f"pass input_ids_key=<the column of token ids>"
                    )
                ids_col = batch[ids_key]
                labels_col = batch.get(labels_key) if labels_key is not None else None
                n = len(ids_col)
                lengths = np.empty(n, np.int64)
                payloads = []
                for j in range(n):
                    raw_labels = labels_col[j] if labels_col is not None else None
                    where = f"sample {seen + j} of the stream[{ids_key!r}]"
                    lengths[j] = self._measure(ids_col[j], raw_labels, where, seen + j)
                    payloads.append([ids_col[j], raw_labels])
                seen += n
                yield lengths, payloads
            return
        iterator = self._samples()
        while True:
            block = list(islice(iterator, _READ_BLOCK))
            if not block:
                return
            lengths = np.empty(len(block), np.int64)
            payloads = []
            for j, sample in enumerate(block):
                raw_ids, raw_labels, where = split_sample(sample, f"sample {seen + j} of the stream", ids_key,
                                                           labels_key)
                lengths[j] = self._measure(raw_ids, raw_labels, where, seen + j)
                payloads.append([raw_ids, raw_labels])
            seen += len(block)
            yield lengths, payloads

    def _measure(self, raw_ids: Any, raw_labels: Any, where: str, index: int) -> int:
        length = length_of(raw_ids, where)
        if raw_labels is not None:
            got = length_of(raw_labels, f"sample {index} of the stream[{self.labels_key!r}]")
            if got != length:
                raise InvalidSampleError(
                    f"sample {index} of the stream[{self.labels_key!r}] has {got} entries but {where} has {length} "
                    f"tokens; labels are aligned with input_ids, one per token"
                )
        return length

    def _packed_stream(self, log: bool) -> Iterator[StreamBin]:
        """The global sequence of bins of this epoch — the same in every process, whatever ``_READ_BLOCK``."""
        packer = StreamPacker(
            buffer_size=self.buffer_size,
            spec=dataclasses.replace(self.spec, seed=derived_seed(self.seed, self.epoch, SEED_PACK)),
        )
        rng = np.random.default_rng(derived_seed(self.seed, self.epoch, SEED_ORDER)) if self.shuffle else None
        seen = 0
        for lengths, payloads in self._open():
            check_lengths(lengths, lambda i, base=seen: f"sample {base + i} of the stream", self.spec)
            seen += lengths.shape[0]
            i, n = 0, lengths.shape[0]
            while i < n:
                # never more than the buffer's room per call: each call then ends with at most one round (more
                # only when splitting), so the shuffle groups below depend on the stream, not on the read blocks
                take = max(1, self.buffer_size - packer.pending)
                yield from self._shuffled(packer.add(lengths[i : i + take], payloads[i : i + take]), rng)
                i += take
        yield from self._shuffled(packer.flush(), rng)
        stats = packer.stats()
        if log and (stats["truncated_tokens"] or stats["dropped_items"]):
            logger.warning(
                "IterablePackingDataset: overlong=%r truncated %d tokens and dropped %d samples (%d tokens) longer "
                "than max_length=%d in epoch %d", self.overlong, stats["truncated_tokens"], stats["dropped_items"],
                stats["dropped_tokens"], self.max_length, self.epoch,
            )

    @staticmethod
    def _shuffled(bins: list[StreamBin], rng: np.random.Generator | None) -> list[StreamBin]:
        if rng is None or len(bins) < 2:
            return bins
        return [bins[j] for j in rng.permutation(len(bins)).tolist()]

    def _layout(self, b: StreamBin) -> dict[str, torch.Tensor]:
        ids: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        has_labels = False
        for j, payload in enumerate(b.items):  # type: ignore[arg-type]
            index, start, length = int(b.ids[j]), int(b.starts[j]), int(b.lengths[j])
            name = f"sample {index} of the stream"
            # converted arrays replace the raw sample in its payload, which every piece of a split sample shares:
            # a long sample is converted once, not once per piece
            payload[0] = read_sequence(payload[0], name)
            ids.append(payload[0][start : start + length])
            if payload[1] is not None:
                has_labels = True
                payload[1] = read_sequence(payload[1], f"{name}[{self.labels_key!r}]", kind="labels",
                                           ignored=self._ignored)
                labels.append(payload[1][start : start + length])
            else:
                labels.append(ids[-1])
        return packed_row(concat(ids), concat(labels) if has_labels else None, self.max_length,
                          self.label_padding_value)

    def __repr__(self) -> str:
        return (
            f"IterablePackingDataset(source={type(self.source).__name__}, max_length={self.max_length}, "
            f"buffer_size={self.buffer_size}, strategy={self.strategy!r}, epoch={self.epoch})"
        )
