"""Data-parallel training on packed rows: every rank the same number of steps, balanced tokens and Σ len².

:class:`DistributedPackedBatchSampler` packs the per-sample lengths (or takes a plan, or a
:class:`~padfree.data.datasets.PackingDataset`'s plan), arranges the bins into steps with
:func:`padfree.packing.balance_bins` and yields, for its rank, one list of indices per micro-batch — a ``batch_sampler``
for a plain ``torch.utils.data.DataLoader``. Why not ``DistributedSampler`` over packed rows: it shards rows by
count, so one rank may get the rows full of long sequences (attention cost grows with Σ len²) and wait at every
step for nothing; and a sampler whose ranks disagree on the number of batches hangs the last all-reduce of the
epoch. Here every rank computes the same schedule from the same lengths and seed, with no communication, and takes
its column of it.

>>> lengths = [4000, 96, 2000, 2000, 1000, 1000, 1000, 1000, 4096, 3000]
>>> ranks = [DistributedPackedBatchSampler(lengths, 4096, num_replicas=2, rank=r, seed=0) for r in (0, 1)]
>>> [list(s) for s in ranks]  # per rank: the sample indices of each micro-batch (here one packed row each)
[[[0], [5, 6, 7], [9, 4, 1]], [[8], [5, 6, 7], [2, 3]]]
>>> ranks[0].repeated_samples.tolist()  # 5 rows for 2 ranks: the cheapest row is scheduled twice
[5, 6, 7]
>>> print(ranks[0].summary())
epoch 0: 5 rows of 10 samples -> 3 steps x 2 ranks x 1 rows; 0 rows dropped, 1 repeated (3 samples, 3000 tokens);
idle from imbalance: tokens 0.865%, attention cost 4.907%
>>> ranks[0].set_epoch(1)
>>> list(ranks[0])  # another epoch: another order of the steps, and of the ranks within a step
[[5, 6, 7], [9, 4, 1], [8]]
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from padfree.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidLengthsError,
    RankMismatchError,
    describe,
)
from padfree.packing.balance import REMAINDER_POLICIES, BalancedSteps, balance_bins
from padfree.packing.inputs import (
    OVERLONG_POLICIES,
    as_choice,
    as_flag,
    as_int,
    as_lengths,
    as_positive_int,
    as_seed,
)
from padfree.packing.packer import Packer
from padfree.packing.result import PackResult
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES

try:
    import torch
    import torch.distributed as dist
    from torch.utils.data import Sampler
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.distributed needs torch, which is not installed; pip install 'padfree[torch]'"
    ) from exc

__all__ = ["DistributedPackedBatchSampler"]

logger = logging.getLogger("padfree")

_SEED_PACK, _SEED_STEPS = 11, 12  # purposes of the seeds derived from (seed, epoch)


def is_hf_dataset(data: Any) -> bool:
    datasets = sys.modules.get("datasets")  # never imported here: a datasets.Dataset means it already is
    return datasets is not None and isinstance(data, datasets.Dataset)


def _hf_list_column(dataset: Any, key: str, missing: str, wrong_type: str) -> Any:
    """``dataset[key]`` as one Arrow list array in the dataset's own order (an indices mapping from ``select`` /
    ``shuffle`` honoured), read without a Python object per row; ``missing`` / ``wrong_type`` (formatted with the
    columns / the Arrow type) are the errors when the column is absent or not lists."""
    import pyarrow as pa

    if key not in dataset.column_names:
        raise InvalidArgumentError(missing.format(columns=dataset.column_names))
    column = dataset.data.column(key)
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise InvalidArgumentError(wrong_type.format(type=column.type))
    indices = getattr(dataset, "_indices", None)
    if indices is not None:
        column = column.take(indices.column(0))
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _list_sizes(column: Any) -> np.ndarray:
    """``(len(column),) int64`` — the entries of every list (a null list counts as 0, refused by the callers)."""
    import pyarrow.compute as pc

    return np.nan_to_num(pc.list_value_length(column).to_numpy(zero_copy_only=False), nan=0).astype(np.int64)


def _hf_lengths(dataset: Any, key: str = "input_ids") -> np.ndarray:
    """``(len(dataset),) int64`` — the tokens of every sample, from the Arrow offsets of its ``key`` column."""
    column = _hf_list_column(
        dataset, key,
        f"data is a datasets.Dataset without an {key!r} column (columns: {{columns}}); tokenize it first, or pass "
        f"per-sample lengths",
        f"data[{key!r}] must be lists of token ids, got Arrow type {{type}}")
    return _list_sizes(column)


def _rows_plan(rows: Any, capacity: Any) -> PackResult:
    """A :class:`PackResult` with one bin per row of ``rows`` (per-row sequence lengths), bins in row order."""
    if is_hf_dataset(rows):
        import pyarrow.compute as pc

        column = _hf_list_column(
            rows, "seq_lens",
            "rows is a datasets.Dataset without a seq_lens column (columns: {columns}); pack it first "
            "(padfree.pack_for_trainer)",
            "rows['seq_lens'] must be lists of sequence lengths, got Arrow type {type}")
        sizes = _list_sizes(column)
        flat = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    else:
        if isinstance(rows, (str, bytes, dict, PackResult)) or np.isscalar(rows) or not hasattr(rows, "__len__"):
            raise InvalidArgumentError(f"rows must be a datasets.Dataset with a seq_lens column or a sequence of "
                                       f"per-row lists of sequence lengths, got {describe(rows)}")
        per_row = [np.asarray(r, dtype=np.int64).reshape(-1) if not np.isscalar(r) else None for r in rows]
        if any(r is None for r in per_row):
            raise InvalidArgumentError("rows must hold one list of sequence lengths per row (e.g. [[120], [30, 40]]),"
                                       " got a scalar where a row was expected")
        sizes = np.array([r.shape[0] for r in per_row], np.int64)
        flat = np.concatenate(per_row) if per_row else np.zeros(0, np.int64)
    empty = np.flatnonzero(sizes == 0)
    if empty.size:
        raise InvalidArgumentError(f"rows[{int(empty[0])}] holds no sequence ({empty.size} empty rows); every row "
                                   f"needs at least one sequence length")
    lengths = as_lengths(flat, "the rows' seq_lens")
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    fill = np.add.reduceat(lengths, offsets[:-1]) if sizes.size else np.zeros(0, np.int64)
    fullest = int(fill.max()) if fill.size else 1
    if capacity is None:
        capacity = fullest
    capacity = as_positive_int(capacity, "capacity")
    if fullest > capacity:  # type: ignore[operator]
        row = int(np.argmax(fill))
        raise InvalidArgumentError(f"rows[{row}] holds {fullest} tokens, more than capacity={capacity}; pass the "
                                   f"length the rows were packed to (or leave capacity out)")
    return PackResult(lengths=lengths, capacity=int(capacity), order=np.arange(lengths.shape[0], dtype=np.int64),
                      bin_offsets=offsets, strategy="rows")


def _derived_seed(seed: int, epoch: int, purpose: int) -> int:
    """A seed for ``purpose`` in ``epoch``: independent streams, identical in every process."""
    return int(np.random.SeedSequence([seed, epoch, purpose]).generate_state(1, np.uint32)[0])


def _process_group(num_replicas: Any, rank: Any, all_ranks: bool) -> tuple[int, int]:
    """``(num_replicas, rank)``: explicit values win; missing ones come from an initialised process group."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        if initialised:
            num_replicas = dist.get_world_size()
        else:
            env = os.environ.get("WORLD_SIZE", "1")
            if env.strip() not in ("", "1"):
                # a launcher started several processes but none has joined a process group yet: defaulting to one
                # replica would silently train every rank on all the data
                raise InvalidArgumentError(
                    f"num_replicas is None and torch.distributed is not initialised, but WORLD_SIZE={env!r}; call "
                    f"torch.distributed.init_process_group() (or create the Accelerator / TrainingArguments) before "
                    f"building the sampler, or pass num_replicas= and rank= explicitly"
                )
            num_replicas = 1
    num_replicas = as_positive_int(num_replicas, "num_replicas")
    if rank is None:
        if all_ranks:
            rank = 0  # unused: every rank's micro-batches are yielded
        elif initialised:
            rank = dist.get_rank()
        elif num_replicas == 1:
            rank = 0
        else:
            raise InvalidArgumentError(
                f"rank is None with num_replicas={num_replicas} and torch.distributed is not initialised; pass "
                f"rank= (an integer in [0, {num_replicas})) or initialise the process group first"
            )
    rank = as_int(rank, "rank", minimum=0)
    if rank >= num_replicas:  # type: ignore[operator]
        raise InvalidArgumentError(f"rank must be an integer in [0, {num_replicas}) (num_replicas={num_replicas}), "
                                   f"got {rank}")
    return num_replicas, rank  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class _Epoch:
    """What one epoch's iteration needs, computed once per epoch."""

    epoch: int
    plan: PackResult
    schedule: BalancedSteps
    row_of_bin: np.ndarray | None  # rows mode: dataset index of every bin; None: yield sample ids


class DistributedPackedBatchSampler(Sampler[list[int]]):
    """A batch sampler that gives every data-parallel rank the same number of balanced packed micro-batches.

    Every rank builds the same sampler (same data, same arguments); each yields its own share: per step, one
    micro-batch of ``micro_batch_size`` packed rows (bins), chosen by :func:`padfree.packing.balance_bins` so that
    the ranks of a step carry nearly equal tokens and Σ len² (attention cost). No communication is needed, and
    nothing is left to chance: the schedule is a function of ``(data, seed, epoch)``.

    Args:
        data: what to schedule, one of
            - per-sample lengths (a list, numpy array, CPU tensor): packed here into rows of ``capacity`` tokens;
              the sampler yields **sample indices**, row after row — pair it with a collator that packs them
              (:func:`padfree.packed_collate_fn`, see "Collators" below);
            - a ``datasets.Dataset`` with an ``input_ids`` column: its lengths, read from the Arrow offsets (no
              Python list per row; an indices mapping from ``select`` / ``shuffle`` honoured), yielding indices
              into the dataset;
            - a :class:`~padfree.PackResult` over the samples (a plan you made), yielding sample indices;
            - a :class:`~padfree.PackingDataset`: its plan of the current epoch; the sampler yields **row indices**
              of the dataset (each row is one packed bin) and forwards :meth:`set_epoch` to it. With
              ``persistent_workers=True`` build the dataset with ``shuffle=False`` and a deterministic strategy (this
              sampler shuffles): the workers' copies keep the epoch they started with, hence its row order.

            Rows packed already (a dataset with a ``seq_lens`` column): :meth:`from_rows`, yielding row indices.
        capacity: tokens per packed row; required for lengths, checked against a plan or a dataset otherwise.
        num_replicas: data-parallel world size. ``None``: ``torch.distributed.get_world_size()`` when a process
            group is initialised, else 1 (refused when ``WORLD_SIZE`` says a launcher started several processes).
        rank: this process's rank. ``None``: ``torch.distributed.get_rank()`` when initialised (0 for a single
            replica). Explicit values win over the process group (e.g. data-parallel groups smaller than the world).
        micro_batch_size: packed rows per rank per step.
        seed: the schedule's seed; with ``shuffle``, each epoch draws its order from ``(seed, epoch)``.
        shuffle: shuffle the order of the steps and, within each step, which rank gets which micro-batch (the
            balance of a step is unchanged by either). ``False``: steps from cheapest to most expensive.
        remainder: when the rows do not fill the last step (``num_rows % (num_replicas * micro_batch_size)``):
            ``"repeat"`` (default, like ``DistributedSampler``) schedules the cheapest rows a second time —
            :attr:`repeated_samples` lists them, and they are logged at INFO; ``"drop"`` leaves the cheapest rows out
            of the epoch — :attr:`dropped_samples` lists them, and they are logged as a WARNING. Fewer than
            ``num_replicas * micro_batch_size`` rows are ever repeated or dropped.
        strategy, overlong, max_sequences_per_bin: how lengths are packed (see :func:`padfree.pack_sequences`); only
            for lengths. A randomized strategy (``ffs``) repacks every epoch with a seed drawn from ``(seed, epoch)``
            (the number of steps may then change between epochs, equally on every rank); a deterministic one packs
            once, so the rows keep their samples and only their order changes. ``overlong="split"`` is refused
            (a sample index cannot name a piece of a sample: use a :class:`~padfree.PackingDataset` with it);
            ``"truncate"`` needs a collator that truncates the same way; ``"drop"`` samples are never yielded
            (counted in ``plan.dropped`` and logged). ``strategy="wrapped"`` is refused for the same reason.
        spec: ``capacity``, ``strategy``, ``overlong`` and ``max_sequences_per_bin`` as one
            :class:`~padfree.PackingSpec`, in place of those keywords (its ``seed`` must be None: the packing seed of
            every epoch is drawn from ``seed``).
        all_ranks: yield the micro-batches of **every** rank, interleaved step by step (step 0 rank 0, step 0
            rank 1, ..., step 1 rank 0, ...), for loaders that shard a batch sampler themselves: ``accelerate``'s
            ``prepare`` (hence the Hugging Face ``Trainer``) wraps it in a ``BatchSamplerShard`` that gives process
            ``p`` the batches ``p, p + W, p + 2W, ...`` — exactly rank ``p``'s micro-batches. ``rank`` is then unused.

    Collators. With lengths (sample indices), a micro-batch of one row holds samples whose tokens fit ``capacity``,
    so ``packed_collate_fn(capacity)`` packs it back into that one row. With ``micro_batch_size > 1`` use
    ``packed_collate_fn(capacity, strategy="nf")`` — next fit over the samples, which arrive row after row, never
    needs more rows than the schedule's (greedy filling is optimal for a sequence cut into consecutive groups) —
    or :class:`~padfree.PaddingFreeCollator` (one row of all the micro-batch's tokens, no padding at all). With a
    :class:`~padfree.PackingDataset` (row indices), either collator keeps the rows' sequence boundaries
    (they read ``seq_lens``). Pass ``return_dict=True`` for the ``Trainer``.

    A plain ``DataLoader`` with DDP or FSDP (``torch.distributed`` initialised first)::

        sampler = DistributedPackedBatchSampler(lengths, capacity=4096, seed=0)
        loader = DataLoader(samples, batch_sampler=sampler, collate_fn=packed_collate_fn(4096), num_workers=2)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)  # before iterating, as with DistributedSampler
            for batch in loader:
                loss = ddp_model(**batch.model_inputs()).loss  # ...

    Every rank gets ``len(sampler)`` micro-batches, so no rank waits forever in the last all-reduce (or FSDP
    all-gather) of an epoch; the ranks of a step differ in tokens, which DDP and FSDP do not mind. Normalise the
    loss by the tokens of the whole step across ranks when it must not depend on how the tokens were split.

    With ``accelerate`` (and the ``Trainer``), build the sampler with ``all_ranks=True``: ``accelerator.prepare``
    re-shards every batch sampler, so a sampler that already yields one rank's batches would be cut again — each
    process would keep every ``W``-th of its own micro-batches and silently lose the rest. The interleaved stream is
    what ``BatchSamplerShard`` expects; its length is a multiple of ``W``, so ``even_batches`` adds nothing. Keep
    the defaults ``split_batches=False`` (a sampler without a ``batch_size`` cannot be split; accelerate refuses)
    and ``dispatch_batches=False`` (the default for map-style datasets; dispatching would concatenate the ranks'
    differently shaped packed batches on process 0). The prepared loader forwards ``set_epoch`` to this sampler
    (through :attr:`sampler`), and advances it by itself at every pass. With the Trainer, override
    ``get_train_dataloader``::

        class PackedTrainer(transformers.Trainer):
            def get_train_dataloader(self):
                sampler = DistributedPackedBatchSampler(lengths, 4096, num_replicas=self.accelerator.num_processes,
                                                        all_ranks=True, seed=self.args.seed)
                loader = DataLoader(self.train_dataset, batch_sampler=sampler, num_workers=...,
                                    collate_fn=packed_collate_fn(4096, return_dict=True))
                return self.accelerator.prepare(loader)

    The Trainer then counts ``len(sampler) / W`` steps per epoch and calls ``set_epoch(epoch)`` itself.
    """

    def __init__(
        self,
        data: Any,
        capacity: int | None = None,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        micro_batch_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        remainder: str = "repeat",
        strategy: str | None = None,
        overlong: str | None = None,
        max_sequences_per_bin: int | None = None,
        spec: PackingSpec | None = None,
        all_ranks: bool = False,
    ) -> None:
        self.all_ranks = as_flag(all_ranks, "all_ranks")
        self.shuffle = as_flag(shuffle, "shuffle")
        self.num_replicas, self.rank = _process_group(num_replicas, rank, self.all_ranks)
        self.micro_batch_size: int = as_positive_int(micro_batch_size, "micro_batch_size")  # type: ignore[assignment]
        if seed is None:  # every rank must draw the same schedule: a fresh random seed per process would hang
            raise InvalidArgumentError("seed must be an integer >= 0, got None; every rank needs the same seed")
        self.seed: int = as_seed(seed)  # type: ignore[assignment]
        self.remainder = as_choice(remainder, "remainder", REMAINDER_POLICIES)
        self.epoch = 0
        self._cache: _Epoch | None = None
        self._dataset: Any = None
        self._plan: PackResult | None = None
        self._packer: Packer | None = None
        self._rows = False  # from_rows / from_samples: every bin is one row (sample) of the dataset, by index
        self._group_by = "cost"  # from_samples: "random" (steps drawn at random, only dealt by load)
        if spec is not None:  # the spec's settings, as the keywords would give them (None: not given)
            spec = PackingSpec.resolve(spec, {"capacity": capacity, "strategy": strategy, "overlong": overlong,
                                              "max_sequences_per_bin": max_sequences_per_bin},
                                       defaults={"strategy": None, "overlong": None})
            if spec.seed is not None:
                raise InvalidArgumentError(f"spec.seed={spec.seed} does not apply: the sampler draws the packing seed "
                                           f"of every epoch from seed={self.seed}; leave spec.seed None")
            capacity, strategy, overlong, max_sequences_per_bin = (spec.capacity, spec.strategy, spec.overlong,
                                                                   spec.max_sequences_per_bin)
        self._read_data(data, capacity, strategy, overlong, max_sequences_per_bin)

    @classmethod
    def from_rows(cls, rows: Any, capacity: int | None = None, **kwargs: Any) -> DistributedPackedBatchSampler:
        """A sampler over rows that are **already packed**, yielding **row indices** (each row is one bin).

        For a dataset packed once and for all — :func:`padfree.pack_for_trainer`, :func:`padfree.pack_dataset`,
        ``padfree.SFTTrainer(packing=True)`` — whose rows are to be dealt to the ranks in balanced steps: every
        row's load is its tokens (``sum(seq_lens)``) and its attention cost (``Σ seq_lens²``).

        Args:
            rows: the sequence lengths of every row: a ``datasets.Dataset`` with a ``seq_lens`` column (read from
                its Arrow buffers; an indices mapping from ``select`` / ``shuffle`` honoured), or a sequence of
                per-row lists of lengths. Every row holds at least one sequence of at least one token.
            capacity: tokens per row, checked against the rows (``None``: the fullest row's tokens).
            **kwargs: ``num_replicas``, ``rank``, ``micro_batch_size``, ``seed``, ``shuffle``, ``remainder``,
                ``all_ranks`` as for the constructor (the packing arguments do not apply: the rows are packed).

        In this mode ``repeated_samples`` / ``dropped_samples`` name the sequences of the rows concerned (their
        positions in the concatenation of all rows' ``seq_lens``); ``schedule.repeated_bins`` /
        ``schedule.dropped_bins`` are the row indices.

        >>> rows = [[100], [10, 10], [60, 40], [5]]  # seq_lens of 4 rows: Σ len² 10000, 200, 5200, 25
        >>> ranks = [DistributedPackedBatchSampler.from_rows(rows, num_replicas=2, rank=r, seed=0) for r in (0, 1)]
        >>> [list(s) for s in ranks]  # per rank, the row of each step: the cheap pair together, the costly pair
        [[[3], [2]], [[1], [0]]]
        >>> ranks[0].capacity, ranks[0].schedule.num_steps
        (100, 2)
        """
        given = [k for k in ("strategy", "overlong", "max_sequences_per_bin") if kwargs.get(k) is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} do not apply to from_rows: the rows are packed already")
        plan = _rows_plan(rows, capacity)
        sampler = cls(plan, **kwargs)
        sampler._rows = True
        sampler._cache = None
        return sampler

    @classmethod
    def from_samples(cls, data: Any, *, micro_batch_size: int, **kwargs: Any) -> DistributedPackedBatchSampler:
        """A sampler of **unpacked** samples for padding-free batches: ``micro_batch_size`` sample indices per rank
        per step, the step drawn at random, its samples dealt to the ranks by load.

        For collators that flatten a micro-batch into one row without padding (:class:`~padfree.PaddingFreeCollator`,
        padfree's trainers in padding-free mode): a rank's cost is then its samples' tokens and Σ len², and a random
        sampler sharded by count hands one rank the long samples of a step while the others wait. Each step here
        takes the next ``num_replicas * micro_batch_size`` samples of a permutation drawn from ``(seed, epoch)`` —
        the samples a random sampler would put in one step — and only decides which rank computes which
        (:func:`padfree.packing.balance_bins` with ``group_by="random"``). The step's union is unchanged, so with a loss
        normalised over the whole step (padfree's trainers) the update is too.

        Args:
            data: per-sample lengths, or a ``datasets.Dataset`` with an ``input_ids`` column (lengths read from the
                Arrow offsets; an indices mapping honoured). Yields indices into it.
            micro_batch_size: samples per rank per step, ``>= 2`` (with one, the ranks of a step have nothing to
                trade).
            **kwargs: ``num_replicas``, ``rank``, ``seed``, ``shuffle`` (``False``: the samples in their own order),
                ``remainder``, ``all_ranks`` as for the constructor.

        >>> lengths = [900, 10, 30, 20, 800, 40, 25, 15]
        >>> ranks = [DistributedPackedBatchSampler.from_samples(lengths, micro_batch_size=2, num_replicas=2, rank=r,
        ...                                                     shuffle=False) for r in (0, 1)]
        >>> [list(s) for s in ranks]  # steps {0, 1, 2, 3} and {4, 5, 6, 7}: the long samples on different ranks
        [[[0, 1], [4, 7]], [[2, 3], [5, 6]]]
        """
        given = [k for k in ("capacity", "strategy", "overlong", "max_sequences_per_bin") if kwargs.get(k) is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} do not apply to from_samples: samples are not packed")
        mbs = as_positive_int(micro_batch_size, "micro_batch_size")
        if mbs < 2:  # type: ignore[operator]
            raise InvalidArgumentError(
                f"micro_batch_size must be >= 2 for from_samples, got {micro_batch_size}: with one sample per rank "
                f"per step, balancing could only change which samples share a step; use a plain sampler")
        lengths = _hf_lengths(data) if is_hf_dataset(data) else data
        try:
            lengths = as_lengths(lengths, "data")
        except InvalidLengthsError as exc:
            raise InvalidLengthsError(f"{exc}; data must be per-sample lengths or a datasets.Dataset with "
                                      f"input_ids") from None
        n = lengths.shape[0]
        plan = PackResult(lengths=lengths, capacity=max(int(lengths.max()) if n else 1, 1),
                          order=np.arange(n, dtype=np.int64), bin_offsets=np.arange(n + 1, dtype=np.int64),
                          strategy="samples")
        sampler = cls(plan, micro_batch_size=mbs, **kwargs)
        sampler._rows = True  # bin i is sample i
        sampler._group_by = "random"
        sampler._cache = None
        return sampler

    # ---- the data ----------------------------------------------------------------------------------

    def _read_data(self, data: Any, capacity: Any, strategy: Any, overlong: Any, max_items: Any) -> None:
        from padfree.data.datasets import PackingDataset

        given = [name for name, value in (("strategy", strategy), ("overlong", overlong),
                                          ("max_sequences_per_bin", max_items)) if value is not None]
        if isinstance(data, (PackResult, PackingDataset)):
            kind = "a PackResult" if isinstance(data, PackResult) else "a PackingDataset"
            if given:
                raise InvalidArgumentError(
                    f"{', '.join(given)} apply only when data is per-sample lengths; data is {kind}, which was "
                    f"packed already: leave them out (or pass the lengths instead)"
                )
            own = data.capacity if isinstance(data, PackResult) else data.max_length
            if capacity is not None and as_positive_int(capacity, "capacity") != own:
                raise InvalidArgumentError(f"capacity={capacity} differs from the capacity {own} of {kind}; leave "
                                           f"capacity out or pass {own}")
            self.capacity: int = own
            if isinstance(data, PackingDataset):
                self._dataset = data
                self.epoch = data.epoch  # adopt it: setting ours on the dataset would clear its resume point
            else:
                if data.piece_starts is not None:
                    raise InvalidArgumentError(
                        "data is a PackResult with sequences split across rows (overlong='split'); sample indices "
                        "cannot name a piece of a sample: pass a PackingDataset built with overlong='split' instead"
                    )
                self._plan = data
            return
        if is_hf_dataset(data):
            data = _hf_lengths(data)
        elif isinstance(data, torch.utils.data.Dataset) or hasattr(data, "column_names"):
            raise InvalidArgumentError(
                f"data is a dataset of samples ({describe(data)}); pass its per-sample lengths and give the dataset "
                f"to the DataLoader, or pass a datasets.Dataset with an input_ids column, or a PackingDataset"
            )
        try:
            lengths = as_lengths(data, "data")
        except InvalidLengthsError as exc:
            raise InvalidLengthsError(f"{exc}; data must be per-sample lengths, a datasets.Dataset with input_ids, "
                                      f"a PackResult or a PackingDataset") from None
        if capacity is None:
            raise InvalidArgumentError("capacity is required when data is per-sample lengths: pass the tokens per "
                                       "packed row, e.g. capacity=4096")
        overlong = "error" if overlong is None else as_choice(overlong, "overlong", OVERLONG_POLICIES)
        if overlong == "split":
            raise InvalidArgumentError(
                "overlong='split' cannot be used with sample indices (a sample index cannot name a piece of a "
                "sample); pass 'error', 'truncate' or 'drop', or a PackingDataset built with overlong='split'"
            )
        self._packer = Packer(capacity, DEFAULT_STRATEGY if strategy is None else strategy, overlong=overlong,
                              max_sequences_per_bin=max_items)
        if self._packer.spec.cuts_at_row_edges:
            raise InvalidArgumentError(
                f"strategy={self._packer.strategy!r} cuts samples at the rows' edges, and a sample index cannot name "
                f"a piece of a sample; choose another strategy, or pass a PackingDataset built with it")
        self.capacity = self._packer.capacity
        self._lengths = lengths
        if not STRATEGIES[self._packer.strategy].randomized:
            self._plan = self._packer.pack(lengths)
            self._log_overlong(self._plan)

    def _log_overlong(self, plan: PackResult) -> None:
        if self._logs() and (plan.truncated_tokens or plan.num_dropped):
            logger.warning(
                "DistributedPackedBatchSampler: overlong=%r truncated %d tokens in %d samples and dropped %d samples "
                "(%d tokens) longer than capacity=%d", self._packer.overlong if self._packer else None,
                plan.truncated_tokens, plan.num_truncated, plan.num_dropped, plan.dropped_tokens, self.capacity,
            )

    def _logs(self) -> bool:
        return self.all_ranks or self.rank == 0  # one process reports what every process computes identically

    # ---- epochs ----------------------------------------------------------------------------------

    @property
    def sampler(self) -> DistributedPackedBatchSampler:
        """This sampler itself. accelerate's prepared loader forwards ``set_epoch`` to
        ``batch_sampler.batch_sampler.sampler`` (the ``BatchSampler`` convention); without this attribute the epoch
        of a sampler wrapped in its ``BatchSamplerShard`` would never advance."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Use the schedule of ``epoch`` (deterministic in ``(seed, epoch)``); call it on every rank before iterating.

        A :class:`~padfree.PackingDataset` given as ``data`` is moved to the same epoch.
        """
        self.epoch = as_int(epoch, "epoch", minimum=0)  # type: ignore[assignment]
        if self._dataset is not None:
            self._dataset.set_epoch(self.epoch)

    def _current(self) -> _Epoch:
        plan = self._plan_of_epoch()
        cache = self._cache
        if cache is not None and cache.epoch == self.epoch and cache.plan is plan:
            return cache
        shuffle_seed = _derived_seed(self.seed, self.epoch, _SEED_STEPS) if self.shuffle else None
        schedule = balance_bins(plan, self.num_replicas, micro_batch_size=self.micro_batch_size,
                                remainder=self.remainder, seed=shuffle_seed, group_by=self._group_by)
        if shuffle_seed is not None and schedule.num_steps:
            # which rank takes which micro-batch of a step: balance_bins deals them by load, so without this the
            # same rank would always get the heaviest one of its step
            rng = np.random.default_rng(_derived_seed(self.seed, self.epoch, _SEED_STEPS + 1))
            perm = np.argsort(rng.random((schedule.num_steps, self.num_replicas)), axis=1)
            schedule = dataclasses.replace(schedule, steps=np.take_along_axis(schedule.steps, perm[:, :, None], 1))
        row_of_bin = None
        if self._rows:
            row_of_bin = np.arange(plan.num_bins, dtype=np.int64)
        elif self._dataset is not None:
            row_of_bin = np.empty(plan.num_bins, np.int64)
            row_of_bin[self._dataset.order] = np.arange(plan.num_bins, dtype=np.int64)  # inverse of row -> bin
        self._cache = _Epoch(self.epoch, plan, schedule, row_of_bin)
        self._log_remainder(self._cache)
        return self._cache

    def _plan_of_epoch(self) -> PackResult:
        if self._dataset is not None:
            ds = self._dataset
            if ds.epoch != self.epoch:
                ds.set_epoch(self.epoch)
            if len(ds) != ds.plan.num_bins:
                raise InvalidArgumentError(
                    f"the PackingDataset was resumed with load_state_dict ({ds.plan.num_bins - len(ds)} rows of epoch "
                    f"{ds.epoch} skipped), which renumbers its rows; with this sampler resume by skipping batches "
                    f"(the Trainer and accelerate.skip_first_batches do) over a dataset that was not resumed"
                )
            return ds.plan
        if self._packer is not None and STRATEGIES[self._packer.strategy].randomized:
            seed = _derived_seed(self.seed, self.epoch, _SEED_PACK)
            if self._plan is None or self._plan.seed != seed:
                self._plan = self._packer.pack(self._lengths, seed=seed)
                self._log_overlong(self._plan)
        return self._plan

    def _log_remainder(self, ep: _Epoch) -> None:
        if not self._logs():
            return
        s = ep.schedule
        for bins, what, level in ((s.dropped_bins, "left out", logging.WARNING),
                                  (s.repeated_bins, "scheduled a second time", logging.INFO)):
            if bins.size:
                logger.log(
                    level, "DistributedPackedBatchSampler: remainder=%r %s %d of %d rows (%d samples, %d tokens) in "
                    "epoch %d so that all %d ranks get %d steps of %d rows", self.remainder, what, bins.size,
                    ep.plan.num_bins, self._samples_of(ep.plan, bins).size, int(s.tokens[bins].sum()), ep.epoch,
                    self.num_replicas, s.num_steps, self.micro_batch_size,
                )

    # ---- what the epoch is made of ---------------------------------------------------------------

    @property
    def plan(self) -> PackResult:
        """The packing plan of the current epoch (bins of sample ids)."""
        return self._current().plan

    @property
    def schedule(self) -> BalancedSteps:
        """The current epoch's steps: ``schedule.steps[s, r]`` are the bins of rank ``r`` in step ``s``, with the
        imbalance metrics of :class:`~padfree.packing.BalancedSteps`."""
        return self._current().schedule

    @property
    def dropped_samples(self) -> np.ndarray:
        """``(d,) int64`` — sample ids in the rows that ``remainder="drop"`` leaves out of the current epoch."""
        ep = self._current()
        return self._samples_of(ep.plan, ep.schedule.dropped_bins)

    @property
    def repeated_samples(self) -> np.ndarray:
        """``(r,) int64`` — sample ids in the rows that ``remainder="repeat"`` schedules twice in the current epoch
        (once per repeat; a sample split into pieces appears once per repeated piece)."""
        ep = self._current()
        return self._samples_of(ep.plan, ep.schedule.repeated_bins)

    @staticmethod
    def _samples_of(plan: PackResult, bins: np.ndarray) -> np.ndarray:
        """Sample ids of ``bins`` (in that order), bin after bin: one gather, no loop over samples."""
        return plan.take_bins(bins).order

    def summary(self) -> str:
        """The current epoch in two lines: rows, steps, what was dropped or repeated, and the imbalance left."""
        ep = self._current()
        s = ep.schedule
        rest = (f"{s.dropped_bins.size} rows dropped ({self.dropped_samples.size} samples, "
                f"{int(s.tokens[s.dropped_bins].sum())} tokens), {s.repeated_bins.size} repeated"
                if s.dropped_bins.size else
                f"0 rows dropped, {s.repeated_bins.size} repeated ({self.repeated_samples.size} samples, "
                f"{int(s.tokens[s.repeated_bins].sum())} tokens)")
        return (
            f"epoch {ep.epoch}: {ep.plan.num_bins} rows of {ep.plan.num_sequences} samples -> {s.num_steps} steps x "
            f"{self.num_replicas} ranks x {self.micro_batch_size} rows; {rest};\nidle from imbalance: tokens "
            f"{100 * s.token_imbalance:.3f}%, attention cost {100 * s.cost_imbalance:.3f}%"
        )

    def fingerprint(self) -> str:
        """A digest of what every rank must agree on: the arguments, and the current epoch's plan and schedule."""
        import hashlib

        ep = self._current()
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.num_replicas, self.micro_batch_size, self.seed, self.shuffle, self.remainder,
                       self._group_by, self._rows, self.capacity, ep.epoch)).encode())
        for array in (ep.plan.lengths, ep.plan.order, ep.plan.bin_offsets, ep.schedule.steps):
            h.update(np.ascontiguousarray(array, np.int64).tobytes())
        return h.hexdigest()

    def check_ranks(self, group: Any = None) -> None:
        """Make sure every rank of the process group computed this same schedule; a collective call, so call it on
        every rank (padfree's trainers do, once per ``train()``). Nothing to do without an initialised process group.

        Each rank builds its schedule alone, from its own copy of the data: a rank whose data differs (another
        shuffle before packing, a tokenizer of another version, a filter that depends on the host) would silently
        train other samples than the schedule promises, repeat some and lose others — or hang when the step counts
        differ. One ``all_gather_object`` of :meth:`fingerprint` rules that out.

        Raises:
            RankMismatchError: naming the ranks whose schedule differs from rank 0's.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return
        mine = (self.fingerprint(), len(self.plan.lengths), int(self.plan.lengths.sum()), len(self))
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        odd = [r for r, other in enumerate(every) if other != every[0]]
        if odd:
            seen = "; ".join(f"rank {r}: {n} samples, {t} tokens, {k} micro-batches"
                             for r, (_, n, t, k) in enumerate(every) if r in odd or r == 0)
            raise RankMismatchError(
                f"DistributedPackedBatchSampler: ranks {odd} computed another schedule than rank 0 ({seen}); every "
                f"rank must build the sampler from the same data and arguments (seed={self.seed}, "
                f"micro_batch_size={self.micro_batch_size}, epoch={self.epoch})")

    # ---- iteration -------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Micro-batches this sampler yields in the current epoch: the same on every rank (``num_replicas`` times
        more with ``all_ranks``)."""
        steps = self._current().schedule.num_steps
        return steps * self.num_replicas if self.all_ranks else steps

    def __iter__(self) -> Iterator[list[int]]:
        ep = self._current()
        steps = ep.schedule.steps  # (num_steps, num_replicas, micro_batch_size)
        # step-major, rank-minor: the order BatchSamplerShard deals back out to the processes
        bins = steps.reshape(-1, self.micro_batch_size) if self.all_ranks else steps[:, self.rank, :]
        if ep.row_of_bin is not None:
            yield from ep.row_of_bin[bins].tolist()
            return
        flat = bins.reshape(-1)
        indices = self._samples_of(ep.plan, flat)
        sizes = (ep.plan.bin_offsets[flat + 1] - ep.plan.bin_offsets[flat]).reshape(bins.shape).sum(axis=1)
        offsets = np.concatenate(([0], np.cumsum(sizes))).tolist()
        for a, b in itertools.pairwise(offsets):  # one slice per micro-batch
            yield indices[a:b].tolist()

    def __repr__(self) -> str:
        source = ("rows" if self._rows else "PackingDataset" if self._dataset is not None else "lengths"
                  if self._packer else "PackResult")
        return (
            f"DistributedPackedBatchSampler(data={source}, capacity={self.capacity}, num_replicas={self.num_replicas}"
            f", rank={'all' if self.all_ranks else self.rank}, micro_batch_size={self.micro_batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle}, remainder={self.remainder!r}, epoch={self.epoch})"
        )

