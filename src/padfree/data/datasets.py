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

import functools
import logging
import operator
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np

from padfree.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidSampleError,
    OutOfRangeError,
    StateMismatchError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.packing.inputs import (
    OVERLONG_POLICIES,
    as_capacity,
    as_choice,
    as_flag,
    as_int,
    as_positive_int,
    as_seed,
    refuse_overlong,
)
from padfree.packing.result import PackResult
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES, Packer, as_strategy
from padfree.packing.streaming import StreamBin, StreamPacker
from padfree.rows import packed_rows
from padfree.samples import (
    TokenBuffers,
    as_fill_value,
    concat,
    length_of,
    read_arrow_chunks,
    read_sequence,
    refuse_empty,
    split_sample,
)

try:
    import torch
    from torch.utils.data import Dataset as _TorchDataset
    from torch.utils.data import IterableDataset as _TorchIterableDataset
    from torch.utils.data import SequentialSampler, get_worker_info
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.data.datasets needs torch, which is not installed; pip install 'padfree[torch]'"
    ) from exc

__all__ = ["IterablePackingDataset", "PackingDataset"]

logger = logging.getLogger("padfree")

_STATE_VERSION = 1
_READ_BLOCK = 1024  # samples read from a stream per step; any value gives the same rows (see _packed_stream)
_SEED_PACK, _SEED_ORDER = 1, 2  # purposes of the seeds derived from (seed, epoch)
_FINGERPRINT_SAMPLES, _FINGERPRINT_TOKENS = 64, 16  # a saved state's fingerprint of the data's tokens
# what a state's "data" fingerprints stand for, in messages
_FINGERPRINTS = {
    "tokens_crc32": f"the tokens (the first {_FINGERPRINT_TOKENS} of {_FINGERPRINT_SAMPLES} samples spread over the "
                    f"dataset)",
    "stream_crc32": f"the stream (the lengths of its first {_READ_BLOCK} samples and the tokens of its first 8)",
}


# --------------------------------------------------------------------------------------------------
# Samples -> token arrays (per-sample Python only; never a loop over tokens)
# --------------------------------------------------------------------------------------------------


def _check_lengths(lengths: np.ndarray, names: Callable[[int], str], max_length: int, overlong: str) -> None:
    """Refuse zero-length samples, and overlong ones under ``overlong="error"``, naming the first offender."""
    if lengths.size == 0:
        return
    refuse_empty(lengths, names)
    if overlong == "error":
        refuse_overlong(lengths, max_length, names=names, limit_name="max_length")


# --------------------------------------------------------------------------------------------------
# Pieces -> one packed row
# --------------------------------------------------------------------------------------------------


def _row(tokens: TokenBuffers, labels: TokenBuffers | None, capacity: int, label_padding_value: int) -> dict:
    """One packed row whose ``j``-th sequence is piece ``j`` of ``tokens``; the layout is :func:`packed_rows`'s."""
    k = len(tokens)
    plan = PackResult(
        lengths=tokens.lengths,
        capacity=capacity,
        order=np.arange(k, dtype=np.int64),
        bin_offsets=np.array([0, k], np.int64),
    )
    rows = packed_rows(plan, tokens, labels=labels, label_padding_value=label_padding_value)
    return {
        "input_ids": torch.from_numpy(rows.input_ids.astype(np.int64, copy=False)),
        "labels": torch.from_numpy(rows.labels),
        "position_ids": torch.from_numpy(rows.position_ids),
        "seq_lens": torch.from_numpy(np.ascontiguousarray(rows.seq_lens, dtype=np.int64)),
    }


# --------------------------------------------------------------------------------------------------
# Configuration, seeds and saved states (shared by both datasets)
# --------------------------------------------------------------------------------------------------


def _derived_seed(seed: int, epoch: int, purpose: int) -> int:
    """A seed in ``[0, 2**63)`` for ``purpose`` in ``epoch``: independent streams, identical in every process."""
    return int(np.random.SeedSequence([seed, epoch, purpose]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _as_count(value: Any, name: str) -> int:
    return as_int(value, name, minimum=0)  # type: ignore[return-value]


def _crc32(arrays: Iterable[np.ndarray]) -> int:
    """One crc32 over int64 arrays, in order."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a, dtype=np.int64).tobytes(), crc)
    return crc


def _loader_batch_size(loader: Any, dataset: Any) -> int:
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise InvalidArgumentError(f"loader must be the torch DataLoader over this dataset (or None, with "
                                   f"batch_size=... instead), got {describe(loader)}")
    if getattr(loader, "dataset", None) is not dataset:
        raise InvalidArgumentError(
            f"loader iterates {describe(getattr(loader, 'dataset', None))}, not this dataset; pass the DataLoader "
            f"built over it, or batch_size=... instead of loader"
        )
    return 1 if loader.batch_size is None else int(loader.batch_size)


class _PackingBase:
    """What both datasets share: validated options, the seed, the epoch and the state checks."""

    _kind = ""

    def _init_options(
        self,
        max_length: Any,
        strategy: Any,
        seed: Any,
        shuffle: Any,
        overlong: Any,
        max_sequences_per_bin: Any,
        label_padding_value: Any,
        input_ids_key: Any,
        labels_key: Any,
    ) -> None:
        self.max_length = as_capacity(max_length, "max_length")
        self.strategy: str = as_strategy(strategy)
        self._seed_given = seed is not None
        seed = as_seed(seed)
        # drawn once, here: every worker process gets a copy of the object, hence the same seed
        self.seed: int = seed if seed is not None else int(np.random.SeedSequence().generate_state(1, np.uint32)[0])
        self.shuffle = as_flag(shuffle, "shuffle")
        self.overlong: str = as_choice(overlong, "overlong", OVERLONG_POLICIES)
        self.max_sequences_per_bin = as_positive_int(max_sequences_per_bin, "max_sequences_per_bin", allow_none=True)
        self.label_padding_value = as_fill_value(label_padding_value, "label_padding_value")
        if not isinstance(input_ids_key, str):
            raise InvalidArgumentError(f"input_ids_key must be a string, got {describe(input_ids_key)}")
        if labels_key is not None and not isinstance(labels_key, str):
            raise InvalidArgumentError(f"labels_key must be a string or None, got {describe(labels_key)}")
        self.input_ids_key = input_ids_key
        self.labels_key = labels_key
        self.epoch = 0
        # a label is a token id or one of these (no target): any other negative value would fail inside the loss
        self._ignored = (IGNORE_INDEX, self.label_padding_value)

    def _config(self) -> dict[str, Any]:
        """What must be equal for a saved state to apply (the seed is checked on its own, see load_state_dict)."""
        return {
            "max_length": self.max_length,
            "strategy": self.strategy,
            "shuffle": self.shuffle,
            "overlong": self.overlong,
            "max_sequences_per_bin": self.max_sequences_per_bin,
            "label_padding_value": self.label_padding_value,
            "input_ids_key": self.input_ids_key,
            "labels_key": self.labels_key,
        }

    def _fingerprint(self, epoch: int) -> dict[str, int]:
        """Fingerprints of the data itself (not of the arguments) that a state saved over it carries, so that a state
        saved over other data of the same shape — equal lengths, other tokens — is refused."""
        return {}

    def _new_state(self, **position: Any) -> dict[str, Any]:
        return {
            "format": f"padfree.{self._kind}",
            "version": _STATE_VERSION,
            "config": self._config(),
            "data": self._fingerprint(self.epoch),
            "seed": self.seed,
            "epoch": self.epoch,
            **position,
        }

    def _check_state(self, state: Any) -> None:
        """Refuse a state that is not ours, from another configuration or other data, or with another seed than one
        we were given."""
        if not isinstance(state, Mapping) or state.get("format") != f"padfree.{self._kind}":
            got = f"format {state.get('format')!r}" if isinstance(state, Mapping) else "no format"
            raise StateMismatchError(
                f"load_state_dict expects a state from {self._kind}.state_dict() (format 'padfree.{self._kind}'), "
                f"got {describe(state)}, of {got}"
            )
        if state.get("version") != _STATE_VERSION:
            raise StateMismatchError(
                f"the state has version {state.get('version')!r}; this padfree reads version {_STATE_VERSION}"
            )
        for key in ("config", "data"):
            if not isinstance(state.get(key, {}), Mapping):
                raise StateMismatchError(f"the state's {key!r} is {describe(state.get(key))}; a state from "
                                         f"{self._kind}.state_dict() holds a dict there")
        saved, ours = dict(state.get("config", {})), self._config()
        diffs = [f"{k}={saved.get(k)!r} (this dataset: {ours.get(k)!r})" for k in sorted(set(saved) | set(ours))
                 if saved.get(k) != ours.get(k)]
        if diffs:
            raise StateMismatchError(
                f"the state was saved from a {self._kind} with another configuration: " + ", ".join(diffs)
                + "; build the dataset with the arguments of the run that saved it"
            )
        for key in ("seed", "epoch"):  # present in every state padfree writes: anything else is not one of ours
            value = state.get(key)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
                raise StateMismatchError(f"the state's {key!r} is {describe(value)}; a state from "
                                         f"{self._kind}.state_dict() holds an integer >= 0 there")
        if self._seed_given and state.get("seed") != self.seed:
            raise StateMismatchError(
                f"the state was saved with seed={state.get('seed')!r} but this dataset has seed={self.seed}; "
                f"pass the same seed, or seed=None to adopt the saved one"
            )
        saved_data = state.get("data", {})  # absent from states of older padfree versions: nothing to compare
        if saved_data:
            ours_data = self._fingerprint(int(state["epoch"]))
            for key in sorted(set(saved_data) | set(ours_data)):
                if saved_data.get(key) != ours_data.get(key):
                    what = _FINGERPRINTS.get(key, key)
                    raise StateMismatchError(
                        f"the state was saved over other data: {what} differ ({key}={saved_data.get(key)!r} in the "
                        f"state, {ours_data.get(key)!r} here); build the dataset over the data of the run that saved "
                        f"it"
                    )


# --------------------------------------------------------------------------------------------------
# Map-style: the whole dataset packed once (per epoch for randomized strategies)
# --------------------------------------------------------------------------------------------------


class _Column:
    """Sequences of integers as CSR chunks (zero-copy over Arrow chunks); row ``r`` of the column is row
    ``r - row_starts[c]`` of chunk ``c``. Rebuilt lazily after unpickling, so a memory-mapped ``datasets.Dataset``
    crosses to worker processes as a file reference, not as its tokens."""

    def __init__(
        self, chunks: list[TokenBuffers] | None = None, loader: Callable[[], list[TokenBuffers]] | None = None
    ) -> None:
        self._loader = loader
        self._chunks: list[TokenBuffers] | None = chunks if chunks is not None else loader()  # type: ignore[misc]
        self._row_starts = np.cumsum([0] + [len(c) for c in self._chunks], dtype=np.int64)

    def _get(self) -> list[TokenBuffers]:
        if self._chunks is None:
            self._chunks = self._loader()  # type: ignore[misc]
        return self._chunks

    @property
    def lengths(self) -> np.ndarray:
        """``(num_rows,) int64``."""
        chunks = self._get()
        if len(chunks) == 1:
            return chunks[0].lengths
        return np.concatenate([c.lengths for c in chunks]) if chunks else np.zeros(0, np.int64)

    def gather(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> TokenBuffers:
        """Piece ``j`` = tokens ``[starts[j], starts[j] + lengths[j])`` of row ``rows[j]``; reads only those tokens."""
        chunks = self._get()
        if len(chunks) == 1:
            return chunks[0].take(rows, starts, lengths)
        chunk_of = np.searchsorted(self._row_starts, rows, side="right") - 1
        parts: list[np.ndarray] = []
        for j, c in enumerate(chunk_of.tolist()):  # one small gather per piece of the row (a handful)
            part = chunks[c].take(rows[j : j + 1] - self._row_starts[c], starts[j : j + 1], lengths[j : j + 1])
            parts.append(part.values)
        return concat(parts)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._loader is not None:  # re-read from the (picklable) dataset in the other process
            state["_chunks"] = None
        return state


def _arrow_chunks(dataset: Any, key: str, kind: str = "ids",
                  ignored: tuple[int, ...] = (IGNORE_INDEX,)) -> list[TokenBuffers]:
    """The chunks of list column ``key`` of a ``datasets.Dataset``'s table, zero-copy (physical row order)."""
    return read_arrow_chunks(dataset.data.column(key), f"column {key!r}", kind=kind, ignored=ignored,
                             rows=lambda i: f"row {i} (in table order)[{key!r}]")


def _hf_class(name: str) -> type | None:
    module = sys.modules.get("datasets")  # a datasets object exists only if datasets is imported
    return getattr(module, name, None) if module is not None else None


class PackingDataset(_PackingBase, _TorchDataset):
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
        max_length: int,
        strategy: str = DEFAULT_STRATEGY,
        seed: int | None = None,
        *,
        shuffle: bool = True,
        overlong: str = "error",
        max_sequences_per_bin: int | None = None,
        label_padding_value: int = IGNORE_INDEX,
        input_ids_key: str = "input_ids",
        labels_key: str | None = "labels",
    ) -> None:
        self._init_options(max_length, strategy, seed, shuffle, overlong, max_sequences_per_bin,
                           label_padding_value, input_ids_key, labels_key)
        self._rows: np.ndarray | None = None  # logical sample -> physical row of the columns (None: identity)
        hf_dataset = _hf_class("Dataset")
        if hf_dataset is not None and isinstance(dataset, hf_dataset):
            self._read_arrow(dataset)
        else:
            self._read_python(dataset)
        lengths = self._ids.lengths
        self._lengths = lengths if self._rows is None else lengths[self._rows]
        _check_lengths(self._lengths, self._name, self.max_length, self.overlong)
        self._packer = Packer(self.max_length, self.strategy, overlong=self.overlong,
                              max_sequences_per_bin=self.max_sequences_per_bin)
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
        self._ids = _Column(loader=functools.partial(_arrow_chunks, dataset, key))
        indices = getattr(dataset, "_indices", None)  # set by select / shuffle / train_test_split ...
        if indices is not None:
            self._rows = indices.column(0).to_numpy().astype(np.int64, copy=False)
        self._labels = None
        if lkey is not None and lkey in names:
            self._labels = _Column(loader=functools.partial(_arrow_chunks, dataset, lkey, "labels", self._ignored))
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
        self._ids = _Column([concat(ids)])
        has_labels = any(lab is not None for lab in labels)
        # a sample without labels is trained on all its tokens: its ids stand in for its labels
        filled = [a if lab is None else lab for a, lab in zip(ids, labels, strict=True)]
        self._labels = _Column([concat(filled)]) if has_labels else None

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
            seed = _derived_seed(self.seed, self.epoch if randomized else 0, _SEED_PACK)
            self._plan = self._packer.pack(self.lengths, seed=seed)
        n = self._plan.num_bins
        if self.shuffle:
            rng = np.random.default_rng(_derived_seed(self.seed, self.epoch, _SEED_ORDER))
            self._order = rng.permutation(n).astype(np.int64)
        else:
            self._order = np.arange(n, dtype=np.int64)
        self._plan_epoch = self.epoch

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (deterministic in ``(seed, epoch)``); a resume point of another epoch is cleared.

        Computed here, in the calling process, so that worker processes created afterwards inherit it.
        """
        epoch = _as_count(epoch, "epoch")
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
        return _row(tokens, labels, self.max_length, self.label_padding_value)

    # ---- resume ----------------------------------------------------------------------------------

    def state_dict(self, batches_consumed: int, *, batch_size: int | None = None, loader: Any = None) -> dict:
        """The resume point after ``batches_consumed`` batches of this epoch, as a plain dict.

        Args:
            batches_consumed: batches the training loop has taken from the loader in the current epoch (counted
                from the resume point, if this dataset was itself resumed).
            batch_size: rows per batch (``None`` or 1: one row per step, ``DataLoader(batch_size=None)``).
            loader: the ``DataLoader`` over this dataset, instead of ``batch_size``; its sampler must be sequential.
        """
        k = _as_count(batches_consumed, "batches_consumed")
        if loader is not None:
            size = _loader_batch_size(loader, self)
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
        self.epoch = _as_count(state["epoch"], "epoch")
        self._prepare()
        consumed = _as_count(state.get("rows_consumed"), "rows_consumed")
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
        picked = np.unique(np.linspace(0, n - 1, min(n, _FINGERPRINT_SAMPLES)).astype(np.int64)) if n else \
            np.zeros(0, np.int64)
        rows = picked if self._rows is None else self._rows[picked]
        tokens = self._ids.gather(rows, np.zeros_like(rows), np.minimum(self.lengths[picked], _FINGERPRINT_TOKENS))
        return {"tokens_crc32": _crc32([tokens.values])}

    def __repr__(self) -> str:
        return (
            f"PackingDataset(samples={self.lengths.shape[0]}, rows={self.plan.num_bins}, max_length="
            f"{self.max_length}, strategy={self.strategy!r}, efficiency={self.plan.efficiency:.4f}, "
            f"epoch={self.epoch})"
        )


# --------------------------------------------------------------------------------------------------
# Iterable: online packing of a stream, identical in every worker process
# --------------------------------------------------------------------------------------------------


class IterablePackingDataset(_PackingBase, _TorchIterableDataset):
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
        strategy, seed, shuffle, overlong, max_sequences_per_bin, label_padding_value, input_ids_key, labels_key:
            as in :class:`PackingDataset`. Here ``shuffle`` permutes the rows within each round of the packer, so a
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
        max_length: int,
        buffer_size: int = 10_000,
        strategy: str = DEFAULT_STRATEGY,
        seed: int | None = None,
        *,
        shuffle: bool = True,
        overlong: str = "error",
        max_sequences_per_bin: int | None = None,
        label_padding_value: int = IGNORE_INDEX,
        input_ids_key: str = "input_ids",
        labels_key: str | None = "labels",
    ) -> None:
        self._init_options(max_length, strategy, seed, shuffle, overlong, max_sequences_per_bin,
                           label_padding_value, input_ids_key, labels_key)
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
        epoch = _as_count(epoch, "epoch")
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
        k = _as_count(batches_consumed, "batches_consumed")
        if loader is not None:
            size = _loader_batch_size(loader, self)
            workers = int(loader.num_workers)
            if not getattr(loader, "in_order", True):
                raise InvalidArgumentError("resuming needs a loader with in_order=True (the default): with "
                                           "in_order=False the batches arrive in no reproducible order")
        else:
            size = 1 if batch_size is None else as_positive_int(batch_size, "batch_size")  # type: ignore[assignment]
            workers = _as_count(num_workers, "num_workers")
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
        self.epoch = _as_count(state["epoch"], "epoch")
        k = _as_count(state.get("batches_consumed"), "batches_consumed")
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
            cache[epoch] = _crc32([lengths, *heads])
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
        hf = tuple(c for c in (_hf_class("Dataset"), _hf_class("IterableDataset")) if c is not None)
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
            self.max_length, self.buffer_size, self.strategy, _derived_seed(self.seed, self.epoch, _SEED_PACK),
            overlong=self.overlong, max_sequences_per_bin=self.max_sequences_per_bin,
        )
        rng = np.random.default_rng(_derived_seed(self.seed, self.epoch, _SEED_ORDER)) if self.shuffle else None
        seen = 0
        for lengths, payloads in self._open():
            _check_lengths(lengths, lambda i, base=seen: f"sample {base + i} of the stream", self.max_length,
                           self.overlong)
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
        return _row(concat(ids), concat(labels) if has_labels else None, self.max_length, self.label_padding_value)

    def __repr__(self) -> str:
        return (
            f"IterablePackingDataset(source={type(self.source).__name__}, max_length={self.max_length}, "
            f"buffer_size={self.buffer_size}, strategy={self.strategy!r}, epoch={self.epoch})"
        )
