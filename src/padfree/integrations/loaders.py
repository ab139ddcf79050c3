"""The train and eval loaders of padfree's trainers: balanced data-parallel steps, and a sequence-parallel group's
ranks loading the same batches.

:class:`BalancedLoaderMixin` gives a ``transformers.Trainer`` subclass (``padfree.Trainer``, ``padfree.SFTTrainer``)
its loaders: when training is data-parallel and the train set holds packed rows (a ``seq_lens`` column) or samples
that padfree's collator flattens, the train loader draws its micro-batches from a
:class:`~padfree.integrations.distributed.DistributedPackedBatchSampler` built by :func:`balanced_sampler` — the one
place that sets its seed (``args.data_seed``, else ``args.seed``), its remainder policy (``dataloader_drop_last``) and
its ranks — which packed DPO's micro-batches use too. :class:`SamplerEpoch` tells the sampler its epoch;
:func:`batch_sampler_dataloader` is the Trainer's loader with the sampler in it; :func:`balance_note` is what
:attr:`~padfree.integrations.status.PackingStatus.balance` says.

Under ``configure_packing(model, sequence_parallel=P)`` the ``P`` ranks of a group train on the same rows, each on
its slice. So the loaders deal batches to the *groups* (``W / P`` data-parallel replicas: every rank of a group
loads the same batch, :func:`loaders_for_group`) and each rank keeps its slice
(:func:`padfree.split_for_sequence_parallel`) right before the forward. Gradients need nothing new: DDP or FSDP2
over all ``W`` ranks sums the group's partial gradients and averages the replicas in one reduction, which padfree's
loss rule (the step's targets divided by ``W``) turns into the token mean of the whole step.
:func:`setup_sequence_parallel` configures a trainer's model for its groups; :func:`group_of` reads the group back.
accelerate's ``ParallelismConfig`` has no sequence-parallel dimension outside DeepSpeed (its ``sp_size`` routes the
Trainer into DeepSpeed's own loss and loader), so padfree prepares the loaders itself with accelerate's
``prepare_data_loader``, for the data-parallel rank and size of the group.

>>> import numpy as np
>>> from padfree.integrations.distributed import DistributedPackedBatchSampler
>>> sampler = DistributedPackedBatchSampler.from_rows([np.array([3, 1]), np.array([4]), np.array([2, 2])] * 2,
...                                                   num_replicas=2, all_ranks=True, micro_batch_size=1, seed=0)
>>> balance_note(sampler.schedule)  # doctest: +ELLIPSIS
'balanced across 2 ranks: 3 steps, token idle ...%, attention-cost idle ...%'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

from padfree.data.batch import PaddingFreeCollator
from padfree.errors import BackendUnavailableError, InvalidArgumentError
from padfree.integrations.decide import configure_model
from padfree.model.state import packing_state
from padfree.model.wrappers import unwrap_model
from padfree.packing.inputs import as_int
from padfree.sequence_parallel import SequenceParallel

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.loaders needs torch and transformers; pip install 'padfree[torch,hf]'"
    ) from exc

__all__ = ["BalancedLoaderMixin", "SamplerEpoch", "balance_note", "balanced_sampler", "batch_sampler_dataloader",
           "sequence_parallel_size", "setup_sequence_parallel"]


def balanced_sampler(trainer: Any, data: Any, kind: str, *, num_replicas: int, micro_batch_size: int) -> Any:
    """The all-ranks :class:`~padfree.DistributedPackedBatchSampler` of ``trainer``'s train set: over packed rows
    (``kind="rows"``: a dataset with ``seq_lens``, or each row's sequence lengths) or samples (``"samples"``), seeded
    from ``args.data_seed`` (else ``args.seed``), an uneven remainder dropped with ``dataloader_drop_last``, else
    scheduled twice."""
    from padfree.integrations.distributed import DistributedPackedBatchSampler

    args = trainer.args
    seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
    build = DistributedPackedBatchSampler.from_rows if kind == "rows" else DistributedPackedBatchSampler.from_samples
    return build(data, num_replicas=num_replicas, all_ranks=True, micro_batch_size=micro_batch_size, seed=seed,
                 remainder="drop" if args.dataloader_drop_last else "repeat")


def balance_note(schedule: Any, unit: str = "ranks", per_rank: str | None = None) -> str:
    """What :attr:`PackingStatus.balance` says of a balanced schedule (:class:`~padfree.BalancedSteps`): the ranks
    (or groups) it deals to, its steps (``per_rank``: what each rank gets in one) and the idle time left."""
    steps = f"{schedule.num_steps} steps" + ("" if per_rank is None else f" x {per_rank} per rank")
    return (f"balanced across {schedule.num_ranks} {unit}: {steps}, token idle {100 * schedule.token_imbalance:.1f}%, "
            f"attention-cost idle {100 * schedule.cost_imbalance:.1f}%")


def batch_sampler_dataloader(trainer: Any, sampler: Any) -> Any:
    """The train ``DataLoader`` the ``Trainer`` would build, with ``sampler`` as its ``batch_sampler`` (a balanced
    :class:`~padfree.DistributedPackedBatchSampler` with ``all_ranks=True``), prepared by accelerate."""
    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    args = trainer.args
    # what Trainer._get_dataloader passes, with the balanced batch sampler in place of batch_size / sampler;
    # accelerate's prepare re-shards it (process p keeps micro-batches p, p + W, ...: rank p's own)
    dataset = trainer._remove_unused_columns(trainer.train_dataset, description="Training")
    params = {
        "batch_sampler": sampler,
        "collate_fn": trainer.data_collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "multiprocessing_context": args.dataloader_multiprocessing_context,
        "prefetch_factor": args.dataloader_prefetch_factor,
        "in_order": args.dataloader_in_order,
        "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
    }
    # every rank gets the same number of micro-batches (a multiple of the replicas), so evening them adds nothing;
    # and accelerate < 1.11 refuses to even a batch sampler without a batch_size
    accelerator = trainer.accelerator
    even = accelerator.even_batches
    accelerator.even_batches = False
    try:
        return accelerator.prepare(DataLoader(dataset, **params))
    finally:
        accelerator.even_batches = even


# ---- a sequence-parallel group's trainer: its model, its loaders ----------------------------------------------------


def group_of(model: Any) -> SequenceParallel | None:
    """The sequence-parallel group of the transformers model inside ``model`` (None: none, or not configured)."""
    base = unwrap_model(model)
    state = packing_state(base) if base is not None else None
    return None if state is None else state.sp


def sequence_parallel_size(value: Any, name: str) -> int:
    """``value`` as a sequence-parallel size: the ranks that split one row, an integer >= 1 (None: 1)."""
    return 1 if value is None else as_int(value, name, minimum=1)


def _prepare(accelerator: Any, sp: SequenceParallel, data_loader: Any, device_placement: Any = None,
             slice_fn_for_dispatch: Any = None) -> Any:
    """``accelerator.prepare_data_loader`` for the data-parallel replicas of ``sp``: ranks of one group load the
    same batches."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import DistributedType

    if accelerator.dispatch_batches:
        raise InvalidArgumentError(
            "accelerate's dispatch_batches with sequence parallelism: process 0 would deal different slices of "
            "batches to the ranks of a group; set dispatch_batches=False (accelerator_config)")
    if device_placement is None:
        device_placement = accelerator.device_placement if accelerator.distributed_type != DistributedType.XLA \
            else False
    prepared = prepare_data_loader(
        data_loader, accelerator.device, num_processes=sp.dp_size, process_index=sp.dp_rank,
        split_batches=accelerator.split_batches, put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    accelerator._dataloaders.append(prepared)  # where accelerate keeps them for save_state / load_state
    return prepared


@contextlib.contextmanager
def loaders_for_group(accelerator: Any, sp: SequenceParallel | None) -> Iterator[None]:
    """Inside the block, the loaders ``accelerator`` prepares are dealt to the data-parallel replicas of ``sp``
    (every rank of a group the same batches) instead of to every process; no effect when ``sp`` is None."""
    if sp is None:
        yield
        return
    original = accelerator.prepare_data_loader

    def prepare(data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None) -> Any:
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return original(data_loader, device_placement, slice_fn_for_dispatch)
        return _prepare(accelerator, sp, data_loader, device_placement, slice_fn_for_dispatch)

    accelerator.prepare_data_loader = prepare  # this accelerator only, for the duration of the block
    try:
        yield
    finally:
        del accelerator.prepare_data_loader


def setup_sequence_parallel(model: Any, args: Any, size: int, loss: str | None) -> None:
    """Configure ``model`` to split every forward across groups of ``size`` ranks (nothing for 1): the process
    group is set up from the launcher's environment through ``args`` first, as the Trainer would."""
    if size <= 1:
        return
    import transformers

    if not isinstance(args, transformers.TrainingArguments):
        raise InvalidArgumentError(f"sequence parallelism needs the trainer's args (TrainingArguments) to set up "
                                   f"torch.distributed, got {type(args).__name__}")
    _ = args.device  # transformers initialises the process group from the launcher's variables here
    configure_model(model, sequence_parallel=size)


class SamplerEpoch(TrainerCallback):
    """Checks at the start of training that every rank scheduled the same data, and tells the balanced sampler its
    epoch at the start of every epoch, resumed ones included.

    The Trainer's own ``set_epoch`` call does not reach it when a run resumes in the middle of an epoch: accelerate's
    ``skip_first_batches`` wraps the sampler once more (``SkipBatchSampler`` around ``BatchSamplerShard``), and
    neither wrapper forwards ``set_epoch``, so the resumed epoch would replay epoch 0's schedule. ``state.epoch`` is
    ``e + k / n`` inside epoch ``e`` (``k < n`` steps done of ``n``), exactly ``e`` at its start.
    """

    sampler: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # every rank passes here in train() (a user may call get_train_dataloader on one rank alone): the one place
        # for a collective check that the ranks scheduled the same data
        if self.sampler is not None:
            self.sampler.check_ranks()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(int(state.epoch or 0))


class BalancedLoaderMixin:
    """The loaders of a ``transformers.Trainer`` subclass (before it in the bases): balanced data-parallel steps
    over packed rows or flattened samples, and the batches of padfree's sequence-parallel groups.

    ``_padfree_epoch`` (a :class:`SamplerEpoch` among the trainer's callbacks) must be set before the train loader is
    built; ``padfree_balance=False`` keeps the Trainer's sampler.
    """

    padfree_balance: bool = True
    _padfree_balanced: tuple[Any, Any] | None = None
    _padfree_epoch: SamplerEpoch

    # ---- which ranks load what -------------------------------------------------------------------------

    def _padfree_sp(self) -> Any:
        """The sequence-parallel group of the configured model (None: none)."""
        return group_of(getattr(self, "model", None))

    def _padfree_replicas(self, *, sequence_parallel: bool = True) -> int:
        """Ranks that see the same batch (tensor / context / sequence parallel groups, as transformers counts, and
        padfree's sequence-parallel group unless ``sequence_parallel=False``)."""
        n = 1
        for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
            getter = getattr(self, name, None)
            if callable(getter):
                n *= int(getter())
        sp = self._padfree_sp()
        if sequence_parallel and sp is not None:
            n *= sp.size
        return max(n, 1)

    def _padfree_data_replicas(self, processes: int) -> int:
        """How many different batches ``processes`` ranks load: all of them, or under padfree's sequence
        parallelism one per group (its ranks load the same ones)."""
        sp = self._padfree_sp()
        return processes if sp is None else processes // sp.size

    def get_total_train_batch_size(self, args: Any) -> int:
        """The Trainer's count of samples per optimizer step, over padfree's sequence-parallel group too."""
        return max(self._padfree_data_replicas(super().get_total_train_batch_size(args)), 1)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        with loaders_for_group(self.accelerator, self._padfree_sp()):
            return super().get_eval_dataloader(eval_dataset)

    def get_train_dataloader(self) -> Any:
        sampler = self._padfree_balanced_sampler()
        with loaders_for_group(self.accelerator, self._padfree_sp()):  # a group's ranks load the same batches
            if sampler is None:
                return super().get_train_dataloader()
            return batch_sampler_dataloader(self, sampler)

    # ---- balanced data-parallel steps -------------------------------------------------------------------

    def _padfree_balance_kind(self) -> str | None:
        """``"rows"`` (the train set holds packed rows), ``"samples"`` (unpacked samples that padfree's collator
        flattens into one row per micro-batch), or None (nothing padfree knows how to balance)."""
        columns = getattr(getattr(self, "train_dataset", None), "column_names", None) or ()
        if "seq_lens" in columns:
            return "rows"
        flattens = isinstance(self.data_collator, PaddingFreeCollator)  # PackedRowsCollator included
        return "samples" if flattens and "input_ids" in columns else None

    def _padfree_balance_check(self) -> tuple[bool, str | None]:
        """``(balance, note)``: whether the train loader deals micro-batches in balanced steps, and what
        :attr:`PackingStatus.balance` says (None where there is nothing to balance: one process, other data)."""
        args = self.args
        processes = int(getattr(args, "world_size", 1) or 1)
        world = self._padfree_data_replicas(processes)  # under sequence parallelism: deal to the groups
        kind = self._padfree_balance_kind()
        if world <= 1 or kind is None:
            return False, None
        where = f"{world} ranks" if self._padfree_sp() is None else f"{world} data-parallel groups"
        default = f"the Trainer's sampler shards {'rows' if kind == 'rows' else 'samples'} by count"
        if not self.padfree_balance:
            return False, f"not balanced across {where} (padfree_balance=False): {default}"
        from padfree.integrations.distributed import is_hf_dataset

        dataset = self.train_dataset
        why = None
        if not is_hf_dataset(dataset):
            why = f"the train dataset is a {type(dataset).__name__}, not a datasets.Dataset"
        elif self._padfree_replicas(sequence_parallel=False) > 1:
            why = "tensor / context / sequence parallel ranks share batches"
        elif getattr(args, "train_sampling_strategy", "random") != "random":
            why = f"train_sampling_strategy={args.train_sampling_strategy!r} chooses the sampler"
        elif getattr(self.accelerator, "split_batches", False) or getattr(self.accelerator, "dispatch_batches", False):
            why = "accelerate's split_batches / dispatch_batches is on"
        elif self.accelerator.num_processes != processes:
            why = f"accelerate runs {self.accelerator.num_processes} processes for world_size={processes}"
        elif kind == "samples" and int(self._train_batch_size) < 2:
            why = "one sample per rank per step: balancing would have to change which samples share a step"
        if why is not None:
            return False, f"not balanced across {where} ({why}): {default}"
        return True, None

    def _padfree_balanced_sampler(self) -> Any:
        """The all-ranks :class:`DistributedPackedBatchSampler` over the train rows or samples, or None (the
        Trainer's own sampler). Built once per train dataset and micro-batch size."""
        on, _ = self._padfree_balance_check()
        if not on:
            return None
        dataset, mbs = self.train_dataset, int(self._train_batch_size)
        cached = self._padfree_balanced
        if cached is not None and cached[0] is dataset and cached[1].micro_batch_size == mbs:
            return cached[1]
        # a sequence-parallel group is one replica: its ranks load the same micro-batches
        sampler = balanced_sampler(self, dataset, self._padfree_balance_kind(), micro_batch_size=mbs,
                                   num_replicas=self._padfree_data_replicas(self.accelerator.num_processes))
        self._padfree_balanced = (dataset, sampler)
        self._padfree_epoch.sampler = sampler
        return sampler

    def _padfree_balance_note(self) -> str | None:
        """What :attr:`PackingStatus.balance` says at construction (the schedule of epoch 0)."""
        on, note = self._padfree_balance_check()
        if not on:
            return note
        schedule = self._padfree_balanced_sampler().schedule
        what = "rows" if self._padfree_balance_kind() == "rows" else "samples (random steps, dealt by load)"
        unit = "ranks" if self._padfree_sp() is None else "data-parallel groups"
        return balance_note(schedule, unit, f"{schedule.steps.shape[2]} {what}")
