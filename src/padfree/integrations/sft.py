"""padfree for TRL's ``SFTTrainer``: exact padding-free batching by default, exact global packing on request.

``padfree.SFTTrainer`` is a drop-in subclass of ``trl.SFTTrainer`` (same arguments; ``padfree.enable(MyTrainer)``
does the same for your own subclass). TRL still reads, formats and tokenizes the data — chat templates,
prompt-completion and assistant masks work as before — and padfree replaces what makes a batch:

``"padding-free batching"`` (automatic when safe, or ``padding_free=True``)
    Every loader batch of tokenized samples becomes one row: sequences back to back, ``position_ids`` restarting
    at each, the first label of each ``-100``, no padding and no ``attention_mask``
    (:class:`~padfree.PackedRowsCollator`).
``"sample packing"`` (``packing=True``)
    The whole tokenized dataset is packed at once by padfree's engine (best fit decreasing, ``obfd``) into rows of at
    most ``max_length`` tokens — not TRL's blocks of 1,000 rows — and rows are collated as above.
    ``packing_strategy="bfd"`` (TRL's default) truncates sequences longer than ``max_length`` first, as TRL does;
    ``"bfd_split"`` splits them into pieces that are sequences of their own; a padfree strategy name (``"ffd"``,
    ...) picks that strategy; ``"wrapped"`` cuts the stream of sequences into full rows as TRL does, but every piece
    of a cut sequence is a sequence of its own (TRL's wrapped rows carry no boundaries at all, so a row's documents
    attend to each other).
    Under data parallelism the rows are dealt to the ranks in steps balanced in tokens and Σ len² (not sharded by
    count); ``padfree_balance=False`` in :class:`SFTConfig` keeps the Trainer's sampler.
``"standard batching"``
    TRL's own padded batches, untouched.

In both padfree modes the model goes through :func:`padfree.configure_packing` — attention (and recurrent state,
for hybrid models) that stops at every boundary — which fails closed: a model it cannot make exact raises
:class:`~padfree.errors.UnsupportedModelError` instead of training on contaminated attention. Completion-only and
assistant-only losses keep working: TRL's label masks are carried into the packed rows.

**Automatic padding-free batching is skipped**, with the reason logged, when

- the environment variable ``PADFREE_DISABLE_AUTO_PADDING_FREE=1`` is set, or the config has
  ``auto_padding_free=False`` (:class:`SFTConfig`, or that attribute set on a ``trl.SFTConfig``);
- the environment asks for logits to be returned (``PADFREE_RETURN_LOGITS=1``, or Unsloth's
  ``UNSLOTH_RETURN_LOGITS=1``): a padding-free forward returns one flattened row of logits, not one per sample;
- a ``data_collator`` is given (padfree would have to replace it);
- the dataset holds images (TRL's vision formats) and padfree does not lay out the model's images per sample
  (:func:`~padfree.integrations.decide.image_reason`: exact for the Qwen-VL mRoPE family and Gemma3/Gemma4 image
  blocks);
- padfree does not support the model (:func:`support_reason`: what :func:`padfree.configure_packing` would decide —
  the support table of the sweep, or an on-the-spot certification of a tiny twin of the model's class).

**Vision-language data.** With a processor and TRL's vision formats (``images`` + ``messages``, or
``prompt`` + ``completion`` with images), TRL's vision collator still runs the processor on every loader batch, and
padfree makes its padded batch one row (:class:`~padfree.integrations.trainer_data.PackedVisionCollator`): the
samples' tokens back to back, ``position_ids`` restarting, token types laid out like the tokens, pixel values and
grids in sample order; the configured model computes each sample's mRoPE positions or image blocks. ``packing=True``
packs whole samples by their processed token counts (each sample through the processor once at construction).
A vision-language model on text-only data trains like any causal LM.

**Explicit settings always win** over the automatic choice: ``packing=True`` / ``padding_free=True`` turn padfree
on even with the environment opt-out set, and refuse (naming why) what they cannot do exactly — a custom collator,
images of a model padfree does not lay out per sample, a model padfree does not support, ``max_length`` missing with
packing. With :class:`SFTConfig`, whose
``packing`` and ``padding_free`` default to None ("decide for me"), ``padding_free=False`` is an explicit opt-out
too; a plain ``trl.SFTConfig`` cannot tell ``False`` from its default, so use the opt-outs above.

After construction ``trainer.args.packing`` and ``trainer.args.padding_free`` tell the truth, and
``padfree.packing_status(trainer)`` says which mode is active and why (also logged through the ``padfree`` logger).
padfree's loss rule (:mod:`padfree.step_loss`) makes the loss the token mean of the optimizer step
(``padfree_loss="sequence"``: the mean of per-sequence means), and :class:`~padfree.PackingTelemetryCallback` is
added when a padfree mode is on.

**Evaluation.** TRL's ``eval_packing`` decides whether the eval set is packed like the train set: None follows
``packing``, False never packs, True packs in padding-free mode too (reading ``packing_strategy`` and ``max_length``
as ``packing=True`` would), and in a padfree mode unpacked eval batches are flattened padding-free. ``eval_loss``
follows the loss rule over the whole eval set — Σ token losses / Σ targets, or the mean of per-sequence means —
instead of the Trainer's mean of per-batch means, so it is the same packed or not, at any eval batch size (see
``evaluation_loop``).

Typical use::

    from padfree import SFTConfig, SFTTrainer, packing_status
    trainer = SFTTrainer(model=model, args=SFTConfig("out", packing=True, max_length=2048),
                         train_dataset=dataset, processing_class=tokenizer)
    print(packing_status(trainer))   # padfree: sample packing (packing=True); 7473 sequences in 512 rows, ...
    trainer.train()
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import Any

from padfree.data.hf import plan_dataset
from padfree.errors import (
    BackendUnavailableError,
    DataLoadError,
    InvalidArgumentError,
    UnsupportedModelError,
    describe,
)
from padfree.integrations.base import Construction, TrainerOptions, TrainerProtocol, as_config, plan_fields
from padfree.integrations.causal_lm import PadfreeTrainerMixin
from padfree.integrations.decide import ENV_DISABLE_AUTO as ENV_DISABLE_AUTO
from padfree.integrations.decide import ENV_RETURN_LOGITS as ENV_RETURN_LOGITS
from padfree.integrations.decide import (
    Cause,
    Decision,
    Skip,
    as_tri_state,
    auto_decision,
    first_sample,
    holds_images,
    image_reason,
    refuse_unsafe,
    skip_reason,
)
from padfree.integrations.loaders import sequence_parallel_size, setup_sequence_parallel
from padfree.integrations.status import PACKING, PADDING_FREE, STANDARD
from padfree.integrations.trainer_data import (
    PackedRowsCollator,
    PackedVisionCollator,
    pack_vision_rows,
    trainer_rows,
)
from padfree.packing.inputs import as_choice, as_flag
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES, as_strategy
from padfree.step_loss import LOSS_MODES, refuse_with_own_nll, scored_labels, token_losses

try:
    import datasets
    import torch
    import trl
except ImportError as exc:  # pragma: no cover - trl is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.sft needs trl, transformers and datasets; pip install 'padfree[trl]'"
    ) from exc

__all__ = [
    "SFTConfig",
    "SFTTrainer",
]

logger = logging.getLogger("padfree")

_TRL_STRATEGIES = {"bfd": "error", "bfd_split": "split"}  # TRL's name -> overlong policy after TRL's truncation


@dataclasses.dataclass
class SFTConfig(TrainerOptions, trl.SFTConfig):
    """``trl.SFTConfig`` whose ``packing`` / ``padding_free`` can say "decide for me", plus padfree's options.

    Args:
        packing: True: padfree's global packing; False: no packing; None (default): no packing.
        padding_free: True: padding-free batching; False: explicitly off (standard batching); None (default):
            padfree decides (on when safe, see the module docstring).
        auto_padding_free: False turns the automatic choice off (as ``PADFREE_DISABLE_AUTO_PADDING_FREE=1`` does).
        padfree_loss: ``"token"`` (token mean over the optimizer step) or ``"sequence"`` (mean of per-sequence
            means over the step).
        padfree_telemetry: add :class:`~padfree.PackingTelemetryCallback` when a padfree mode
            is on.
        padfree_balance: with ``packing=True`` under data parallelism (``world_size > 1``), deal the packed rows to
            the ranks in steps balanced in tokens and Σ len² instead of sharding them by count (see
            :class:`~padfree.integrations.trainer.PadfreeTrainerMixin`); no effect in one process.
        padfree_fused_loss: compute the training loss with :func:`padfree.causal_lm_loss` — the LM head and the
            cross-entropy fused, in chunks, over the positions that have a target — instead of materialising the
            logits: less memory, less time, either loss rule. TRL's ``entropy`` and
            ``mean_token_accuracy`` metrics come from the fused pass's own counts; evaluation and anything that
            asks for the outputs run the model's own head.
        padfree_sequence_parallel: split every row across groups of this many ranks (sequence parallelism,
            ``configure_packing(model, sequence_parallel=...)``; default 1: none): the ranks of a group load the same
            batches, each trains its slice, DDP / FSDP2 over all ranks reduces the gradients.

    Every other argument is ``trl.SFTConfig``'s (``max_length`` is the row length when packing).

    >>> cfg = SFTConfig("out", report_to="none", use_cpu=True)
    >>> cfg.packing, cfg.padding_free, cfg.auto_padding_free, cfg.padfree_loss, cfg.padfree_balance
    (None, None, True, 'token', True)
    """

    packing: bool | None = dataclasses.field(
        default=None, metadata={"help": "True: padfree's global packing (rows of max_length). None/False: none."})
    padfree_loss: str = dataclasses.field(
        default="token", metadata={"help": "'token' (token mean of the optimizer step) or 'sequence'.",
                                   "choices": list(LOSS_MODES)})
    padfree_balance: bool = dataclasses.field(
        default=True, metadata={"help": "Data-parallel packing: balance the ranks' rows (tokens and sum of len^2)."})
    padfree_fused_loss: bool = dataclasses.field(
        default=False, metadata={"help": "Training loss without logits: LM head + cross-entropy fused, in chunks, "
                                         "over target positions only (padfree.causal_lm_loss)."})
    padfree_sequence_parallel: int = dataclasses.field(
        default=1, metadata={"help": "Split every row across groups of this many ranks (sequence parallelism; "
                                     "needs a launcher and padfree_loss='token')."})


# --------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------


def _check_columns(dataset: Any, args: Any, formatting_func: Any) -> None:
    """A dataset TRL can tokenize: ``input_ids``, the text field, messages, or prompt + completion."""
    if dataset is None or formatting_func is not None or (args.dataset_kwargs or {}).get("skip_prepare_dataset"):
        return
    names = getattr(dataset, "column_names", None)
    if names is None:
        sample = first_sample(dataset)
        names = list(sample) if isinstance(sample, dict) else None
    if names is None:
        return
    ok = ("input_ids" in names or args.dataset_text_field in names or "messages" in names
          or "conversations" in names or {"prompt", "completion"} <= set(names) or "image" in names
          or "images" in names)
    if not ok:
        raise DataLoadError(
            f"train_dataset has columns {sorted(names)}: no 'input_ids' and no text field "
            f"{args.dataset_text_field!r} (dataset_text_field); accepted: tokenized rows ('input_ids', optional "
            f"'labels'), a text column named by dataset_text_field, 'messages', or 'prompt' + 'completion' — or "
            f"pass formatting_func"
        )


def _strategy(args: Any) -> tuple[str, str]:
    name = args.packing_strategy
    if name in _TRL_STRATEGIES:
        return DEFAULT_STRATEGY, _TRL_STRATEGIES[name]
    try:
        strategy = as_strategy(name, "packing_strategy")
    except InvalidArgumentError:
        pass
    else:
        # a strategy that cuts at the rows' edges gets whole sequences (no truncation first) and cuts them itself
        return strategy, "split" if STRATEGIES[strategy].cuts_at_row_edges else "error"
    raise InvalidArgumentError(
        f"packing_strategy={describe(name)} is not one padfree packs exactly; accepted: 'bfd' (TRL's default: "
        f"truncate to max_length, then padfree's best fit decreasing over the whole dataset), 'bfd_split' (split "
        f"longer sequences into pieces), 'wrapped' (full rows, every cut piece a sequence of its own) or a padfree "
        f"strategy ({', '.join(STRATEGIES)})"
    )


def _decide(args: Any, model: Any, config: Any, processing_class: Any, data_collator: Any, train_dataset: Any,
            formatting_func: Any) -> Decision:
    packing, padding_free = as_tri_state(args.packing, "packing"), as_tri_state(args.padding_free, "padding_free")
    explicit = isinstance(args, SFTConfig)  # a plain trl.SFTConfig cannot tell False from its default
    _check_columns(train_dataset, args, formatting_func)
    sample = first_sample(train_dataset) if train_dataset is not None else None
    if packing:
        if explicit and padding_free is False:
            raise InvalidArgumentError("packing=True with padding_free=False: padfree's packed rows are collated "
                                       "without padding; drop padding_free=False, or unset packing")
        refuse_unsafe("packing=True", model, config, processing_class, data_collator, sample, vision=True)
        max_length = args.max_length
        if max_length is None or isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise InvalidArgumentError(f"packing=True needs max_length, the tokens of one packed row: an int >= 1, "
                                       f"got max_length={describe(max_length)}")
        if isinstance(train_dataset, datasets.IterableDataset):
            raise InvalidArgumentError(
                "packing=True packs the whole dataset at once, which needs a datasets.Dataset; train_dataset is an "
                "IterableDataset — use padding_free=True, or padfree.IterablePackingDataset with a plain Trainer")
        strategy, overlong = _strategy(args)
        if holds_images(sample) and STRATEGIES[strategy].cuts_at_row_edges:
            raise InvalidArgumentError(f"packing_strategy={args.packing_strategy!r} cuts samples at the rows' edges, "
                                       f"and a sample's images cannot follow a cut; use 'bfd' or a padfree strategy "
                                       f"that keeps samples whole with images")
        return Decision(PACKING, f"packing=True: global {strategy} packing into rows of max_length={max_length}",
                         auto=False, strategy=strategy, overlong=overlong)
    if padding_free:
        refuse_unsafe("padding_free=True", model, config, processing_class, data_collator, sample, vision=True)
        return Decision(PADDING_FREE, "padding_free=True", auto=False)
    if explicit and padding_free is False:
        return Decision(STANDARD, "padding_free=False", auto=False)
    return auto_decision(skip_reason(args, model, config, processing_class, data_collator, sample, vision=True),
                         config)


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------


class SFTMixin(TrainerProtocol, PadfreeTrainerMixin):
    """What :class:`SFTTrainer` adds to ``trl.SFTTrainer`` (and :func:`padfree.enable` to its subclasses)."""

    _padfree_train_prepared = False
    _padfree_hidden = ("packing", "padding_free")  # TRL tokenizes and pads; padfree packs and swaps the collator

    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *rest: Any, **kwargs: Any) -> None:
        args = as_config(args, model, SFTConfig, trl.SFTConfig, "SFT", from_training_arguments=True)
        given = Construction(model, args, train_dataset, eval_dataset, processing_class, data_collator, kwargs=kwargs)
        self._padfree_construct(given, functools.partial(super().__init__, model, args, data_collator, train_dataset,
                                                         eval_dataset, processing_class, *rest, **kwargs))

    # ---- the construction's hooks (padfree.integrations.base) ---------------------------------------------

    def _padfree_check(self, given: Construction, config: Any) -> None:
        args = given.args
        self._padfree_loss_choice = as_choice(getattr(args, "padfree_loss", "token"), "padfree_loss", LOSS_MODES)
        self._padfree_sp_size = sequence_parallel_size(getattr(args, "padfree_sequence_parallel", 1),
                                                       "padfree_sequence_parallel")
        self.padfree_balance = as_flag(getattr(args, "padfree_balance", True), "padfree_balance")
        self.padfree_fused_loss = as_flag(getattr(args, "padfree_fused_loss", False), "padfree_fused_loss")
        for flag, what in ((self._padfree_loss_choice == "sequence", "padfree_loss='sequence'"),
                           (self.padfree_fused_loss, "padfree_fused_loss=True")):
            if flag:
                refuse_with_own_nll(what, args, given.kwargs.get("compute_loss_func"))
        self._padfree_plans: dict[str, Any] = {}

    def _padfree_decide(self, given: Construction, config: Any) -> Decision:
        return _decide(given.args, given.model, config, given.processing_class, given.data_collator,
                       given.train_dataset, given.kwargs.get("formatting_func"))

    def _padfree_modules(self, model: Any, ref_model: Any) -> list[Any]:
        return [model]

    def _padfree_configure_given(self, given: Construction, decision: Decision) -> None:
        if not isinstance(given.model, str):  # the group first: configure_packing then splits every forward
            setup_sequence_parallel(given.model, given.args, self._padfree_sp_size, self._padfree_loss_choice)
        super()._padfree_configure_given(given, decision)

    def _padfree_settle(self, given: Construction, decision: Decision) -> Decision:
        if isinstance(given.model, str):  # loaded by TRL; a model instance is configured already
            if decision.on and getattr(self, "_is_vision_dataset", False):
                decision = self._padfree_images_checked(decision)
            setup_sequence_parallel(self.model, given.args, self._padfree_sp_size, self._padfree_loss_choice)
        return decision

    def _padfree_finish(self, given: Construction, decision: Decision) -> Any:
        if decision.on:
            self.padding_free = True
            if getattr(self, "_is_vision_dataset", False):  # TRL's collator runs the processor per loader batch;
                # padfree makes its batch one row
                self.data_collator = PackedVisionCollator(self.data_collator)
                if decision.mode == PACKING:
                    self.train_dataset = self._padfree_vision_rows(self.train_dataset, decision)
            else:
                self.data_collator = PackedRowsCollator()
        self._padfree_setup(self._padfree_loss_choice, telemetry=False)  # the protocol attaches the telemetry
        return self._padfree_plans.get("train")

    def _padfree_report(self, decision: Decision, plan: Any) -> dict[str, Any]:
        return {"loss": self.padfree_loss, **plan_fields(plan), "balance": self._padfree_balance_note()}

    # ---- data ------------------------------------------------------------------------------------------

    def _padfree_images_checked(self, decision: Decision) -> Decision:
        """``decision`` for image data once TRL loaded the model by name: standard batching naming the reason (auto),
        or a refusal (explicit), where padfree cannot put its images in packed rows."""
        why = image_reason(self.model)
        if why is None:
            return decision
        if decision.auto:
            return auto_decision(Skip(why, Cause.DATA), None)
        raise UnsupportedModelError(f"{decision.reason} with images: {why}; unset packing / padding_free to train "
                                    f"with TRL's padded batches")

    def _padfree_vision_rows(self, dataset: Any, decision: Decision) -> Any:
        """The vision train set as rows of samples packed by their processed token counts (each sample alone through
        TRL's collator: its images expanded to their tokens, truncated to ``max_length`` as TRL truncates)."""
        collate = self.data_collator.collator
        counts = []
        for start in range(0, len(dataset), 32):
            chunk = [dataset[i] for i in range(start, min(start + 32, len(dataset)))]
            counts.append(collate(chunk)["attention_mask"].sum(1))
        lengths = torch.cat(counts).numpy() if counts else []
        rows, plan = pack_vision_rows(dataset, lengths, self.args.max_length, decision.strategy, seed=self.args.seed)
        self._padfree_plans["train"] = plan
        logger.info("padfree: packed the train dataset — %d samples with their images into %d rows of "
                    "max_length=%d (%s, efficiency %.2f%%)", plan.num_sequences, plan.num_bins, self.args.max_length,
                    decision.strategy, 100 * plan.efficiency)
        return rows

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, packing: bool, formatting_func: Any,
                         dataset_name: str) -> Any:
        decision = self._padfree_decision
        if decision is None or decision.mode == STANDARD:
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        # TRL names the train set "train" and each eval set by its key, which may be "train" too: the train set is
        # the first one prepared
        is_train = dataset_name == "train" and not self._padfree_train_prepared
        self._padfree_train_prepared = True
        if is_train:
            pack = decision.mode == PACKING
        else:
            pack = decision.mode == PACKING if args.eval_packing is None else bool(args.eval_packing)
        names = getattr(dataset, "column_names", None) or ()
        if "seq_lens" in names:  # already packed by padfree (evaluate() prepares its datasets again)
            return dataset
        strategy, overlong = decision.strategy, decision.overlong
        if pack and decision.mode != PACKING:
            # eval_packing=True in padding-free mode: the training decision never read packing_strategy or
            # max_length, so check them here, before tokenizing
            strategy, overlong = _strategy(args)
            max_length = args.max_length
            if max_length is None or isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
                raise InvalidArgumentError(
                    f"eval_packing=True packs the {dataset_name} dataset into rows of max_length tokens: an int >= 1, "
                    f"got max_length={describe(max_length)}; set max_length, or eval_packing=False / None")
        prep_args = args
        if pack and overlong == "split":
            prep_args = copy.copy(args)  # keep whole sequences: padfree splits them into pieces
            prep_args.max_length = None
        dataset = super()._prepare_dataset(dataset, processing_class, prep_args, False, formatting_func, dataset_name)
        if not pack:
            return dataset
        if not isinstance(dataset, datasets.Dataset):
            raise InvalidArgumentError(f"packing the {dataset_name} dataset needs a datasets.Dataset, got "
                                       f"{describe(dataset)}; set eval_packing=False or padding_free=True")
        columns = [c for c in ("input_ids", "labels") if c in dataset.column_names]
        data = dataset.select_columns(columns)
        plan = plan_dataset(data, args.max_length, strategy, seed=args.seed, overlong=overlong)
        rows = trainer_rows(plan, data)
        self._padfree_plans["train" if is_train else f"eval/{dataset_name}"] = plan
        logger.info("padfree: packed the %s dataset — %d sequences (%d pieces) into %d rows of max_length=%d (%s, "
                    "efficiency %.2f%%)", dataset_name, plan.num_sequences, plan.num_pieces, plan.num_bins,
                    args.max_length, strategy, 100 * plan.efficiency)
        return rows

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        decision = self._padfree_decision
        if decision is not None and decision.mode != STANDARD and self._signature_columns is not None:
            self._signature_columns = [*self._signature_columns, "seq_lens", "position_ids"]

    # ---- loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        trl_loss = super(PadfreeTrainerMixin, self).compute_loss  # TRL's (or the user's subclass's) compute_loss
        if self.padfree_loss is None or ("labels" not in inputs and "shift_labels" not in inputs):
            return trl_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self._padfree_slice_checked(inputs)
        if self._padfree_fuses(return_outputs):
            return self._padfree_fused(model, inputs, num_items_in_batch)
        if self.padfree_loss == "token":
            denom = self._padfree_denominator(num_items_in_batch)
            if denom is not None and self.args.average_tokens_across_devices:
                # TRL divides by the count, then multiplies by its world size: hand it the count that leaves
                # Σ loss · world / (targets of the step)
                denom = denom * max(self.accelerator.num_processes // self._trl_tp(), 1)
            out = trl_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=denom)
            if denom is None and self.model.training:
                out = (out[0] / self.current_gradient_accumulation_steps, out[1]) if return_outputs else (
                    out / self.current_gradient_accumulation_steps)
        else:
            out = self._sequence_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._padfree_eval_sums is not None and not self.model.training:
            self._padfree_eval_record(out[0] if return_outputs else out, inputs)
        return out

    def _trl_tp(self) -> int:
        getter = getattr(self, "get_tp_size", None)
        return int(getter()) if callable(getter) else 1

    def _sequence_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
                       ) -> Any:
        inputs["use_cache"] = False
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        if return_outputs:  # the caller wants the logits: one forward that makes them serves the loss too
            outputs = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")})
            token_loss, mask, entropy_sum, top1 = _logit_stats(outputs.logits, inputs)
        else:  # TRL's fused head: per-target log-probs, entropy and top-1 without materialising the logits
            outputs = model(**inputs, fused_lm_head=True)
            token_loss, mask = -outputs.log_probs, outputs.label_mask
            entropy_sum, top1 = outputs.entropy.detach().sum(), outputs.is_top1.sum()
        denom = self._padfree_denominator(num_items_in_batch)
        loss = self._padfree_rule.reduce(token_loss, mask, inputs, denom, shifted="shift_labels" not in inputs)
        loss = self._padfree_unscaled(loss, denom)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / (
                self.current_gradient_accumulation_steps if self.model.training else 1)
        self._trl_metrics(mask.sum(), entropy_sum, top1, inputs)
        return (loss, outputs) if return_outputs else loss

    _padfree_logit_metrics = True  # TRL logs entropy and mean_token_accuracy

    def _padfree_fused_metrics(self, stats: dict[str, torch.Tensor], inputs: dict[str, Any]) -> None:
        self._trl_metrics(stats["targets"], stats["entropy"], stats["correct"], inputs)

    def _trl_metrics(self, targets: torch.Tensor, entropy_sum: torch.Tensor, top1: torch.Tensor,
                     inputs: dict[str, Any]) -> None:
        """The metrics TRL's ``compute_loss`` records (entropy, token accuracy, tokens seen), from counts."""
        mode = "train" if self.model.training else "eval"
        dev = entropy_sum.device
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(targets.to(dev).reshape(1)).sum()
        entropy = gather(entropy_sum.reshape(1)).sum()
        correct = gather(top1.to(dev).reshape(1)).sum()
        self._metrics[mode]["entropy"].append((entropy / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            ref = inputs.get("attention_mask")
            local = ref.sum() if ref is not None else torch.tensor(inputs["position_ids"].numel(),
                                                                   device=inputs["position_ids"].device)
            self._total_train_tokens += gather(local.reshape(1)).sum().item() // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


def _logit_stats(logits: torch.Tensor, inputs: Mapping[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_loss, mask, entropy_sum, top1)`` from full logits, as TRL's fused head reports them: the fp32
    cross-entropy and target mask of every scored position (:func:`token_losses`), and over the targets the summed
    entropy of the predicted distribution and the count of arg-max hits."""
    token_loss, mask = token_losses(logits, inputs)
    scored = (logits[:, :-1] if "shift_labels" not in inputs else logits)[mask].float()
    targets = scored_labels(inputs)[0][mask]
    with torch.no_grad():
        logp = torch.log_softmax(scored, dim=-1)
        entropy = -(logp.exp() * logp).sum()
        top1 = (scored.argmax(dim=-1) == targets).sum()
    return token_loss, mask, entropy, top1


class SFTTrainer(SFTMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with exact padding-free batching (automatic when safe) and exact global packing
    (``packing=True``): see the module docstring for the modes, the skip reasons and the opt-outs.

    Takes exactly ``trl.SFTTrainer``'s arguments. ``args`` may be a ``trl.SFTConfig`` or padfree's
    :class:`SFTConfig` (whose ``packing`` / ``padding_free`` default to None, "padfree decides", and which adds
    ``auto_padding_free``, ``padfree_loss``, ``padfree_telemetry`` and ``padfree_balance``); when it is None, a padfree
    :class:`SFTConfig` is made. After construction, ``padfree.packing_status(trainer)`` reports the mode and why.

    Raises:
        InvalidArgumentError: ``packing=True`` / ``padding_free=True`` with a custom ``data_collator``;
            ``packing=True`` without ``max_length >= 1``, with an unknown ``packing_strategy`` (``"wrapped"`` with
            images) or an ``IterableDataset``.
        UnsupportedModelError: an explicit padfree mode on images padfree does not lay out per sample, on an
            unsupported model, or a model that ``configure_packing`` cannot make exact.
        DataLoadError: a dataset without ``input_ids``, without the text field and without messages or
            prompt/completion columns.
    """
