"""What the two packing datasets share (:mod:`padfree.data.datasets`): validated options, seeds, saved states and
their fingerprints, the token columns, and one packed row laid out from its pieces."""

from __future__ import annotations

import logging
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from padfree.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    StateMismatchError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.packing.inputs import (
    as_flag,
    as_int,
    refuse_overlong,
)
from padfree.packing.result import PackResult
from padfree.packing.spec import PackingSpec
from padfree.rows import packed_rows
from padfree.samples import (
    TokenBuffers,
    as_fill_value,
    concat,
    read_arrow_chunks,
    refuse_empty,
)

try:
    import torch
    from torch.utils.data import Dataset as TorchDataset
    from torch.utils.data import IterableDataset as TorchIterableDataset
    from torch.utils.data import SequentialSampler, get_worker_info
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.data.datasets needs torch, which is not installed; pip install 'padfree[torch]'"
    ) from exc



# torch and its dataset classes are imported here once, with the error a missing torch deserves, for both datasets
__all__ = ["FINGERPRINT_SAMPLES", "FINGERPRINT_TOKENS", "READ_BLOCK", "SEED_ORDER", "SEED_PACK", "Column",
           "PackingBase", "SequentialSampler", "TorchDataset", "TorchIterableDataset", "arrow_chunks", "as_count",
           "check_lengths", "crc32", "derived_seed", "get_worker_info", "hf_class", "loader_batch_size", "packed_row",
           "packing_spec", "torch"]

logger = logging.getLogger("padfree")

STATE_VERSION = 1
READ_BLOCK = 1024  # samples read from a stream per step; any value gives the same rows
SEED_PACK, SEED_ORDER = 1, 2  # purposes of the seeds derived from (seed, epoch)
FINGERPRINT_SAMPLES, FINGERPRINT_TOKENS = 64, 16  # a saved state's fingerprint of the data's tokens
# what a state's "data" fingerprints stand for, in messages
FINGERPRINTS = {
    "tokens_crc32": f"the tokens (the first {FINGERPRINT_TOKENS} of {FINGERPRINT_SAMPLES} samples spread over the "
                    f"dataset)",
    "stream_crc32": f"the stream (the lengths of its first {READ_BLOCK} samples and the tokens of its first 8)",
}


# --------------------------------------------------------------------------------------------------
# Samples -> token arrays (per-sample Python only; never a loop over tokens)
# --------------------------------------------------------------------------------------------------


def check_lengths(lengths: np.ndarray, names: Callable[[int], str], packing: PackingSpec) -> None:
    """Refuse zero-length samples, and overlong ones under ``overlong="error"``, naming the first offender."""
    if lengths.size == 0:
        return
    refuse_empty(lengths, names)
    if packing.refuses_overlong:
        refuse_overlong(lengths, packing.capacity, names=names, limit_name="max_length")


#: the route's names of the :class:`~padfree.PackingSpec` fields: the datasets call the capacity ``max_length``
_SPEC_NAMES = {"capacity": "max_length"}


def packing_spec(spec: Any, max_length: Any, strategy: Any, seed: Any, overlong: Any,
                 max_sequences_per_bin: Any) -> PackingSpec:
    """The datasets' :class:`~padfree.PackingSpec`: ``spec=``, or their keywords (``max_length`` is the capacity)."""
    return PackingSpec.resolve(spec, {"capacity": max_length, "strategy": strategy, "seed": seed,
                                      "overlong": overlong, "max_sequences_per_bin": max_sequences_per_bin},
                               names=_SPEC_NAMES)


# --------------------------------------------------------------------------------------------------
# Pieces -> one packed row
# --------------------------------------------------------------------------------------------------


def packed_row(tokens: TokenBuffers, labels: TokenBuffers | None, capacity: int, label_padding_value: int) -> dict:
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


def derived_seed(seed: int, epoch: int, purpose: int) -> int:
    """A seed in ``[0, 2**63)`` for ``purpose`` in ``epoch``: independent streams, identical in every process."""
    return int(np.random.SeedSequence([seed, epoch, purpose]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def as_count(value: Any, name: str) -> int:
    return as_int(value, name, minimum=0)  # type: ignore[return-value]


def crc32(arrays: Iterable[np.ndarray]) -> int:
    """One crc32 over int64 arrays, in order."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a, dtype=np.int64).tobytes(), crc)
    return crc


def loader_batch_size(loader: Any, dataset: Any) -> int:
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise InvalidArgumentError(f"loader must be the torch DataLoader over this dataset (or None, with "
                                   f"batch_size=... instead), got {describe(loader)}")
    if getattr(loader, "dataset", None) is not dataset:
        raise InvalidArgumentError(
            f"loader iterates {describe(getattr(loader, 'dataset', None))}, not this dataset; pass the DataLoader "
            f"built over it, or batch_size=... instead of loader"
        )
    return 1 if loader.batch_size is None else int(loader.batch_size)


class PackingBase:
    """What both datasets share: validated options, the seed, the epoch and the state checks."""

    _kind = ""

    def _init_options(
        self,
        packing: PackingSpec,
        shuffle: Any,
        label_padding_value: Any,
        input_ids_key: Any,
        labels_key: Any,
    ) -> None:
        self.spec = packing
        self.max_length = packing.capacity
        self.strategy: str = packing.strategy
        self._seed_given = packing.seed is not None
        # drawn once, here: every worker process gets a copy of the object, hence the same seed
        self.seed: int = packing.seed if packing.seed is not None else int(
            np.random.SeedSequence().generate_state(1, np.uint32)[0])
        self.shuffle = as_flag(shuffle, "shuffle")
        self.overlong: str = packing.overlong
        self.max_sequences_per_bin = packing.max_sequences_per_bin
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
            "version": STATE_VERSION,
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
        if state.get("version") != STATE_VERSION:
            raise StateMismatchError(
                f"the state has version {state.get('version')!r}; this padfree reads version {STATE_VERSION}"
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
                    what = FINGERPRINTS.get(key, key)
                    raise StateMismatchError(
                        f"the state was saved over other data: {what} differ ({key}={saved_data.get(key)!r} in the "
                        f"state, {ours_data.get(key)!r} here); build the dataset over the data of the run that saved "
                        f"it"
                    )


# --------------------------------------------------------------------------------------------------
# Map-style: the whole dataset packed once (per epoch for randomized strategies)
# --------------------------------------------------------------------------------------------------


class Column:
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


def arrow_chunks(dataset: Any, key: str, kind: str = "ids",
                  ignored: tuple[int, ...] = (IGNORE_INDEX,)) -> list[TokenBuffers]:
    """The chunks of list column ``key`` of a ``datasets.Dataset``'s table, zero-copy (physical row order)."""
    return read_arrow_chunks(dataset.data.column(key), f"column {key!r}", kind=kind, ignored=ignored,
                             rows=lambda i: f"row {i} (in table order)[{key!r}]")


def hf_class(name: str) -> type | None:
    module = sys.modules.get("datasets")  # a datasets object exists only if datasets is imported
    return getattr(module, name, None) if module is not None else None


