"""padfree's ``transformers.Trainer``: the loss rule, the telemetry and balanced data-parallel steps, for any
``Trainer`` subclass.

:class:`PadfreeTrainerMixin` holds what padfree adds to a ``Trainer``: the loss rule of
:mod:`padfree.integrations.step_loss` over every optimizer step, ``eval_loss`` under the same rule,
:class:`~padfree.integrations.telemetry.PackingTelemetryCallback`, and packed rows dealt to data-parallel ranks in
balanced steps (:mod:`padfree.integrations.distributed`). :class:`Trainer` is ``transformers.Trainer`` with it and
``configure_packing`` (called when the collator is one of padfree's, so the model either honours packed rows or
refuses); :func:`padfree.enable` does the same for your own subclass, and ``padfree.SFTTrainer`` for TRL's.

>>> import transformers
>>> issubclass(Trainer, transformers.Trainer) and issubclass(Trainer, PadfreeTrainerMixin)
True
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from padfree.data.batch import PackedCollator, PaddingFreeCollator
from padfree.errors import BackendUnavailableError, InvalidArgumentError
from padfree.integrations.decide import configure_model
from padfree.integrations.sequence_parallel import sequence_parallel_size, setup_sequence_parallel
from padfree.integrations.status import PACKING, PADDING_FREE, STANDARD, PackingStatus, model_facts
from padfree.integrations.step_loss import (
    LOSS_MODES,
    LossRule,
    StepCounts,
    refuse_with_own_nll,
    step_counts,
    token_losses,
)
from padfree.integrations.telemetry import PackingTelemetryCallback, TelemetryLogMixin
from padfree.model.wrappers import unwrap_model
from padfree.packing.inputs import as_choice, as_flag

try:
    import torch
    import transformers
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.trainer needs torch and transformers; pip install 'padfree[torch,hf]'"
    ) from exc

__all__ = [
    "PadfreeTrainerMixin", "SamplerEpoch", "Trainer", "TrainerMixin", "batch_sampler_dataloader",
]

logger = logging.getLogger("padfree")


class PadfreeTrainerMixin(TelemetryLogMixin):
    """The loss rule and the telemetry for a ``transformers.Trainer`` subclass (put it first in the bases).

    Set up by :meth:`_padfree_setup` (padfree's trainers call it from ``__init__``). Overrides
    ``get_batch_samples`` (counts the step's targets and sequences across ranks), ``compute_loss`` (the loss rule),
    ``evaluation_loop`` / ``prediction_step`` (``eval_loss`` under the same rule over the whole eval set),
    ``training_step`` (feeds the telemetry), ``log`` (adds the telemetry to the logged metrics) and
    ``get_train_dataloader`` (balanced data-parallel steps over packed rows, see below).

    **Balanced steps.** When training is data-parallel (``args.world_size > 1``) and the train dataset holds packed
    rows (a ``seq_lens`` column: :func:`~padfree.pack_for_trainer`, ``padfree.SFTTrainer(packing=True)``), the
    train loader draws its micro-batches from a
    :class:`~padfree.integrations.distributed.DistributedPackedBatchSampler` over the rows
    (:meth:`~padfree.integrations.distributed.DistributedPackedBatchSampler.from_rows`) instead of the Trainer's
    sampler, which shards rows by count: every step gives each rank ``per_device_train_batch_size`` rows
    of nearly equal tokens and Σ len², so no rank waits at every step for the one that drew the long sequences.
    Seeded from ``args.data_seed`` (else ``args.seed``), a new order every epoch (the Trainer calls ``set_epoch``);
    ``dataloader_drop_last=True`` leaves the cheapest rows of an uneven remainder out, otherwise they are
    scheduled twice (logged). Padding-free batches (unpacked samples that padfree's collator flattens into one row
    per micro-batch) are balanced too, without changing what a step trains: each step takes ``world_size *
    per_device_train_batch_size`` samples of a seeded random permutation, as the Trainer's sampler would, and
    only deals them to the ranks by load (``DistributedPackedBatchSampler.from_samples``; needs
    ``per_device_train_batch_size >= 2``). Under padfree's sequence parallelism the micro-batches are dealt to the
    data-parallel groups (the ranks of a group train the same ones). Off with ``padfree_balance=False``; skipped
    (reason in :class:`~padfree.integrations.status.PackingStatus`) with tensor / context / DeepSpeed sequence
    parallelism, a ``train_sampling_strategy`` other than ``"random"``, or accelerate's ``split_batches`` /
    ``dispatch_batches``. One process: the Trainer's own loader, unchanged.
    """

    padfree_loss: str | None = None
    padfree_balance: bool = True
    padfree_fused_loss: bool = False
    _padfree_balanced: tuple[Any, Any] | None = None
    _padfree_status: PackingStatus | None = None
    _padfree_telemetry: PackingTelemetryCallback | None = None
    _padfree_step: StepCounts | None = None
    _padfree_epoch: SamplerEpoch
    _padfree_eval_sums: torch.Tensor | None = None

    def _padfree_setup(self, loss: str | None, telemetry: bool) -> None:
        self.padfree_loss = None if loss is None else as_choice(loss, "padfree_loss", LOSS_MODES)
        self._padfree_epoch = SamplerEpoch()
        self.callback_handler.add_callback(self._padfree_epoch)
        if self.padfree_loss is not None:
            # compute_loss normalises over the whole optimizer step; the Trainer must not divide by the
            # accumulation steps again
            self.loss_is_scaled_for_ga = True
        if telemetry:
            self._padfree_attach_telemetry()

    def _padfree_telemetry_options(self) -> dict[str, Any]:
        return {"pad_token_ids": _pad_ids(self)}  # packed rows may end in a padding tail

    # ---- counting the step ---------------------------------------------------------------------------

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

    def _padfree_world(self) -> int:
        """Ranks whose gradients DDP averages: the data-parallel replicas, and within them the ranks of padfree's
        sequence-parallel group (each holds its slice's share of the gradient; the average over all of them, times
        this count, is the step's sum)."""
        return max(self.accelerator.num_processes // self._padfree_replicas(sequence_parallel=False), 1)

    # ---- sequence parallelism ----------------------------------------------------------------------------

    def _padfree_sp(self) -> Any:
        """The sequence-parallel group of the configured model (None: none)."""
        from padfree.integrations.sequence_parallel import group_of

        return group_of(getattr(self, "model", None))

    def _padfree_data_replicas(self, processes: int) -> int:
        """How many different batches ``processes`` ranks load: all of them, or under padfree's sequence
        parallelism one per group (its ranks load the same ones)."""
        sp = self._padfree_sp()
        return processes if sp is None else processes // sp.size

    def _padfree_slice_checked(self, inputs: Any) -> None:
        """Under sequence parallelism the per-sequence rule weighs a slice's token losses by its sequences' targets
        on every rank, which only the slice :meth:`_prepare_inputs` cut carries: refuse inputs that lost it (a plain
        copy of the dict) rather than count a slice's part of a sequence as a whole one."""
        if self.padfree_loss != "sequence" or self._padfree_sp() is None:
            return
        if getattr(inputs, "target_weights", None) is None and (
                inputs.get("labels") is not None or inputs.get("shift_labels") is not None):
            raise InvalidArgumentError(
                f"padfree_loss='sequence' with sequence parallelism needs the slice _prepare_inputs returns "
                f"(padfree.sequence_parallel.SequenceParallelSlice, which carries its sequences' whole-row target "
                f"counts); compute_loss got a {type(inputs).__name__}: pass the inputs on as they are, not a copy")

    def _prepare_inputs(self, inputs: Any) -> Any:
        """The Trainer's device placement, then, under sequence parallelism, this rank's slice of the batch (its
        tokens, the row's positions, labels shifted across the slice edges); a slice is never split twice."""
        inputs = super()._prepare_inputs(inputs)
        sp = self._padfree_sp()
        if sp is None or not isinstance(inputs, Mapping):
            return inputs
        from padfree.sequence_parallel import split_for_sequence_parallel

        return split_for_sequence_parallel(inputs, sp, pad_token_id=_pad_ids(self)[-1])

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        from padfree.integrations.sequence_parallel import loaders_for_group

        with loaders_for_group(self.accelerator, self._padfree_sp()):
            return super().get_eval_dataloader(eval_dataset)

    def get_total_train_batch_size(self, args: Any) -> int:
        """The Trainer's count of samples per optimizer step, over padfree's sequence-parallel group too."""
        return max(self._padfree_data_replicas(super().get_total_train_batch_size(args)), 1)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        if self.padfree_loss is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        self._padfree_step = None
        if not batch_samples or not all(isinstance(b, Mapping) and ("labels" in b or "shift_labels" in b)
                                        for b in batch_samples):
            return batch_samples, None
        many = self.accelerator.num_processes > 1
        self._padfree_step = step_counts(batch_samples, device, self.accelerator.gather if many else None,
                                         self._padfree_replicas() if many else 1)
        return batch_samples, self._padfree_step.targets

    @property
    def _padfree_rule(self) -> LossRule | None:
        """The loss rule this trainer applies (None: the Trainer's own loss)."""
        return None if self.padfree_loss is None else LossRule(self.padfree_loss)

    def _padfree_denominator(self, num_items_in_batch: Any) -> torch.Tensor | None:
        """The loss rule's denominator: the step's count over the world size, or None outside a counted step."""
        if num_items_in_batch is None or self._padfree_step is None or not self.model.training:
            return None
        return self._padfree_rule.denominator(self._padfree_step, self._padfree_world())

    # ---- the loss --------------------------------------------------------------------------------------

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if (self.padfree_loss is None or ("labels" not in inputs and "shift_labels" not in inputs)
                or self.label_smoother is not None or self.compute_loss_func is not None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        self._padfree_slice_checked(inputs)
        if self._padfree_fuses(return_outputs):
            return self._padfree_fused(model, inputs, num_items_in_batch)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        outputs = model(**model_inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        loss_tok, mask = token_losses(logits, inputs)
        denom = self._padfree_denominator(num_items_in_batch)
        loss = self._padfree_rule.reduce(loss_tok, mask, inputs, denom, shifted="shift_labels" not in inputs)
        loss = self._padfree_unscaled(loss, denom)
        if self._padfree_eval_sums is not None and not self.model.training:
            self._padfree_eval_record(loss, inputs)
        return (loss, outputs) if return_outputs else loss

    def _padfree_fuses(self, return_outputs: bool) -> bool:
        """Whether this training micro-batch's loss is :func:`padfree.causal_lm_loss` (``padfree_fused_loss``):
        only in training, when nobody asked for the logits."""
        return bool(self.padfree_fused_loss and self.padfree_loss is not None and self.model.training
                    and not return_outputs)

    def _padfree_fused(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """The loss of one training micro-batch without logits: the LM head and the cross-entropy fused over the
        positions that have a target, divided by the step's targets (sequence rule: each label weighted by
        1 / its sequence's targets, divided by the step's sequences) — or by this batch's own count, then the
        accumulation mean — plus a MoE model's router loss as its own forward would add it."""
        from padfree.model.loss import causal_lm_loss

        rule = self._padfree_rule
        denom = self._padfree_denominator(num_items_in_batch)
        # the loss rule's batch without targets is 0 (reduce_loss); causal_lm_loss's mean, as transformers', is NaN
        count = rule.nonempty(denom if denom is not None else rule.batch_count(inputs))
        weights = rule.weights(inputs)
        if getattr(self, "aux_loss_enabled", False):  # TRL asks MoE models for their router logits
            inputs = {**inputs, "output_router_logits": True}
        if not self._padfree_logit_metrics:
            loss = causal_lm_loss(model, inputs, num_items_in_batch=count, weights=weights)
            return self._padfree_unscaled(loss, denom)
        loss, stats = causal_lm_loss(model, inputs, num_items_in_batch=count, with_stats=True, weights=weights)
        self._padfree_fused_metrics(stats, inputs)
        return self._padfree_unscaled(loss, denom)

    #: whether this trainer logs metrics of the logits (entropy, token accuracy): the fused loss then counts them
    _padfree_logit_metrics = False

    def _padfree_fused_metrics(self, stats: dict[str, torch.Tensor], inputs: dict[str, Any]) -> None:
        """Log what would have come from the logits, from the fused loss's entropy and top-1 counts."""

    def _padfree_unscaled(self, loss: torch.Tensor, denom: Any) -> torch.Tensor:
        """A training micro-batch normalised by its own count (no step count) still owes the accumulation mean."""
        if denom is None and self.model.training and self.padfree_loss is not None:
            return loss / self.current_gradient_accumulation_steps
        return loss

    # ---- evaluation --------------------------------------------------------------------------------------

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        """The Trainer's loop, with ``{metric_key_prefix}_loss`` replaced by the loss rule over the whole eval set:
        Σ token losses / Σ targets (``padfree_loss="sequence"``: the mean of every sequence's mean token loss).

        The Trainer reports the mean of its per-batch means instead, which weights a target by how few others share
        its batch: the number would change with ``eval_packing``, padding-free flattening and the eval batch size,
        so packed and unpacked evaluation of the same model would disagree. Each batch's loss times its target (or
        sequence) count is summed in float64 on the device; one sync at the end of the loop.
        """
        if self.padfree_loss is None:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        # Σ loss · count, Σ count, prediction steps, steps whose loss went through padfree's compute_loss
        self._padfree_eval_sums = torch.zeros(4, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            sums = self._padfree_eval_sums
        finally:
            self._padfree_eval_sums = None
        key = f"{metric_key_prefix}_loss"
        if key not in output.metrics:
            return output
        why = self._padfree_eval_inexact(dataloader)
        if why is None:
            if self.accelerator.num_processes > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
            total, count, steps, recorded = sums.tolist()
            if steps == recorded and count > 0:
                output.metrics[key] = total / count
                return output
            why = ("no batch had a target" if count == 0 else
                   f"{int(steps - recorded)} of {int(steps)} batches had no labels or bypassed compute_loss")
        logger.info("padfree: %s is the Trainer's mean of per-batch means, not the %s mean of the loss rule: %s",
                    key, self.padfree_loss, why)
        return output

    def _padfree_eval_inexact(self, dataloader: Any) -> str | None:
        """Why the eval set's loss sums cannot be added up exactly across ranks (None: they can)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return None
        if getattr(acc, "split_batches", False) or getattr(acc, "dispatch_batches", False):
            return "accelerate's split_batches / dispatch_batches is on"
        if not getattr(acc, "even_batches", True):
            return None
        rows = len(dataloader.dataset) if hasattr(getattr(dataloader, "dataset", None), "__len__") else None
        per_round = self._padfree_data_replicas(acc.num_processes) * self.args.eval_batch_size
        if rows is not None and rows % per_round == 0:
            return None
        # accelerate evens the ranks' last batches by repeating rows from the start: their losses would count twice
        return (f"{rows if rows is not None else 'an unknown number of'} eval rows are not a multiple of "
                f"{acc.num_processes} ranks x eval batch size {self.args.eval_batch_size}, so accelerate repeats "
                f"some rows in the last batch")

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        if self._padfree_eval_sums is not None:
            self._padfree_eval_sums[2] += 1
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _padfree_eval_record(self, loss: torch.Tensor, inputs: dict[str, Any]) -> None:
        """Add one eval batch's loss (its own token or sequence mean) back up into a sum and a count."""
        count = self._padfree_rule.batch_count(inputs).to(self._padfree_eval_sums)
        acc = self._padfree_eval_sums
        acc[0] += loss.detach().to(acc) * count
        acc[1] += count
        acc[3] += 1

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
        from padfree.integrations.distributed import DistributedPackedBatchSampler

        args = self.args
        seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
        # a sequence-parallel group is one replica: its ranks load the same micro-batches
        common = {"num_replicas": self._padfree_data_replicas(self.accelerator.num_processes), "all_ranks": True,
                  "micro_batch_size": mbs, "seed": seed,
                  "remainder": "drop" if args.dataloader_drop_last else "repeat"}
        if self._padfree_balance_kind() == "rows":
            sampler = DistributedPackedBatchSampler.from_rows(dataset, **common)
        else:
            sampler = DistributedPackedBatchSampler.from_samples(dataset, **common)
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
        return (f"balanced across {schedule.num_ranks} {unit}: {schedule.num_steps} steps x "
                f"{schedule.steps.shape[2]} {what} per rank, token idle {100 * schedule.token_imbalance:.1f}%, "
                f"attention-cost idle {100 * schedule.cost_imbalance:.1f}%")

    def get_train_dataloader(self) -> Any:
        from padfree.integrations.sequence_parallel import loaders_for_group

        sampler = self._padfree_balanced_sampler()
        with loaders_for_group(self.accelerator, self._padfree_sp()):  # a group's ranks load the same batches
            if sampler is None:
                return super().get_train_dataloader()
            return batch_sampler_dataloader(self, sampler)

    # ---- telemetry -------------------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self._padfree_telemetry is not None:
            self._padfree_telemetry.observe(inputs)
        return super().training_step(model, inputs, num_items_in_batch)


def batch_sampler_dataloader(trainer: Any, sampler: Any) -> Any:
    """The train ``DataLoader`` the ``Trainer`` would build, with ``sampler`` as its ``batch_sampler`` (a balanced
    :class:`~padfree.DistributedPackedBatchSampler` with ``all_ranks=True``), prepared by accelerate."""
    from functools import partial

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


def _pad_ids(trainer: Any) -> tuple[int, ...]:
    """Token ids that may fill a padding tail: 0 and the tokenizer's and the model's pad token."""
    ids = {0}
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)
    config = getattr(unwrap_model(trainer.model), "config", None)
    for source in (getattr(tok, "pad_token_id", None), getattr(config, "pad_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
    return tuple(sorted(ids))


# --------------------------------------------------------------------------------------------------
# The Trainer
# --------------------------------------------------------------------------------------------------


def _is_padfree_collator(collator: Any) -> bool:
    return isinstance(collator, (PackedCollator, PaddingFreeCollator))


class TrainerMixin(PadfreeTrainerMixin):
    """What :class:`Trainer` adds to ``transformers.Trainer`` (and :func:`padfree.enable` to its subclasses): the
    padfree arguments, ``configure_packing`` when the collator is padfree's, and the recorded
    :class:`~padfree.integrations.status.PackingStatus`."""

    def __init__(self, *args: Any, padfree_loss: str = "token", padfree_telemetry: bool = True,
                 padfree_balance: bool = True, padfree_fused_loss: bool = False,
                 padfree_sequence_parallel: int | None = None, **kwargs: Any) -> None:
        as_choice(padfree_loss, "padfree_loss", LOSS_MODES)
        sp_size = sequence_parallel_size(padfree_sequence_parallel, "padfree_sequence_parallel")
        self.padfree_balance = as_flag(padfree_balance, "padfree_balance")
        self.padfree_fused_loss = as_flag(padfree_fused_loss, "padfree_fused_loss")
        if self.padfree_fused_loss:
            refuse_with_own_nll("padfree_fused_loss=True", kwargs.get("args", args[1] if len(args) > 1 else None),
                                kwargs.get("compute_loss_func"))
        model = kwargs.get("model", args[0] if args else None)
        collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        train = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        packed_rows = "seq_lens" in (getattr(train, "column_names", None) or ())
        on = _is_padfree_collator(collator)
        if isinstance(model, torch.nn.Module):
            setup_sequence_parallel(model, kwargs.get("args", args[1] if len(args) > 1 else None), sp_size,
                                    padfree_loss)
            if on:
                configure_model(model)
        super().__init__(*args, **kwargs)
        if on and isinstance(collator, PackedCollator):
            mode, why = PACKING, "data_collator is padfree's packed_collate_fn (each loader batch packed into rows)"
        elif on and packed_rows:
            mode, why = PACKING, "train_dataset holds packed rows (seq_lens) and the collator is padfree's"
        elif on:
            mode, why = PADDING_FREE, f"data_collator is padfree's {type(collator).__name__}"
        else:
            mode, why = STANDARD, "the data collator is not one of padfree's (the loss rule still applies)"
        self._padfree_setup(padfree_loss, telemetry=padfree_telemetry)
        self._padfree_status = PackingStatus(mode=mode, reason=why, auto=False, packing=mode == PACKING,
                                             padding_free=mode != STANDARD, loss=padfree_loss,
                                             balance=self._padfree_balance_note(), **model_facts(self.model))
        logger.info("%s", self._padfree_status)


class Trainer(TrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with padfree's loss rule and telemetry, and a packing-exact model.

    Takes every argument of ``transformers.Trainer``, plus:

    Args:
        padfree_loss: ``"token"`` (default: the token mean over the optimizer step, across accumulation and ranks)
            or ``"sequence"`` (the mean over the step's sequences of each sequence's mean token loss).
        padfree_telemetry: add :class:`~padfree.PackingTelemetryCallback`.
        padfree_balance: under data parallelism (``world_size > 1``) with a train dataset of packed rows
            (:func:`~padfree.pack_for_trainer`) or of samples flattened padding-free, deal them to the ranks in steps
            balanced in tokens and Σ len² (:class:`PadfreeTrainerMixin`); ``False`` keeps the Trainer's sampler.
            No effect in one process.
        padfree_fused_loss: train with :func:`padfree.causal_lm_loss` — the LM head and the cross-entropy fused, in
            chunks, over target positions only, no logits tensor — under either loss rule (default False).
            Evaluation, and any call that asks for the outputs, runs the model's own head.
        padfree_sequence_parallel: split every row across groups of this many ranks (sequence parallelism,
            ``configure_packing(model, sequence_parallel=...)``; default 1: none). The ranks of a group load the same
            batches and each trains its slice; DDP / FSDP2 over all ranks reduces the gradients. Needs a launcher
            (torchrun, accelerate launch) and the token loss rule.

    When ``data_collator`` is one of padfree's (:class:`~padfree.PackedRowsCollator`, ``PaddingFreeCollator``,
    ``packed_collate_fn``) the model is passed to :func:`padfree.configure_packing` first, which makes it exact
    for packed rows or raises :class:`~padfree.errors.UnsupportedModelError`. A ``compute_loss_func`` or label
    smoothing takes over the loss (then transformers' normalisation applies); with ``padfree_fused_loss=True`` they
    are refused (InvalidArgumentError), as the fused loss would silently compute another loss.

    Typical use::

        rows = padfree.pack_for_trainer(tokenized, max_length=2048)
        trainer = padfree.Trainer(model=model, args=args, train_dataset=rows,
                                  data_collator=padfree.PackedRowsCollator())
    """
