"""What padfree adds to every causal-LM ``transformers.Trainer`` (``padfree.Trainer``, ``padfree.SFTTrainer``): the loss
rule over the optimizer step, ``eval_loss`` under the same rule, and a rank's slice under sequence parallelism.

:class:`PadfreeTrainerMixin` counts every optimizer step's targets and sequences across its micro-batches and ranks
(:class:`~padfree.step_loss.StepCounts`) and computes each micro-batch's share of the step's loss under
its :class:`~padfree.step_loss.LossRule` — with the model's logits, or fused with the LM head
(:func:`padfree.causal_lm_loss`). Its loaders (balanced data-parallel steps, a sequence-parallel group's shared
batches) are :class:`~padfree.integrations.loaders.BalancedLoaderMixin`'s.

>>> from padfree.integrations.loaders import BalancedLoaderMixin
>>> issubclass(PadfreeTrainerMixin, BalancedLoaderMixin)
True
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from padfree.errors import BackendUnavailableError, InvalidArgumentError
from padfree.integrations.loaders import BalancedLoaderMixin, SamplerEpoch
from padfree.integrations.status import PackingStatus
from padfree.integrations.telemetry import TelemetryLogMixin
from padfree.model.wrappers import unwrap_model
from padfree.packing.inputs import as_choice
from padfree.step_loss import LOSS_MODES, LossRule, StepCounts, step_counts, token_losses

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError("padfree.integrations.causal_lm needs torch; pip install 'padfree[torch]'") from exc

__all__ = ["PadfreeTrainerMixin"]

logger = logging.getLogger("padfree")


class PadfreeTrainerMixin(BalancedLoaderMixin, TelemetryLogMixin):
    """The loss rule and the telemetry for a ``transformers.Trainer`` subclass (put it first in the bases).

    Set up by :meth:`_padfree_setup` (padfree's trainers call it from ``__init__``). Overrides
    ``get_batch_samples`` (counts the step's targets and sequences across ranks), ``compute_loss`` (the loss rule),
    ``evaluation_loop`` / ``prediction_step`` (``eval_loss`` under the same rule over the whole eval set),
    ``training_step`` (feeds the telemetry) and ``_prepare_inputs`` (a rank's slice under sequence parallelism);
    the telemetry joins the logs through :class:`~padfree.integrations.telemetry.TelemetryLogMixin`, and the
    loaders are :class:`~padfree.integrations.loaders.BalancedLoaderMixin`'s (see below).

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
    padfree_fused_loss: bool = False
    _padfree_status: PackingStatus | None = None
    _padfree_step: StepCounts | None = None
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

    def _padfree_world(self) -> int:
        """Ranks whose gradients DDP averages: the data-parallel replicas, and within them the ranks of padfree's
        sequence-parallel group (each holds its slice's share of the gradient; the average over all of them, times
        this count, is the step's sum)."""
        return max(self.accelerator.num_processes // self._padfree_replicas(sequence_parallel=False), 1)

    # ---- sequence parallelism ----------------------------------------------------------------------------

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

    # ---- telemetry -------------------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self._padfree_telemetry is not None:
            self._padfree_telemetry.observe(inputs)
        return super().training_step(model, inputs, num_items_in_batch)


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

