"""padfree's ``transformers.Trainer``: the loss rule, the telemetry and balanced data-parallel steps, for any
``Trainer`` subclass.

:class:`Trainer` is ``transformers.Trainer`` with :class:`~padfree.integrations.causal_lm.PadfreeTrainerMixin` (the
loss rule of :mod:`padfree.step_loss` over every optimizer step, ``eval_loss`` under the same rule,
:class:`~padfree.integrations.telemetry.PackingTelemetryCallback`, and the loaders of
:mod:`padfree.integrations.loaders`: packed rows dealt to data-parallel ranks in balanced steps), the in-run proof of
:mod:`padfree.integrations.inrun` (``padfree_verify``) and
``configure_packing`` (called when the collator is one of padfree's, so the model either honours packed rows or
refuses); :func:`padfree.enable` does the same for your own subclass, and ``padfree.SFTTrainer`` for TRL's.

>>> import transformers
>>> from padfree.integrations.causal_lm import PadfreeTrainerMixin
>>> issubclass(Trainer, transformers.Trainer) and issubclass(Trainer, PadfreeTrainerMixin)
True
"""

from __future__ import annotations

import logging
from typing import Any

from padfree.data.batch import PackedCollator, PaddingFreeCollator
from padfree.errors import BackendUnavailableError
from padfree.integrations.causal_lm import PadfreeTrainerMixin
from padfree.integrations.decide import configure_model
from padfree.integrations.inrun import InRunProofMixin
from padfree.integrations.loaders import sequence_parallel_size, setup_sequence_parallel
from padfree.integrations.status import PACKING, PADDING_FREE, STANDARD, PackingStatus, model_facts
from padfree.packing.inputs import as_choice, as_flag
from padfree.step_loss import LOSS_MODES, refuse_with_own_nll

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.trainer needs torch and transformers; pip install 'padfree[torch,hf]'"
    ) from exc

__all__ = ["Trainer", "TrainerMixin"]

logger = logging.getLogger("padfree")


def _is_padfree_collator(collator: Any) -> bool:
    return isinstance(collator, (PackedCollator, PaddingFreeCollator))


class TrainerMixin(InRunProofMixin, PadfreeTrainerMixin):
    """What :class:`Trainer` adds to ``transformers.Trainer`` (and :func:`padfree.enable` to its subclasses): the
    padfree arguments, ``configure_packing`` when the collator is padfree's, and the recorded
    :class:`~padfree.integrations.status.PackingStatus`."""

    def __init__(self, *args: Any, padfree_loss: str = "token", padfree_telemetry: bool = True,
                 padfree_balance: bool = True, padfree_fused_loss: bool = False,
                 padfree_sequence_parallel: int | None = None, padfree_verify: Any = "first_step",
                 **kwargs: Any) -> None:
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
        if mode != STANDARD:
            self._padfree_attach_proof(padfree_verify)
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
        padfree_verify: ``"first_step"`` (default): before the first optimizer step, a few of the first packed
            micro-batch's sequences run packed and alone on this model, device and precision
            (:mod:`padfree.integrations.inrun`), logged as ``padfree/verify_*``, the run stopped on a mismatch;
            ``"every:N"``: every N steps; ``False``: never.

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
