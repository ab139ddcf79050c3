"""The Hugging Face ``Trainer`` side of padfree: the loss rule, packing telemetry, and the data pieces.

**The loss rule.** A packed step must train exactly what the unpacked step trains. padfree's loss is the **token
mean over every real label token of the optimizer step** — all gradient-accumulation micro-batches and all
data-parallel ranks together — so how sequences are cut into rows and micro-batches changes nothing::

    loss(step) = Σ_{targets t of the step} -log p(t) / (number of targets of the step)

A *target* is a label that is not ``-100`` after the causal shift: the first token of every sequence never is (the
model has nothing to predict it from), nor is padding or a prompt token under completion-only / assistant-only loss.
:func:`count_loss_items` counts them per batch; the trainer sums the counts of the micro-batches it draws for one
optimizer step (``get_batch_samples``), adds them up across ranks, and divides every micro-batch's loss sum by the
step total (times the data-parallel world size, since DDP averages gradients). The option
``padfree_loss="sequence"`` weights sequences instead of tokens: every sequence's own mean token loss, averaged over
the sequences of the step — a weighting that packing cannot change either, since it never looks at rows.

Why not leave it to transformers: its ``Trainer`` normalises by ``num_items_in_batch`` only when the model's forward
accepts loss kwargs (otherwise every micro-batch's *mean* is averaged over the accumulation steps, which weights a
short micro-batch's tokens more), and across ranks only with ``average_tokens_across_devices``. padfree computes the
token losses itself (fp32 cross-entropy over the shifted logits, exactly transformers' ``ForCausalLMLoss``) and needs
neither.

>>> import torch
>>> from padfree.integrations.trainer import count_loss_items, sequence_ids
>>> batch = {"labels": torch.tensor([[-100, 12, 13, -100, 22, -100]]),   # a packed row: [11 12 13] [21 22] + pad
...          "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
>>> count_loss_items(batch)          # (targets, sequences with at least one target)
(3, 2)
>>> sequence_ids(batch["position_ids"]).tolist()  # which sequence each token belongs to (padding tail: its own)
[[0, 0, 0, 1, 1, 2]]

**Telemetry.** :class:`PackingTelemetryCallback` (added automatically by padfree's trainers) measures the batches
actually trained on and adds, at every logging step: ``padfree/real_token_fraction`` (real tokens / positions),
``padfree/sequences_per_row``, ``padfree/tokens_per_second`` (real tokens), ``padfree/attention_flops_saved``
(1 − the attention work done / the work of padding every micro-batch's sequences to its longest: Σ len² against
n · max_len²; 0 for ordinary padded batches) and ``padfree/attention`` / ``padfree/mixers``, the implementations
``configure_packing`` installed. The counts stay on the device until a log is written: no sync per step.

**Data for the plain Trainer.** :func:`pack_for_trainer` packs a tokenized ``datasets.Dataset`` globally into
unpadded rows; :class:`PackedRowsCollator` flattens each loader batch into one row with restarting
``position_ids`` and no ``attention_mask`` (rows that are already packed keep their boundaries).
:class:`Trainer` is ``transformers.Trainer`` with the loss rule, the telemetry and ``configure_packing`` (called
when the collator is one of padfree's, so the model either honours packed rows or refuses). :func:`enable` turns
any ``Trainer`` or ``trl.SFTTrainer`` subclass into its padfree version; :func:`packing_status` says, after
construction, which batching mode a trainer uses and why.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from padfree.data.batch import PackedCollator, PaddingFreeCollator
from padfree.errors import BackendUnavailableError, InvalidArgumentError, InvalidSampleError, describe
from padfree.packing.inputs import as_choice
from padfree.packing.strategies import DEFAULT_STRATEGY

try:
    import torch
    import transformers
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.trainer needs torch and transformers; pip install 'padfree[torch,hf]'"
    ) from exc

__all__ = [
    "LOSS_MODES",
    "MODES",
    "PackedRowsCollator",
    "PackingStatus",
    "PackingTelemetryCallback",
    "PadfreeTrainerMixin",
    "Trainer",
    "count_loss_items",
    "enable",
    "pack_for_trainer",
    "packing_status",
    "sequence_ids",
    "token_losses",
]

logger = logging.getLogger("padfree")

LOSS_MODES = ("token", "sequence")
PACKING, PADDING_FREE, STANDARD = "sample packing", "padding-free batching", "standard batching"
MODES = (PACKING, PADDING_FREE, STANDARD)
IGNORE = -100


# --------------------------------------------------------------------------------------------------
# Status
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PackingStatus:
    """Which batching mode a trainer uses and why (:func:`packing_status`).

    Attributes:
        mode: ``"sample packing"`` (the dataset is packed globally into rows), ``"padding-free batching"`` (every
            loader batch is flattened into one row, no padding) or ``"standard batching"`` (padded batches).
        reason: why: the explicit setting that chose it, or what made the automatic choice.
        auto: the mode was chosen automatically (no explicit ``packing`` / ``padding_free``).
        packing, padding_free: the truth, also in ``trainer.args.packing`` / ``trainer.args.padding_free``.
        model_type: ``config.model_type`` of the model.
        attention: the attention implementation in use (``padfree_sdpa``, ..., or transformers' own).
        mixers: qualified name -> boundary-exact implementation, for recurrent / convolution mixers.
        loss: ``"token"`` or ``"sequence"`` (the loss rule), None when padfree's loss rule is off.
        efficiency: real tokens / row slots of the packed training set (sample packing only).
        rows, sequences: packed rows and the sequences in them (sample packing only).
        balance: how the packed rows are dealt to data-parallel ranks (``world_size > 1`` with a train dataset of
            packed rows only, else None): ``"balanced across W ranks: ..."`` with the idle time left by the
            imbalance of tokens and of attention cost (Σ len²), or why the Trainer's own sampler is used.
    """

    mode: str
    reason: str
    auto: bool
    packing: bool
    padding_free: bool
    model_type: str | None = None
    attention: str | None = None
    mixers: dict[str, str] = dataclasses.field(default_factory=dict)
    loss: str | None = None
    efficiency: float | None = None
    rows: int | None = None
    sequences: int | None = None
    balance: str | None = None

    @property
    def enabled(self) -> bool:
        """Packed or padding-free batches reach the model (``configure_packing`` made it exact)."""
        return self.mode != STANDARD

    def __str__(self) -> str:
        text = f"padfree: {self.mode} ({self.reason})"
        if self.mode == PACKING and self.rows is not None:
            text += f"; {self.sequences} sequences in {self.rows} rows, efficiency {self.efficiency:.1%}"
        if self.enabled:
            text += f"; attention {self.attention}"
            if self.mixers:
                text += f", mixers {'; '.join(f'{k}: {v}' for k, v in self.mixers.items())}"
        if self.loss is not None:
            text += f"; loss = {self.loss} mean over the optimizer step"
        if self.balance is not None:
            text += f"; {self.balance}"
        return text


def packing_status(trainer: Any) -> PackingStatus:
    """The :class:`PackingStatus` of ``trainer``: which mode is active, why, and the model's packed implementation.

    Works for padfree's trainers (which record their decision) and, by reading ``args.packing`` /
    ``args.padding_free`` and the collator, for any other ``transformers.Trainer``.
    """
    status = getattr(trainer, "_padfree_status", None)
    if status is not None:
        return status
    if not isinstance(trainer, transformers.Trainer):
        raise InvalidArgumentError(f"trainer must be a transformers.Trainer (or trl.SFTTrainer), got "
                                   f"{describe(trainer)}")
    args = trainer.args
    packing, padding_free = bool(getattr(args, "packing", False)), bool(getattr(args, "padding_free", False))
    padding_free = padding_free or bool(getattr(trainer, "padding_free", False))
    collator = trainer.data_collator
    if isinstance(collator, (PackedCollator, PaddingFreeCollator)):
        padding_free = True
    mode = PACKING if packing else PADDING_FREE if padding_free else STANDARD
    return PackingStatus(mode=mode, reason=f"not built by padfree: read from the trainer's arguments and collator "
                                           f"({type(collator).__name__})", auto=False, packing=packing,
                         padding_free=padding_free or packing, **_model_facts(trainer.model))


def _model_facts(model: Any) -> dict[str, Any]:
    from padfree.model.configure import packing_state

    base = _unwrap(model)
    config = getattr(base, "config", None)
    state = packing_state(base) if base is not None else None
    facts: dict[str, Any] = {"model_type": getattr(config, "model_type", None)}
    if state is not None:
        facts.update(attention=state.report.backend, mixers=dict(state.report.mixers))
    elif config is not None:
        facts["attention"] = getattr(config, "_attn_implementation", None)
    return facts


def _unwrap(model: Any) -> Any:
    """The transformers model inside PEFT / DDP / compile wrappers."""
    for _ in range(8):
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            inner = model.module
        elif hasattr(model, "_orig_mod"):
            inner = model._orig_mod
        else:
            return model
        if inner is model:
            return model
        model = inner
    return model


# --------------------------------------------------------------------------------------------------
# The loss rule
# --------------------------------------------------------------------------------------------------


def sequence_ids(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, T) int64`` — the index of the sequence every token belongs to, counted over the whole batch.

    A sequence starts at every row start and wherever ``position_ids`` is 0 (packed rows restart there; a padding
    tail counted ``0, 1, ...`` is a sequence of its own). Without ``position_ids`` pass ``None``: every row is one
    sequence (an ordinary padded batch).

    Args:
        position_ids: ``(B, T)`` or ``(T,)`` integer positions, or None.
        attention_mask: only used for its shape when ``position_ids`` is None.
    """
    ref = position_ids if position_ids is not None else attention_mask
    if ref is None:
        raise InvalidArgumentError("sequence_ids needs position_ids or an attention_mask to know the batch shape")
    if ref.dim() == 1:
        ref = ref.unsqueeze(0)
    rows, width = ref.shape
    if position_ids is None:
        return torch.arange(rows, device=ref.device).unsqueeze(1).expand(rows, width)
    start = ref == 0
    start[:, 0] = True
    return start.reshape(-1).cumsum(0).sub_(1).view(rows, width)


def _targets(batch: Mapping[str, Any]) -> tuple[torch.Tensor, bool]:
    """``(targets, shifted)``: the label of every scored position — ``shift_labels`` as given, else
    ``labels[:, 1:]`` (the causal shift) — and whether the caller's logits must drop their last position."""
    shift = batch.get("shift_labels")
    if shift is not None:
        return shift, False
    labels = batch["labels"]
    if labels.dim() == 1:
        labels = labels.unsqueeze(0)
    return labels[:, 1:], True


def count_loss_items(batch: Mapping[str, Any]) -> tuple[int, int]:
    """``(targets, sequences)`` of one model-input batch: labels that are scored after the causal shift, and the
    sequences that have at least one of them (what the per-sequence loss averages over).

    ``batch`` holds ``labels`` (``(B, T)``, Hugging Face aligned: the model shifts) or ``shift_labels``, and
    ``position_ids`` when rows are packed. Counting ``labels[:, 1:]`` rather than all labels matters for unpacked
    rows, whose first token is a label but never a target; packed rows already hold ``-100`` there.
    """
    t, s = _count_tensors(batch)
    return int(t), int(s)


def _count_tensors(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    targets, shifted = _targets(batch)
    mask = targets != IGNORE
    seq, slots = _target_sequences(batch, targets.shape, shifted)
    has = torch.zeros(slots + 1, dtype=torch.bool, device=targets.device)
    has[seq.masked_fill(~mask, slots).reshape(-1)] = True
    return mask.sum(), has[:-1].sum()


def _target_sequences(batch: Mapping[str, Any], shape: torch.Size, shifted: bool) -> tuple[torch.Tensor, int]:
    """``(sequence of every scored position, number of token slots)``: the target at ``t`` is token ``t + 1``
    when ``shifted``; with ``shift_labels`` it is at ``t`` and belongs to the sequence of token ``t`` (the label
    before a boundary is ignored). Sequence ids are below the slot count ``B * T``."""
    ref = batch.get("labels") if batch.get("labels") is not None else batch.get("shift_labels")
    if ref.dim() == 1:
        ref = ref.unsqueeze(0)
    pos = batch.get("position_ids")
    if pos is not None:
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.shape[0] == 1 and ref.shape[0] > 1:
            pos = pos.expand(ref.shape[0], -1)
    seq = sequence_ids(pos, ref)
    return (seq[:, 1:] if shifted else seq.reshape(shape)), seq.numel()


def _sequence_weights(batch: Mapping[str, Any]) -> torch.Tensor:
    """Floats shaped like the batch's labels (``labels`` or ``shift_labels``): ``1 / (targets of its sequence)``
    for every label that is a target, 0 elsewhere — the weights that make a sum of token losses the sum of the
    sequences' mean losses (the ``"sequence"`` rule, before its division by the sequence count)."""
    targets, shifted = _targets(batch)
    mask = targets != IGNORE
    seq, slots = _target_sequences(batch, targets.shape, shifted)
    counts = torch.bincount(seq.masked_fill(~mask, slots).reshape(-1), minlength=slots + 1)[:-1]
    scored = torch.where(mask, 1.0 / counts.clamp(min=1)[seq].float(), 0.0)
    return torch.nn.functional.pad(scored, (1, 0)) if shifted else scored


def token_losses(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, mask)``, both ``(B, T - 1)`` (``(B, T)`` with ``shift_labels``): the fp32 cross-entropy of every
    scored position (0 where ignored) and whether it is a target — what transformers' ``ForCausalLMLoss`` sums.

    Args:
        logits: ``(B, T, V)`` from the model.
        batch: the model inputs, with ``labels`` or ``shift_labels``.
    """
    targets, shifted = _targets(batch)
    if shifted:
        logits = logits[:, :-1]
    mask = targets != IGNORE
    flat = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.masked_fill(~mask, 0).reshape(-1), reduction="none"
    )
    return flat.view(targets.shape) * mask, mask


def reduce_loss(token_loss: torch.Tensor, mask: torch.Tensor, batch: Mapping[str, Any], mode: str,
                denominator: torch.Tensor | float | None, shifted: bool = True) -> torch.Tensor:
    """The loss of one micro-batch under the loss rule: the sum over its targets (``"token"``) or over its
    sequences' mean token losses (``"sequence"``), divided by ``denominator`` (the step's targets or sequences,
    already scaled by the data-parallel world size), or by this batch's own count when it is None."""
    if mode == "token":
        total = token_loss.sum()
        count = mask.sum()
    else:
        seq, slots = _target_sequences(batch, token_loss.shape, shifted)
        idx = seq.masked_fill(~mask, slots).reshape(-1)
        sums = torch.zeros(slots + 1, dtype=token_loss.dtype, device=token_loss.device)
        sums.index_add_(0, idx, token_loss.reshape(-1))
        counts = torch.bincount(idx, minlength=slots + 1)[:-1]
        total = (sums[:-1] / counts.clamp(min=1)).sum()
        count = (counts > 0).sum()
    if denominator is None:
        denominator = count
    return total / torch.as_tensor(denominator, device=total.device, dtype=total.dtype).clamp(min=1)


class PadfreeTrainerMixin:
    """The loss rule and the telemetry for a ``transformers.Trainer`` subclass (put it first in the bases).

    Set up by :meth:`_padfree_setup` (padfree's trainers call it from ``__init__``). Overrides
    ``get_batch_samples`` (counts the step's targets and sequences across ranks), ``compute_loss`` (the loss rule),
    ``evaluation_loop`` / ``prediction_step`` (``eval_loss`` under the same rule over the whole eval set),
    ``training_step`` (feeds the telemetry), ``log`` (adds the telemetry to the logged metrics) and
    ``get_train_dataloader`` (balanced data-parallel steps over packed rows, see below).

    **Balanced steps.** When training is data-parallel (``args.world_size > 1``) and the train dataset holds packed
    rows (a ``seq_lens`` column: :func:`pack_for_trainer`, ``padfree.SFTTrainer(packing=True)``), the train loader
    draws its micro-batches from a :class:`~padfree.integrations.distributed.DistributedPackedBatchSampler` over the
    rows (:meth:`~padfree.integrations.distributed.DistributedPackedBatchSampler.from_rows`) instead of the
    Trainer's sampler, which shards rows by count: every step gives each rank ``per_device_train_batch_size`` rows
    of nearly equal tokens and Σ len², so no rank waits at every step for the one that drew the long sequences.
    Seeded from ``args.data_seed`` (else ``args.seed``), a new order every epoch (the Trainer calls ``set_epoch``);
    ``dataloader_drop_last=True`` leaves the cheapest rows of an uneven remainder out, otherwise they are
    scheduled twice (logged). Padding-free batches (unpacked samples that padfree's collator flattens into one row
    per micro-batch) are balanced too, without changing what a step trains: each step takes ``world_size *
    per_device_train_batch_size`` samples of a seeded random permutation, as the Trainer's sampler would, and
    only deals them to the ranks by load (``DistributedPackedBatchSampler.from_samples``; needs
    ``per_device_train_batch_size >= 2``). Off with ``padfree_balance=False``; skipped (reason in
    :class:`PackingStatus`) with tensor / context / sequence parallelism, a ``train_sampling_strategy`` other
    than ``"random"``, or accelerate's ``split_batches`` / ``dispatch_batches``. One process: the Trainer's own
    loader, unchanged.
    """

    padfree_loss: str | None = None
    padfree_balance: bool = True
    padfree_fused_loss: bool = False
    _padfree_balanced: tuple[Any, Any] | None = None
    _padfree_status: PackingStatus | None = None
    _padfree_telemetry: PackingTelemetryCallback | None = None
    _padfree_step: tuple[torch.Tensor, torch.Tensor] | None = None
    _padfree_epoch: _SamplerEpoch
    _padfree_eval_sums: torch.Tensor | None = None

    def _padfree_setup(self, loss: str | None, telemetry: bool) -> None:
        self.padfree_loss = None if loss is None else as_choice(loss, "padfree_loss", LOSS_MODES)
        self._padfree_epoch = _SamplerEpoch()
        self.callback_handler.add_callback(self._padfree_epoch)
        if self.padfree_loss is not None:
            # compute_loss normalises over the whole optimizer step; the Trainer must not divide by the
            # accumulation steps again
            self.loss_is_scaled_for_ga = True
        if telemetry:
            callback = PackingTelemetryCallback(pad_token_ids=_pad_ids(self))
            # first in line: the reporting callbacks (TensorBoard, W&B, the console) see its keys
            self.callback_handler.callbacks.insert(0, callback)
            self._padfree_telemetry = callback

    # ---- counting the step ---------------------------------------------------------------------------

    def _padfree_replicas(self) -> int:
        """Ranks that see the same batch (tensor / context / sequence parallel groups), as transformers counts."""
        n = 1
        for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
            getter = getattr(self, name, None)
            if callable(getter):
                n *= int(getter())
        return max(n, 1)

    def _padfree_world(self) -> int:
        """Data-parallel replicas whose gradients DDP averages."""
        return max(self.accelerator.num_processes // self._padfree_replicas(), 1)

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
        counts = torch.stack([torch.stack(_count_tensors(b)) for b in batch_samples]).sum(0)
        counts = counts.to(device=device, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.gather(counts.unsqueeze(0)).sum(0) / self._padfree_replicas()
        self._padfree_step = (counts[0], counts[1])
        return batch_samples, counts[0]

    def _padfree_denominator(self, which: int, num_items_in_batch: Any) -> torch.Tensor | None:
        """The step's targets (0) or sequences (1) divided by the world size, or None outside a counted step."""
        if num_items_in_batch is None or self._padfree_step is None or not self.model.training:
            return None
        return self._padfree_step[which] / self._padfree_world()

    # ---- the loss --------------------------------------------------------------------------------------

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if (self.padfree_loss is None or ("labels" not in inputs and "shift_labels" not in inputs)
                or self.label_smoother is not None or self.compute_loss_func is not None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if self._padfree_fuses(return_outputs):
            return self._padfree_fused(model, inputs, num_items_in_batch)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        outputs = model(**model_inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        loss_tok, mask = token_losses(logits, inputs)
        which = 0 if self.padfree_loss == "token" else 1
        denom = self._padfree_denominator(which, num_items_in_batch)
        loss = reduce_loss(loss_tok, mask, inputs, self.padfree_loss, denom, shifted="shift_labels" not in inputs)
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

        which = 0 if self.padfree_loss == "token" else 1
        denom = self._padfree_denominator(which, num_items_in_batch)
        count = denom if denom is not None else _count_tensors(inputs)[which]
        weights = None if which == 0 else _sequence_weights(inputs)
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
        per_round = acc.num_processes * self.args.eval_batch_size
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
        targets, sequences = _count_tensors(inputs)
        count = (targets if self.padfree_loss == "token" else sequences).to(self._padfree_eval_sums)
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
        world = int(getattr(args, "world_size", 1) or 1)
        kind = self._padfree_balance_kind()
        if world <= 1 or kind is None:
            return False, None
        default = f"the Trainer's sampler shards {'rows' if kind == 'rows' else 'samples'} by count"
        if not self.padfree_balance:
            return False, f"not balanced across {world} ranks (padfree_balance=False): {default}"
        from padfree.integrations.distributed import _is_hf_dataset

        dataset = self.train_dataset
        why = None
        if not _is_hf_dataset(dataset):
            why = f"the train dataset is a {type(dataset).__name__}, not a datasets.Dataset"
        elif self._padfree_replicas() > 1:
            why = "tensor / context / sequence parallel ranks share batches"
        elif getattr(args, "train_sampling_strategy", "random") != "random":
            why = f"train_sampling_strategy={args.train_sampling_strategy!r} chooses the sampler"
        elif getattr(self.accelerator, "split_batches", False) or getattr(self.accelerator, "dispatch_batches", False):
            why = "accelerate's split_batches / dispatch_batches is on"
        elif self.accelerator.num_processes != world:
            why = f"accelerate runs {self.accelerator.num_processes} processes for world_size={world}"
        elif kind == "samples" and int(self._train_batch_size) < 2:
            why = "one sample per rank per step: balancing would have to change which samples share a step"
        if why is not None:
            return False, f"not balanced across {world} ranks ({why}): {default}"
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
        common = {"num_replicas": self.accelerator.num_processes, "all_ranks": True, "micro_batch_size": mbs,
                  "seed": seed, "remainder": "drop" if args.dataloader_drop_last else "repeat"}
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
        return (f"balanced across {schedule.num_ranks} ranks: {schedule.num_steps} steps x "
                f"{schedule.steps.shape[2]} {what} per rank, token idle {100 * schedule.token_imbalance:.1f}%, "
                f"attention-cost idle {100 * schedule.cost_imbalance:.1f}%")

    def get_train_dataloader(self) -> Any:
        sampler = self._padfree_balanced_sampler()
        if sampler is None:
            return super().get_train_dataloader()
        from functools import partial

        from torch.utils.data import DataLoader
        from transformers.trainer_utils import seed_worker

        args = self.args
        # what Trainer._get_dataloader passes, with the balanced batch sampler in place of batch_size / sampler;
        # accelerate's prepare re-shards it (process p keeps micro-batches p, p + W, ...: rank p's own)
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        params = {
            "batch_sampler": sampler,
            "collate_fn": self.data_collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "in_order": args.dataloader_in_order,
            "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
        }
        return self.accelerator.prepare(DataLoader(dataset, **params))

    # ---- telemetry -------------------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self._padfree_telemetry is not None:
            self._padfree_telemetry.observe(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._padfree_telemetry is not None and _is_train_log(logs):
            logs.update(self._padfree_telemetry.pop_metrics())
        super().log(logs, start_time)


class _SamplerEpoch(TrainerCallback):
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


def _is_train_log(logs: Mapping[str, Any]) -> bool:
    return "loss" in logs and not any(k.startswith(("eval_", "test_")) for k in logs)


def _pad_ids(trainer: Any) -> tuple[int, ...]:
    ids = {0}
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)
    for source in (getattr(tok, "pad_token_id", None), getattr(getattr(_unwrap(trainer.model), "config", None),
                                                               "pad_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
    return tuple(sorted(ids))


# --------------------------------------------------------------------------------------------------
# Telemetry
# --------------------------------------------------------------------------------------------------

_STATS = ("rows", "positions", "tokens", "sequences", "attn_done", "attn_padded")


class PackingTelemetryCallback(TrainerCallback):
    """Logs, per logging step, what packing bought: measured on the batches actually trained on.

    Keys added to the logged metrics (and written to the ``padfree`` logger at INFO):

    - ``padfree/real_token_fraction`` — real tokens / positions the model ran (1.0 without padding);
    - ``padfree/sequences_per_row`` — sequences per batch row;
    - ``padfree/tokens_per_second`` — real tokens per second of wall time since the previous log;
    - ``padfree/attention_flops_saved`` — 1 − (attention work done) / (work of padding each micro-batch's sequences
      to its longest), with work ∝ Σ len² for block-diagonal packed attention and B·T² for padded rows;
    - ``padfree/attention``, ``padfree/mixers`` — the implementations ``configure_packing`` installed (strings).

    padfree's trainers add it and feed it every micro-batch; with another trainer, call :meth:`observe` on each
    batch of model inputs (e.g. from ``training_step``) and :meth:`pop_metrics` when logging.

    Args:
        pad_token_ids: token ids that mark a padding tail (a row-final sequence made only of these ids, with no
            target) in packed rows padded to capacity; padding-free rows have no padding at all.

    >>> import torch
    >>> cb = PackingTelemetryCallback()
    >>> cb.observe({"input_ids": torch.tensor([[5, 6, 7, 8, 9, 3, 0, 0]]),
    ...             "labels": torch.tensor([[-100, 6, 7, -100, 9, -100, -100, -100]]),
    ...             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])})
    >>> m = cb.pop_metrics()
    >>> m["padfree/real_token_fraction"], m["padfree/sequences_per_row"], round(m["padfree/attention_flops_saved"], 4)
    (0.75, 3.0, 0.4815)
    """

    def __init__(self, *, pad_token_ids: Sequence[int] = (0,)) -> None:
        self.pad_token_ids = tuple(int(i) for i in pad_token_ids)
        self.attention: str | None = None
        self.mixers: str | None = None
        self._acc: torch.Tensor | None = None
        self._since = time.perf_counter()
        self.last: dict[str, Any] = {}

    # ---- measuring -------------------------------------------------------------------------------------

    def observe(self, inputs: Mapping[str, Any]) -> None:
        """Count one micro-batch of model inputs (``input_ids``, ``labels``, ``position_ids`` and/or
        ``attention_mask``); the counts stay on the batch's device.

        Packed rows are read from a LLaMA-Factory integer ``attention_mask`` (segment ids ``[1, 1, 2, 2, 2, 0]``)
        or from ``position_ids`` that restart at 0; a 0/1 ``attention_mask`` is an ordinary padded batch."""
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        stats = _batch_stats(inputs, self.pad_token_ids)
        self._acc = stats if self._acc is None else self._acc + stats

    def pop_metrics(self) -> dict[str, Any]:
        """The metrics since the previous call (empty if no batch was observed), then start counting afresh."""
        now = time.perf_counter()
        if self._acc is None:
            return {}
        acc = dict(zip(_STATS, self._acc.tolist(), strict=True))  # the one device sync per log
        elapsed = max(now - self._since, 1e-9)
        self._acc, self._since = None, now
        metrics: dict[str, Any] = {
            "padfree/real_token_fraction": acc["tokens"] / max(acc["positions"], 1.0),
            "padfree/sequences_per_row": acc["sequences"] / max(acc["rows"], 1.0),
            "padfree/tokens_per_second": acc["tokens"] / elapsed,
            "padfree/attention_flops_saved": 1.0 - acc["attn_done"] / max(acc["attn_padded"], 1.0),
        }
        if self.attention is not None:
            metrics["padfree/attention"] = self.attention
        if self.mixers:
            metrics["padfree/mixers"] = self.mixers
        self.last = metrics
        logger.info("padfree telemetry: %s", ", ".join(
            f"{k.split('/', 1)[1]}={v:.4g}" if isinstance(v, float) else f"{k.split('/', 1)[1]}={v}"
            for k, v in metrics.items()))
        return metrics

    # ---- TrainerCallback ---------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        from padfree.model.configure import packing_state

        self._since, self._acc = time.perf_counter(), None
        base = _unwrap(model) if model is not None else None
        st = packing_state(base) if base is not None else None
        if st is not None:
            self.attention = st.report.backend
            self.mixers = "; ".join(f"{k}: {v}" for k, v in st.report.mixers.items()) or None
        elif base is not None and getattr(base, "config", None) is not None:
            self.attention = f"{base.config._attn_implementation} (transformers, not configured by padfree)"

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
               ) -> None:
        # padfree's trainers merge the metrics in Trainer.log (so they reach log_history); with another trainer
        # they are added here, for the callbacks after this one
        if logs is not None and _is_train_log(logs) and "padfree/real_token_fraction" not in logs:
            logs.update(self.pop_metrics())


def _batch_stats(inputs: Mapping[str, Any], pad_ids: tuple[int, ...]) -> torch.Tensor:
    """``(6,) float64`` on the batch's device: rows, positions, real tokens, sequences, attention work done
    (Σ len² packed, B·T² padded), attention work of padded batching (n · max_len²).

    Boundaries come from a LLaMA-Factory integer ``attention_mask`` (segment ids ``[1, 1, 2, 2, 2, 0]``: 0 is
    padding), else from ``position_ids`` restarting at 0; a 0/1 ``attention_mask`` or neither is an ordinary batch.
    """
    ids = inputs["input_ids"]
    rows, width = ids.shape
    dev = ids.device
    f = torch.float64
    pos, mask, labels = inputs.get("position_ids"), inputs.get("attention_mask"), inputs.get("labels")
    if pos is not None and pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        # an ordinary batch: one sequence per row, the attention runs over the whole padded width
        stats = _padded_stats(mask.ne(0).sum(1).to(f), rows, width)
        if not mask.dtype.is_floating_point and mask.dtype != torch.bool:
            # segment ids or a 0/1 mask: which one is decided on the device (values > 1 somewhere), since asking
            # would sync every step
            stats = torch.where((mask > 1).any(), _packed_stats(_segment_lengths(mask)), stats)
    elif pos is None or pos.shape != ids.shape:
        stats = _padded_stats(torch.full((rows,), float(width), dtype=f, device=dev), rows, width)
    else:
        seq = sequence_ids(pos)
        flat = seq.reshape(-1)
        count = rows * width
        lens = torch.bincount(flat, minlength=count)[:count].to(f)
        is_pad = torch.isin(ids, torch.tensor(pad_ids, device=dev))
        if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:
            is_pad &= labels == IGNORE
        pad_count = torch.bincount(flat, weights=is_pad.reshape(-1).to(f), minlength=count)[:count]
        final = torch.zeros(count, dtype=torch.bool, device=dev)
        final[seq[:, -1]] = True
        tail = final & (pad_count == lens) & (lens > 0)
        stats = _packed_stats(lens.masked_fill(tail, 0.0))
    return torch.cat([torch.tensor([float(rows), float(rows * width)], dtype=f, device=dev), stats])


def _padded_stats(lens: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``(4,) float64``: real tokens, sequences, attention work done (B·T²: every row attends over the padded
    width) and of padding to the longest, from the ``(rows,)`` real lengths of an ordinary batch."""
    done = torch.full((), float(rows * width * width), dtype=lens.dtype, device=lens.device)
    return _stats(lens, done)


def _packed_stats(lens: torch.Tensor) -> torch.Tensor:
    """``(4,) float64`` as :func:`_padded_stats`, for block-diagonal attention over sequences of length ``lens``
    (zeros for empty slots allowed): the work done is Σ len²."""
    return _stats(lens, (lens * lens).sum())


def _stats(lens: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    n = (lens > 0).sum().to(lens.dtype)
    padded = n * lens.max() ** 2 if lens.numel() else torch.zeros((), dtype=lens.dtype, device=lens.device)
    return torch.stack([lens.sum(), n, done, padded])


def _segment_lengths(mask: torch.Tensor) -> torch.Tensor:
    """``(B·T,) float64`` — the length of every segment of a LLaMA-Factory ``(B, T)`` integer mask, one slot per
    position (a segment starts wherever a real token's id differs from its left neighbour's or a row starts;
    the slots after the last segment are 0). Any id values work: no assumption that they count 1, 2, 3."""
    real = mask != 0
    start = real.clone()
    start[:, 1:] &= mask[:, 1:] != mask[:, :-1]
    # padding takes the index of the segment before it, and weight 0
    seg = start.reshape(-1).cumsum(0).sub_(1).clamp_(min=0)
    count = mask.numel()
    return torch.bincount(seg, weights=real.reshape(-1).to(torch.float64), minlength=count)[:count]


# --------------------------------------------------------------------------------------------------
# Data pieces for the plain Trainer
# --------------------------------------------------------------------------------------------------


class PackedRowsCollator(PaddingFreeCollator):
    """A :class:`~padfree.PaddingFreeCollator` for the ``Trainer``: every loader batch becomes one row with
    restarting ``position_ids``, no padding and no ``attention_mask``, returned as a dict of model inputs.

    Samples are token ids or dicts with ``input_ids`` (and optionally ``labels``). Rows that are already packed
    (:func:`pack_for_trainer`, :func:`padfree.pack_dataset` with ``padding=None``) keep their boundaries: read from
    ``seq_lens``, or — when the ``Trainer`` dropped that column (``remove_unused_columns``) — from their
    ``position_ids``, which restart at every sequence. A packed row without either raises rather than being trained
    as one long sequence.

    Args:
        label_padding_value, seq_idx, max_tokens: as in :class:`~padfree.PaddingFreeCollator`.
        flash_kwargs: also return ``cu_seq_lens_q/k`` and ``max_length_q/k``. Off by default: a model made exact by
            ``configure_packing`` derives its boundaries from ``position_ids`` (and hands flash-attn its own
            offsets), and a batch that holds a single sequence must reach transformers' ordinary code without them
            (its recurrent layers refuse ``cu_seqlens`` when their kernels are missing).

    >>> collate = PackedRowsCollator()
    >>> batch = collate([{"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]}, {"input_ids": [3, 4]}])
    >>> batch["position_ids"].tolist(), batch["labels"].tolist()
    ([[0, 1, 2, 0, 1, 0, 1]], [[-100, 6, 7, -100, 9, -100, 4]])
    >>> sorted(batch)
    ['input_ids', 'labels', 'position_ids', 'use_cache']
    """

    def __init__(self, *, label_padding_value: int = IGNORE, seq_idx: bool = False, max_tokens: int | None = None,
                 flash_kwargs: bool = False) -> None:
        super().__init__(label_padding_value=label_padding_value, seq_idx=seq_idx, return_dict=False,
                         max_tokens=max_tokens)
        self.flash_kwargs = bool(flash_kwargs)

    def __call__(self, samples: Sequence[Any]) -> Any:
        if samples and isinstance(samples[0], Mapping):
            samples = [self._with_seq_lens(s, i) for i, s in enumerate(samples)]
            if any("seq_lens" in s for s in samples):
                samples = [s if "seq_lens" in s else {**s, "seq_lens": [len(s["input_ids"])]} for s in samples]
        return super().__call__(samples).model_inputs(flash_kwargs=self.flash_kwargs)

    @staticmethod
    def _with_seq_lens(sample: Mapping[str, Any], i: int) -> Mapping[str, Any]:
        if sample.get("seq_lens") is not None:
            return sample
        pos = sample.get("position_ids")
        if pos is None:
            return sample
        pos = np.asarray(pos.tolist() if isinstance(pos, torch.Tensor) else pos, dtype=np.int64).reshape(-1)
        if pos.shape[0] != len(sample["input_ids"]) or pos.shape[0] == 0 or pos[0] != 0:
            raise InvalidSampleError(
                f"samples[{i}]['position_ids'] must restart at 0 at every sequence of the row and have one entry "
                f"per token ({len(sample['input_ids'])}), got {describe(pos.tolist())}"
            )
        starts = np.flatnonzero(pos == 0)
        lens = np.diff(np.append(starts, pos.shape[0]))
        return {k: v for k, v in sample.items() if k != "position_ids"} | {"seq_lens": lens.tolist()}


def pack_for_trainer(dataset: Any, max_length: int, strategy: str = DEFAULT_STRATEGY, seed: int | None = None, *,
                     overlong: str = "error", max_sequences_per_bin: int | None = None,
                     return_result: bool = False) -> Any:
    """Pack a tokenized dataset globally into unpadded rows of at most ``max_length`` tokens for the ``Trainer``.

    :func:`padfree.pack_dataset` with the columns a ``Trainer`` keeps and :class:`PackedRowsCollator` reads:
    ``input_ids``, ``labels`` (the first token of every sequence and masked input labels ``-100``),
    ``position_ids`` (restarting per sequence) and ``seq_lens``. ``dataset`` has ``input_ids`` and optionally
    ``labels`` (or TRL's ``completion_mask`` / ``assistant_masks``).

    >>> rows = pack_for_trainer({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}, max_length=6)
    >>> rows[:]["input_ids"], rows[:]["position_ids"]
    ([[6, 7, 8, 9, 4, 5], [1, 2, 3]], [[0, 1, 2, 3, 0, 1], [0, 1, 2]])
    """
    from padfree.data.hf import pack_dataset

    if max_length is None or isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) \
            or max_length < 1:
        raise InvalidArgumentError(f"max_length must be an int >= 1 (the tokens of one packed row), got "
                                   f"{describe(max_length)}")
    return pack_dataset(dataset, int(max_length), strategy, seed, overlong=overlong,
                        max_sequences_per_bin=max_sequences_per_bin, padding=None, attention_mask=None,
                        columns=["input_ids", "labels", "position_ids", "seq_lens"], return_result=return_result)


# --------------------------------------------------------------------------------------------------
# The Trainer
# --------------------------------------------------------------------------------------------------


def _is_padfree_collator(collator: Any) -> bool:
    return isinstance(collator, (PackedCollator, PaddingFreeCollator))


class _TrainerMixin(PadfreeTrainerMixin):
    """``__init__`` of :class:`Trainer` and of :func:`enable`'d ``Trainer`` subclasses."""

    def __init__(self, *args: Any, padfree_loss: str = "token", padfree_telemetry: bool = True,
                 padfree_balance: bool = True, padfree_fused_loss: bool = False, **kwargs: Any) -> None:
        as_choice(padfree_loss, "padfree_loss", LOSS_MODES)
        self.padfree_balance = _as_flag(padfree_balance, "padfree_balance")
        self.padfree_fused_loss = _as_flag(padfree_fused_loss, "padfree_fused_loss")
        if self.padfree_fused_loss:
            _refuse_with_own_nll("padfree_fused_loss=True", kwargs.get("args", args[1] if len(args) > 1 else None),
                                 kwargs.get("compute_loss_func"))
        model = kwargs.get("model", args[0] if args else None)
        collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        train = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        packed_rows = "seq_lens" in (getattr(train, "column_names", None) or ())
        on = _is_padfree_collator(collator)
        if on and isinstance(model, torch.nn.Module):
            _configure(model)
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
                                             balance=self._padfree_balance_note(), **_model_facts(self.model))
        logger.info("%s", self._padfree_status)


def _as_flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be True or False, got {describe(value)}")
    return bool(value)


def _refuse_with_own_nll(what: str, args: Any, compute_loss_func: Any) -> None:
    """InvalidArgumentError when ``args`` / ``compute_loss_func`` would change the loss away from the plain negative
    log-likelihood that ``what`` (the sequence rule, the fused loss) computes itself."""
    conflicts = []
    loss_type = getattr(args, "loss_type", "nll")  # TRL's SFTConfig: "nll" or "dft"
    if loss_type not in (None, "nll"):
        conflicts.append(f"loss_type={loss_type!r}")
    smoothing = getattr(args, "label_smoothing_factor", 0.0) or 0.0
    if smoothing > 0:
        conflicts.append(f"label_smoothing_factor={smoothing}")
    if compute_loss_func is not None:
        conflicts.append("a compute_loss_func")
    if conflicts:
        raise InvalidArgumentError(
            f"{what} computes the negative log-likelihood itself; it cannot be combined with "
            f"{', '.join(conflicts)} (accepted: loss_type='nll', no label smoothing, no compute_loss_func)")


def _configure(model: Any) -> Any:
    """``configure_packing`` on the transformers model inside ``model`` (kept if already configured)."""
    from padfree.model.configure import configure_packing, packing_state

    base = _unwrap(model)
    state = packing_state(base)
    return state.report if state is not None else configure_packing(base)


class Trainer(_TrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with padfree's loss rule and telemetry, and a packing-exact model.

    Takes every argument of ``transformers.Trainer``, plus:

    Args:
        padfree_loss: ``"token"`` (default: the token mean over the optimizer step, across accumulation and ranks)
            or ``"sequence"`` (the mean over the step's sequences of each sequence's mean token loss).
        padfree_telemetry: add :class:`PackingTelemetryCallback`.
        padfree_balance: under data parallelism (``world_size > 1``) with a train dataset of packed rows
            (:func:`pack_for_trainer`) or of samples flattened padding-free, deal them to the ranks in steps
            balanced in tokens and Σ len² (:class:`PadfreeTrainerMixin`); ``False`` keeps the Trainer's sampler.
            No effect in one process.
        padfree_fused_loss: train with :func:`padfree.causal_lm_loss` — the LM head and the cross-entropy fused, in
            chunks, over target positions only, no logits tensor — under either loss rule (default False).
            Evaluation, and any call that asks for the outputs, runs the model's own head.

    When ``data_collator`` is one of padfree's (:class:`PackedRowsCollator`, ``PaddingFreeCollator``,
    ``packed_collate_fn``) the model is passed to :func:`padfree.configure_packing` first, which makes it exact
    for packed rows or raises :class:`~padfree.errors.UnsupportedModelError`. A ``compute_loss_func`` or label
    smoothing takes over the loss (then transformers' normalisation applies); with ``padfree_fused_loss=True`` they
    are refused (InvalidArgumentError), as the fused loss would silently compute another loss.

    Typical use::

        rows = padfree.pack_for_trainer(tokenized, max_length=2048)
        trainer = padfree.Trainer(model=model, args=args, train_dataset=rows,
                                  data_collator=padfree.PackedRowsCollator())
    """


def enable(trainer_class: type) -> type:
    """The padfree version of a trainer class: ``enable(trl.SFTTrainer)`` is :class:`padfree.SFTTrainer`; a
    ``transformers.Trainer`` subclass gets the loss rule, telemetry and ``configure_packing`` of :class:`Trainer`;
    your own subclass of either keeps its overrides (padfree's come first in the method order).

    >>> import transformers
    >>> cls = enable(transformers.Trainer)
    >>> cls.__name__, issubclass(cls, transformers.Trainer)
    ('Trainer', True)
    """
    if not isinstance(trainer_class, type):
        raise InvalidArgumentError(
            f"enable takes a trainer class (e.g. trl.SFTTrainer or transformers.Trainer), got {describe(trainer_class)}"
            f"; build the trainer from the returned class — a constructed trainer has already prepared its data"
        )
    trl = sys.modules.get("trl")
    if trl is None and "SFTTrainer" in [c.__name__ for c in trainer_class.__mro__]:
        import trl
    if trl is not None and issubclass(trainer_class, trl.SFTTrainer):
        from padfree.integrations.trl import SFTTrainer, _SFTMixin

        if trainer_class is trl.SFTTrainer:
            return SFTTrainer
        if issubclass(trainer_class, _SFTMixin):
            return trainer_class
        return type(f"Padfree{trainer_class.__name__}", (_SFTMixin, trainer_class), {"__module__": __name__})
    if issubclass(trainer_class, transformers.Trainer):
        if issubclass(trainer_class, PadfreeTrainerMixin):
            return trainer_class
        if trainer_class is transformers.Trainer:
            return Trainer
        return type(f"Padfree{trainer_class.__name__}", (_TrainerMixin, trainer_class), {"__module__": __name__})
    raise InvalidArgumentError(
        f"enable takes a subclass of transformers.Trainer or trl.SFTTrainer, got {trainer_class.__qualname__}"
    )
