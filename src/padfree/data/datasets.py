"""Torch datasets of packed rows: :class:`PackingDataset` (map-style) and :class:`IterablePackingDataset` (streaming).

Both take samples — token-id sequences, or dicts with ``input_ids`` and optional ``labels`` — and yield **one packed
row per item**, a dict of 1-D ``torch.long`` tensors:

- ``input_ids``: ``(T,)`` with ``T <= max_length`` — whole samples (or pieces of split ones) back to back, **no
  padding** (a collator decides how to pad, or not to);
- ``labels``: ``(T,)`` — Hugging Face aligned (the model shifts), the first token of every sequence set to
  ``label_padding_value`` so no token is predicted across a boundary; label masks of the input (``-100`` on prompt
  tokens) are kept;
- ``position_ids``: ``(T,)`` — ``0, 1, 2, ...`` restarting at every sequence;
- ``seq_lens``: ``(n,)`` — tokens of the row's ``n`` sequences, left to right (``cu_seqlens`` is their cumsum).

>>> samples = [[11, 12, 13], {"input_ids": [21, 22], "labels": [-100, 22]}, [31, 32, 33, 34]]
>>> ds = PackingDataset(samples, max_length=5, shuffle=False)
>>> len(ds)
2
>>> row = ds[1]
>>> row["input_ids"].tolist(), row["labels"].tolist(), row["position_ids"].tolist(), row["seq_lens"].tolist()
([11, 12, 13, 21, 22], [-100, 12, 13, -100, 22], [0, 1, 2, 0, 1], [3, 2])

**Batching.** ``DataLoader(ds, batch_size=None)`` gives one row per step — a full context of up to ``max_length``
tokens, the usual unit of packed training. For several rows per step, give the loader a ``collate_fn`` that keeps
``seq_lens``: concatenating the rows into one padding-free row (``cu_seqlens`` = cumsum of the concatenated
``seq_lens``) or padding them to a common length (the padding tail as one more sequence, see :mod:`padfree.layout`).
The rows are already packed: a collator that packs again (:func:`padfree.data.batch.packed_collate_fn`) would treat
each row as one sequence.

**Determinism and epochs.** ``seed`` plus ``set_epoch(e)`` decide everything: the order of the rows (a seeded
shuffle per epoch, unless ``shuffle=False``) and, for a randomized strategy (``ffs``), the packing itself. Call
``set_epoch(e)`` at the start of every epoch, before iterating the loader (as with ``DistributedSampler``); worker
processes get a copy of the dataset when an epoch's iteration starts, so with ``persistent_workers=True`` they keep
the epoch they started with. ``seed=None`` draws a seed once, at construction; it is part of the saved state.

**Resume** (``state_dict`` / ``load_state_dict``). The dataset cannot see what a ``DataLoader``'s workers have
yielded, so the caller says how far the training loop got: ``state = ds.state_dict(batches_consumed,
loader=loader)`` (or ``batch_size=..., num_workers=...`` instead of ``loader``), saved with the checkpoint. After a
restart, ``ds.load_state_dict(state)`` on a dataset built with the same arguments (``seed=None`` adopts the saved
seed), then a new loader with the same ``batch_size`` (and, for the iterable dataset, the same ``num_workers``)
yields exactly the batches the stopped run had not yet consumed, in the same order. The resume point belongs to the
saved epoch: ``set_epoch`` to another epoch clears it, ``set_epoch`` to the same one keeps it, and iterating that
epoch again (without ``set_epoch``) resumes from the same point again. A state from another configuration, or
saved over other data (the state carries a fingerprint of the data's tokens; for a stream, of its first
samples), raises :class:`~padfree.errors.StateMismatchError`. States are plain dicts of ints, strings and lists
(``torch.save`` and ``json`` both work).

>>> from torch.utils.data import DataLoader
>>> stream = IterablePackingDataset(samples, max_length=5, buffer_size=8, seed=0)
>>> loader = DataLoader(stream, batch_size=None)
>>> rows = iter(loader)
>>> first = next(rows)  # the training loop consumes one batch, then checkpoints
>>> state = stream.state_dict(1, loader=loader)
>>> resumed = IterablePackingDataset(samples, max_length=5, buffer_size=8, seed=0)
>>> resumed.load_state_dict(state)
>>> [r["input_ids"].tolist() for r in DataLoader(resumed, batch_size=None)] == [r["input_ids"].tolist() for r in rows]
True

Bad input raises one clear error naming the culprit: :class:`~padfree.errors.InvalidArgumentError` for options
(``max_length < 1``, ...), :class:`~padfree.errors.InvalidSampleError` for samples (not token ids, a dict without
``input_ids``, zero tokens, labels of another length, negative ids),
:class:`~padfree.errors.OverlongSequenceError` for a sample longer than ``max_length`` under ``overlong="error"``.
Nothing is dropped silently: what ``overlong="truncate"`` / ``"drop"`` remove is counted and logged
(``logging.getLogger("padfree")``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from padfree.data._packing_base import (
    FINGERPRINT_SAMPLES,
    FINGERPRINT_TOKENS,
    SEED_ORDER,
    SEED_PACK,
    Column,
    PackingBase,
    SequentialSampler,
    TorchDataset,
    arrow_chunks,
    as_count,
    check_lengths,
    crc32,
    derived_seed,
    hf_class,
    loader_batch_size,
    packed_row,
    packing_spec,
    torch,
)
from padfree.data.iterable import IterablePackingDataset
from padfree.errors import (
    InvalidArgumentError,
    InvalidSampleError,
    OutOfRangeError,
    StateMismatchError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.packing.inputs import (
    as_positive_int,
)
from padfree.packing.packer import Packer
from padfree.packing.result import PackResult
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES
from padfree.samples import (
    concat,
    read_sequence,
    split_sample,
)

__all__ = ["IterablePackingDataset", "PackingDataset"]

logger = logging.getLogger("padfree")


class PackingDataset(PackingBase, TorchDataset):
    """A map-style dataset of packed rows: the whole dataset is packed once, rows are laid out on access.

    Args:
        dataset: the samples — a ``datasets.Dataset`` with an ``input_ids`` column (list of ints) and optionally
            ``labels``; or any sequence (list, tuple, map-style torch dataset) of token-id sequences (lists, numpy
            arrays, CPU tensors) or of dicts with ``input_ids`` and optional ``labels`` (a dict without labels, or
            with ``labels=None``, is trained on all its tokens).
        max_length: tokens per packed row, ``>= 1``.
        strategy: packing strategy (see :data:`padfree.packing.STRATEGIES`); the default ``obfd`` is best fit
            decreasing.
        seed: seeds the per-epoch shuffle of the rows and randomized strategies; ``None`` draws one at construction.
        shuffle: shuffle the order of the rows, a seeded permutation of ``(seed, epoch)``; ``False`` keeps the plan's
            order (bins with the longest sequences first for the sorted strategies).
        overlong: samples longer than ``max_length``: ``"error"`` | ``"truncate"`` | ``"split"`` | ``"drop"``
            (see :func:`padfree.pack_sequences`); truncated tokens and dropped samples are logged.
        max_sequences_per_bin: at most this many sequences per row.
        spec: ``max_length`` (as ``capacity``), ``strategy``, ``seed``, ``overlong`` and ``max_sequences_per_bin``
            as one :class:`~padfree.PackingSpec`, in place of those keywords (a keyword given too is refused):
            ``PackingDataset(data, spec=PackingSpec(4096, overlong="split"))``.
        label_padding_value: the ignored label written on the first token of every sequence.
        input_ids_key, labels_key: where dict samples (and dataset columns) keep their ids and labels;
            ``labels_key=None`` ignores labels.

    How the samples are read: a ``datasets.Dataset`` is never converted to Python lists — lengths come from the
    Arrow offsets of its ``input_ids`` column (an indices mapping from ``select``/``shuffle`` is honoured), and
    ``ds[i]`` reads only the tokens of row ``i``'s sequences from the (memory-mapped) table. A sequence of Python
    samples is read once, here, into flat numpy buffers (one conversion per sample; every bad sample is reported
    now, not in the middle of training).

    Epochs: the order of the rows is ``order[i]``, a permutation drawn from ``(seed, epoch)`` (``set_epoch``). A
    deterministic strategy packs once; a randomized one (``ffs``) repacks every epoch with a seed drawn from
    ``(seed, epoch)``, so the rows themselves change (and ``len`` may change by a row or two).

    Under a ``DataLoader``: use the default sequential sampler (``shuffle=False`` in the loader — the dataset
    shuffles itself per epoch); the sampler hands indices to the workers, so workers split the rows without
    duplicates. :meth:`state_dict` / :meth:`load_state_dict` resume by position (module docstring).

    >>> ds = PackingDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_length=5, seed=3)
    >>> len(ds), ds.plan.bins, ds.order.tolist()  # row i of the epoch is bin order[i] of the plan
    (2, [[2], [0, 1]], [0, 1])
    >>> ds[0]["input_ids"].tolist()
    [6, 7, 8, 9]
    >>> ds.set_epoch(1)
    >>> ds.order.tolist(), ds[0]["input_ids"].tolist()
    ([1, 0], [1, 2, 3, 4, 5])
    """

    _kind = "PackingDataset"

    def __init__(
        self,
        dataset: Any,
        max_length: int | None = None,
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
        self._rows: np.ndarray | None = None  # logical sample -> physical row of the columns (None: identity)
        hf_dataset = hf_class("Dataset")
        if hf_dataset is not None and isinstance(dataset, hf_dataset):
            self._read_arrow(dataset)
        else:
            self._read_python(dataset)
        lengths = self._ids.lengths
        self._lengths = lengths if self._rows is None else lengths[self._rows]
        check_lengths(self._lengths, self._name, self.spec)
        # the seed of every epoch's pack is derived from (seed, epoch), so the packer keeps none of its own
        self._packer = Packer(spec=dataclasses.replace(self.spec, seed=None))
        self._plan: PackResult | None = None
        self._plan_epoch = -1
        self._start = 0  # rows of the current epoch already consumed (after load_state_dict)
        self._prepare()
        plan = self.plan
        if plan.truncated_tokens or plan.num_dropped:
            logger.warning(
                "PackingDataset: overlong=%r truncated %d tokens in %d samples and dropped %d samples (%d tokens) "
                "longer than max_length=%d", self.overlong, plan.truncated_tokens, plan.num_truncated,
                plan.num_dropped, plan.dropped_tokens, self.max_length,
            )

    # ---- reading ---------------------------------------------------------------------------------

    def _name(self, i: int) -> str:
        return f"dataset[{i}][{self.input_ids_key!r}]" if self._keyed else f"dataset[{i}]"

    def _read_arrow(self, dataset: Any) -> None:
        self._keyed = True
        names = list(dataset.column_names)
        if self.input_ids_key not in names:
            raise InvalidSampleError(
                f"the dataset has no {self.input_ids_key!r} column (columns: {names}); tokenize it first, or pass "
                f"input_ids_key=<the column of token ids>"
            )
        key, lkey = self.input_ids_key, self.labels_key
        self._ids = Column(loader=functools.partial(arrow_chunks, dataset, key))
        indices = getattr(dataset, "_indices", None)  # set by select / shuffle / train_test_split ...
        if indices is not None:
            self._rows = indices.column(0).to_numpy().astype(np.int64, copy=False)
        self._labels = None
        if lkey is not None and lkey in names:
            self._labels = Column(loader=functools.partial(arrow_chunks, dataset, lkey, "labels", self._ignored))
            ids_len, lab_len = self._ids.lengths, self._labels.lengths
            if self._rows is not None:
                ids_len, lab_len = ids_len[self._rows], lab_len[self._rows]
            if not np.array_equal(ids_len, lab_len):
                i = int(np.argmax(ids_len != lab_len))
                raise InvalidSampleError(
                    f"dataset[{i}][{lkey!r}] has {lab_len[i]} entries but dataset[{i}][{key!r}] has {ids_len[i]} "
                    f"tokens; labels are aligned with input_ids, one per token"
                )

    def _read_python(self, dataset: Any) -> None:
        if isinstance(dataset, (str, bytes, Mapping)) or not hasattr(dataset, "__len__") or not hasattr(
            dataset, "__getitem__"
        ):
            raise InvalidArgumentError(
                f"dataset must be a datasets.Dataset or a sequence of samples (len and indexing), got "
                f"{describe(dataset)}; for a stream use IterablePackingDataset"
            )
        try:
            count = len(dataset)
        except TypeError:  # a 0-d numpy array has __len__ and refuses it
            raise InvalidArgumentError(f"dataset must be a datasets.Dataset or a sequence of samples (len and "
                                       f"indexing), got {describe(dataset)}, which has no length") from None
        ids: list[np.ndarray] = []
        labels: list[np.ndarray | None] = []
        self._keyed = False
        for i in range(count):  # per sample: each is a Python object that has to be read once
            raw_ids, raw_labels, where = split_sample(dataset[i], f"dataset[{i}]", self.input_ids_key,
                                                       self.labels_key)
            self._keyed = self._keyed or where != f"dataset[{i}]"
            arr = read_sequence(raw_ids, where)
            ids.append(arr)
            if raw_labels is None:
                labels.append(None)
                continue
            lab = read_sequence(raw_labels, f"dataset[{i}][{self.labels_key!r}]", kind="labels",
                                ignored=self._ignored)
            if lab.shape[0] != arr.shape[0]:
                raise InvalidSampleError(
                    f"dataset[{i}][{self.labels_key!r}] has {lab.shape[0]} entries but {where} has {arr.shape[0]} "
                    f"tokens; labels are aligned with input_ids, one per token"
                )
            labels.append(lab)
        self._ids = Column([concat(ids)])
        has_labels = any(lab is not None for lab in labels)
        # a sample without labels is trained on all its tokens: its ids stand in for its labels
        filled = [a if lab is None else lab for a, lab in zip(ids, labels, strict=True)]
        self._labels = Column([concat(filled)]) if has_labels else None

    # ---- plan and order --------------------------------------------------------------------------

    @property
    def lengths(self) -> np.ndarray:
        """``(num_samples,) int64`` — tokens of every sample, in the dataset's order."""
        return self._lengths

    @property
    def plan(self) -> PackResult:
        """The packing plan of the current epoch (bins of sample indices)."""
        self._prepare()
        return self._plan  # type: ignore[return-value]

    @property
    def order(self) -> np.ndarray:
        """``(num_bins,) int64`` — the bin laid out at index ``i`` of the current epoch is ``order[i]``."""
        self._prepare()
        return self._order

    def _prepare(self) -> None:
        if self._plan_epoch == self.epoch:
            return
        randomized = STRATEGIES[self.strategy].randomized
        if self._plan is None or randomized:
            seed = derived_seed(self.seed, self.epoch if randomized else 0, SEED_PACK)
            self._plan = self._packer.pack(self.lengths, seed=seed)
        n = self._plan.num_bins
        if self.shuffle:
            rng = np.random.default_rng(derived_seed(self.seed, self.epoch, SEED_ORDER))
            self._order = rng.permutation(n).astype(np.int64)
        else:
            self._order = np.arange(n, dtype=np.int64)
        self._plan_epoch = self.epoch

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (deterministic in ``(seed, epoch)``); a resume point of another epoch is cleared.

        Computed here, in the calling process, so that worker processes created afterwards inherit it.
        """
        epoch = as_count(epoch, "epoch")
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch
        self._prepare()

    # ---- access ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Rows of the current epoch not yet consumed (all of them, unless resumed with ``load_state_dict``)."""
        return self.plan.num_bins - self._start

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Row ``index`` of the current epoch: ``input_ids``, ``labels``, ``position_ids`` ``(T,)``, ``seq_lens``
        ``(n,)``, all ``torch.long``."""
        try:
            if isinstance(index, (bool, np.bool_)):
                raise TypeError
            i = operator.index(index)
        except TypeError:
            raise InvalidArgumentError(f"index must be an integer, got {describe(index)}") from None
        n = len(self)
        if not -n <= i < n:
            accepted = f"index in [{-n}, {n - 1}], negative counting from the end" if n else "no index is"
            raise OutOfRangeError(f"index = {i} is not a row of this epoch: it has {n} rows ({accepted})")
        plan = self.plan
        b = int(self._order[self._start + i % n])
        p0, p1 = int(plan.bin_offsets[b]), int(plan.bin_offsets[b + 1])
        seqs = plan.order[p0:p1]
        starts = plan.piece_starts[p0:p1] if plan.piece_starts is not None else np.zeros(p1 - p0, np.int64)
        lengths = plan.placed_lengths[p0:p1]
        rows = seqs if self._rows is None else self._rows[seqs]
        tokens = self._ids.gather(rows, starts, lengths)
        if tokens.values.size and tokens.values.min() < 0:
            k = int(np.argmax(tokens.values < 0))
            j = int(np.searchsorted(tokens.offsets, k, side="right") - 1)
            raise InvalidSampleError(f"{self._name(int(seqs[j]))} holds a negative token id "
                                     f"({tokens.values[k]}); token ids are >= 0")
        labels = self._labels.gather(rows, starts, lengths) if self._labels is not None else None
        return packed_row(tokens, labels, self.max_length, self.label_padding_value)

    # ---- resume ----------------------------------------------------------------------------------

    def state_dict(self, batches_consumed: int, *, batch_size: int | None = None, loader: Any = None) -> dict:
        """The resume point after ``batches_consumed`` batches of this epoch, as a plain dict.

        Args:
            batches_consumed: batches the training loop has taken from the loader in the current epoch (counted
                from the resume point, if this dataset was itself resumed).
            batch_size: rows per batch (``None`` or 1: one row per step, ``DataLoader(batch_size=None)``).
            loader: the ``DataLoader`` over this dataset, instead of ``batch_size``; its sampler must be sequential.
        """
        k = as_count(batches_consumed, "batches_consumed")
        if loader is not None:
            size = loader_batch_size(loader, self)
            if not isinstance(getattr(loader, "sampler", None), SequentialSampler):
                raise InvalidArgumentError(
                    f"resuming by position needs the loader's default sequential sampler, got "
                    f"{describe(getattr(loader, 'sampler', None))}; build the loader with shuffle=False (the "
                    f"dataset shuffles itself per epoch, see set_epoch)"
                )
        else:
            size = 1 if batch_size is None else as_positive_int(batch_size, "batch_size")  # type: ignore[assignment]
        consumed = min(self._start + k * size, self.plan.num_bins)
        return self._new_state(rows_consumed=consumed)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) stopped: its epoch, with its consumed rows skipped."""
        self._check_state(state)
        if not self._seed_given and state["seed"] != self.seed:
            self.seed = int(state["seed"])
            self._plan_epoch = -1
            if STRATEGIES[self.strategy].randomized:
                self._plan = None
        self.epoch = as_count(state["epoch"], "epoch")
        self._prepare()
        consumed = as_count(state.get("rows_consumed"), "rows_consumed")
        if consumed > self.plan.num_bins:
            raise StateMismatchError(
                f"the state says {consumed} rows were consumed but this dataset packs into {self.plan.num_bins} "
                f"rows; it was saved over other data"
            )
        self._start = consumed

    def _config(self) -> dict[str, Any]:
        lengths = np.ascontiguousarray(self.lengths, dtype=np.int64)
        return {
            **super()._config(),
            "num_samples": int(lengths.shape[0]),
            "lengths_crc32": zlib.crc32(lengths.tobytes()),
        }

    def _fingerprint(self, epoch: int) -> dict[str, int]:
        # equal lengths are common (data cut into fixed-size blocks): a few tokens of samples spread over the dataset
        # tell two such datasets apart, read without touching the rest of a memory-mapped table
        n = int(self.lengths.shape[0])
        picked = np.unique(np.linspace(0, n - 1, min(n, FINGERPRINT_SAMPLES)).astype(np.int64)) if n else \
            np.zeros(0, np.int64)
        rows = picked if self._rows is None else self._rows[picked]
        tokens = self._ids.gather(rows, np.zeros_like(rows), np.minimum(self.lengths[picked], FINGERPRINT_TOKENS))
        return {"tokens_crc32": crc32([tokens.values])}

    def __repr__(self) -> str:
        return (
            f"PackingDataset(samples={self.lengths.shape[0]}, rows={self.plan.num_bins}, max_length="
            f"{self.max_length}, strategy={self.strategy!r}, efficiency={self.plan.efficiency:.4f}, "
            f"epoch={self.epoch})"
        )


# --------------------------------------------------------------------------------------------------
