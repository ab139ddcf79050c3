"""padfree for TRL's ``DPOTrainer``: exact padding-free preference batches, and pairs packed across the dataset.

``padfree.DPOTrainer`` is a drop-in subclass of ``trl.DPOTrainer`` (same arguments). TRL still tokenizes the pairs,
keeps its loss types, reference model (or precomputed reference log-probs), metrics and logging; padfree changes how
each forward runs:

``"padding-free batching"`` (automatic when safe, or ``padding_free=True``)
    Each micro-batch — every pair's chosen and rejected sequence — runs as one packed row: the real tokens back to
    back, ``position_ids`` restarting at every sequence, no padding. The reference model's pass (and the precompute
    of reference log-probs) runs the same row. TRL's fused LM head builds no ``(tokens, vocab)`` logits tensor (it
    scores in chunks; with Triton, on CUDA, only the completion tokens); the per-token log-probs, entropies and
    top-1 hits come back in the padded ``(2B, L - 1)`` layout, and TRL's own loss and metric code runs on them
    unchanged — so every loss type gives what TRL's padded trainer gives on the same micro-batches.
``"sample packing"`` (``packing=True``)
    The train set's pairs are packed across the dataset (best fit decreasing) into micro-batches of at most
    ``packing_length`` tokens (default: the padded micro-batch's positions, ``2 · max_length ·
    per_device_train_batch_size``), each pair whole in one micro-batch, each micro-batch one packed row as above
    (so ``per_device_train_batch_size`` only sizes the default ``packing_length``).
    A micro-batch now holds a varying number of pairs, so padfree weighs the loss by pairs over the optimizer step
    (across gradient accumulation and ranks): the step's loss is the mean over its pairs, as a padded step's is; the
    logged per-pair metrics (``rewards/*``, ``logps/*``) are pair-weighted means. Loss types that couple the pairs of
    a micro-batch (``aot`` and ``aot_unpaired`` sort them, ``sft`` is a token mean over the micro-batch) cannot give
    what a padded micro-batch gives and are refused with packing. Evaluation runs padding-free (not packed).
``"standard batching"``
    TRL's padded batches, untouched.

In both padfree modes the policy and the reference model go through :func:`padfree.configure_packing`, which fails
closed (:class:`~padfree.errors.UnsupportedModelError` instead of a leaking forward); the automatic choice is skipped,
with the reason logged, on the same grounds as :class:`padfree.SFTTrainer`'s (an environment opt-out, a custom
collator, images padfree does not lay out per sample, a model padfree cannot make exact) and for prompt-learning PEFT
adapters, whose virtual tokens belong to each sequence. ``padfree.packing_status(trainer)`` says which mode runs.

Images (TRL's vision preference format: ``images`` with ``prompt`` / ``chosen`` / ``rejected``, and a processor) run
padding-free too: TRL's collator hands the images in the order of its rows (every pair's images for the chosen
sequences, then again for the rejected ones), the packed row keeps that order, and the token types
(``mm_token_type_ids``, ``token_type_ids``) are packed like the tokens, so a model configured by
:func:`padfree.configure_packing` lays each sample's images out on its own (Qwen-VL's mRoPE positions, Gemma3's image
blocks). Where padfree cannot (:func:`~padfree.integrations.decide.image_reason`: Mllama's cross-attention, ...), the
automatic choice is skipped naming the module, an explicit ``padding_free=True`` refused. ``packing=True`` packs TRL's
tokenized pairs, which image data never becomes: refused with images.

The datasets are read through :mod:`padfree.integrations.preference_data` before TRL sees them, whatever the mode:
a missing column, a None, a value of another type, an empty completion or no rows is one
:class:`~padfree.errors.InvalidSampleError` naming the column and the row. The pairs TRL drops (with
``truncation_mode="keep_start"``, those whose prompt fills ``max_length``) are counted in
``packing_status(trainer).dropped`` and logged once at WARNING; a ``max_length`` that would drop them all is refused
before training.

    from padfree import DPOConfig, DPOTrainer
    trainer = DPOTrainer(model=model, args=DPOConfig("out", padding_free=True), train_dataset=pairs,
                         processing_class=tokenizer)
    trainer.train()

>>> cfg = DPOConfig("out", report_to="none", use_cpu=True)
>>> cfg.padding_free, cfg.packing, cfg.packing_length, cfg.auto_padding_free, cfg.padfree_fused_head
(None, False, None, True, True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.integrations.base import Construction, TrainerOptions, TrainerProtocol, as_config, plan_fields
from padfree.integrations.decide import (
    PROMPT_LEARNING_SKIP,
    Decision,
    Skip,
    as_tri_state,
    auto_decision,
    first_sample,
    holds_images,
    prompt_learning,
    refuse_prompt_learning,
    refuse_unsafe,
    skip_reason,
)
from padfree.integrations.fused_head import FusedHeadOptions, LogProbHead, fused_head_on
from padfree.integrations.loaders import SamplerEpoch, balance_note, balanced_sampler, batch_sampler_dataloader
from padfree.integrations.preference_data import (
    DPO_DATA,
    DropRule,
    check_dataset,
    check_datasets,
    dataset_label,
    drop_counted,
    refuse_long_pairs,
)
from padfree.integrations.status import PACKING, PADDING_FREE, STANDARD
from padfree.integrations.unpadded import unpadded_forwards
from padfree.packing.inputs import as_capacity, as_flag
from padfree.packing.packer import pack_sequences
from padfree.packing.strategies import DEFAULT_STRATEGY
from padfree.step_loss import LossRule

try:
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch
    import trl
except ImportError as exc:  # pragma: no cover - trl is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.dpo needs trl, transformers and datasets; pip install 'padfree[trl]'"
    ) from exc

__all__ = ["DPOConfig", "DPOTrainer"]

logger = logging.getLogger("padfree")

# loss types whose value for a micro-batch is not a mean of independent per-pair terms
_BATCH_COUPLED = {"aot": "sorts the micro-batch's log-ratios", "aot_unpaired": "sorts the micro-batch's log-ratios",
                  "sft": "is a token mean over the micro-batch's chosen completions"}
# TRL's metrics that are a mean over the pairs of a micro-batch
_PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")
_PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
_PAIRS = LossRule("pair")  # packed micro-batches: the step's loss is the mean over its pairs


@dataclasses.dataclass
class DPOConfig(TrainerOptions, FusedHeadOptions, trl.DPOConfig):
    """``trl.DPOConfig`` whose ``padding_free`` can say "decide for me", plus padfree's packing of pairs.

    Args:
        padding_free: True: padding-free batching; False: explicitly off (TRL's padded batches); None (default):
            padfree decides (on when safe, see the module docstring).
        packing: pack the train set's pairs across the dataset into micro-batches of ``packing_length`` tokens.
        packing_length: the tokens of one packed micro-batch; None: ``2 · max_length ·
            per_device_train_batch_size`` (the positions of a padded micro-batch of full-length pairs).
        auto_padding_free: False turns the automatic choice off (as ``PADFREE_DISABLE_AUTO_PADDING_FREE=1`` does).
        padfree_telemetry: add :class:`~padfree.PackingTelemetryCallback`'s ``padfree/*`` metrics to the training
            logs when a padfree mode is on, measured on the packed rows the model ran.
        padfree_balance: with ``packing=True`` under data parallelism, deal the packed micro-batches to the ranks in
            steps balanced in tokens and Σ len² (:class:`~padfree.DistributedPackedBatchSampler`) instead of
            sharding them by count; no effect in one process.
        padfree_fused_head: in a padfree mode, on the CPU, answer TRL's fused LM head with padfree's
            (:class:`~padfree.integrations.fused_head.FusedHeadOptions`).

    Every other argument is ``trl.DPOConfig``'s.
    """

    packing: bool = dataclasses.field(
        default=False, metadata={"help": "Pack pairs across the train set into micro-batches of packing_length."})
    packing_length: int | None = dataclasses.field(
        default=None, metadata={"help": "Tokens of one packed micro-batch (default 2 * max_length * batch size)."})
    padfree_balance: bool = dataclasses.field(
        default=True, metadata={"help": "Data-parallel packing: deal the packed micro-batches to the ranks in steps "
                                        "balanced in tokens and sum of len^2."})


# --------------------------------------------------------------------------------------------------
# Pairs packed across the dataset
# --------------------------------------------------------------------------------------------------


def _list_lengths(table: pa.Table, name: str) -> np.ndarray:
    return pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False).astype(np.int64)


def _pair_lengths(table: pa.Table, max_length: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's ``prompt + chosen`` and ``prompt + rejected`` tokens, each cut to ``max_length`` as TRL's
    collator cuts them, ``(pairs,)`` each."""
    prompt = _list_lengths(table, "prompt_ids")
    chosen, rejected = prompt + _list_lengths(table, "chosen_ids"), prompt + _list_lengths(table, "rejected_ids")
    if max_length is not None:
        chosen, rejected = np.minimum(chosen, max_length), np.minimum(rejected, max_length)
    return chosen, rejected


def pack_pairs(dataset: datasets.Dataset, capacity: int, max_length: int | None = None,
               strategy: str = DEFAULT_STRATEGY, seed: int | None = None) -> tuple[datasets.Dataset, Any]:
    """Group tokenized preference pairs into micro-batches of at most ``capacity`` tokens, each pair whole in one.

    A pair costs ``min(prompt + chosen, max_length) + min(prompt + rejected, max_length)`` tokens (TRL's collator
    truncates each sequence to ``max_length``). Every column becomes a list per micro-batch, the pairs in packing
    order; :class:`PairBinsCollator` flattens them back into TRL's padded pair batch.

    Args:
        dataset: TRL's tokenized pairs (``prompt_ids``, ``chosen_ids``, ``rejected_ids``, optionally
            ``ref_chosen_logps`` / ``ref_rejected_logps``).
        capacity: tokens of one micro-batch.

    Returns:
        ``(bins, plan)``: the dataset of micro-batches and the :class:`~padfree.PackResult`.

    Raises:
        OverlongSequenceError: a pair longer than ``capacity``, named with its row.

    >>> pairs = datasets.Dataset.from_dict({"prompt_ids": [[1, 2], [3], [4, 5, 6]], "chosen_ids": [[7], [8, 9], [1]],
    ...                                     "rejected_ids": [[2, 3], [4], [5]]})
    >>> bins, plan = pack_pairs(pairs, capacity=12)  # pairs of 7, 5 and 8 tokens
    >>> bins.to_dict()["prompt_ids"], plan.num_bins
    ([[[4, 5, 6]], [[1, 2], [3]]], 2)
    """
    missing = [c for c in _PAIR_COLUMNS if c not in dataset.column_names]
    if missing:
        raise InvalidArgumentError(f"packing pairs needs the tokenized columns {list(_PAIR_COLUMNS)}; the dataset has "
                                   f"{dataset.column_names} (missing {missing})")
    table = dataset.with_format("arrow")[:]  # a selected or shuffled view comes out in its own order
    capacity = as_capacity(capacity)
    chosen, rejected = _pair_lengths(table, max_length)
    refuse_long_pairs(chosen, rejected, capacity, setting="capacity", trainer="pack_pairs", name="dataset",
                      max_length=max_length)
    plan = pack_sequences(chosen + rejected, capacity, strategy=strategy, seed=seed)
    order = pa.array(np.asarray(plan.order, dtype=np.int64))
    offsets = pa.array(np.asarray(plan.bin_offsets, dtype=np.int32))
    columns = {name: pa.ListArray.from_arrays(offsets, table.column(name).combine_chunks().take(order))
               for name in table.column_names}
    return datasets.Dataset(datasets.table.InMemoryTable(pa.table(columns))), plan


def bin_sequence_lengths(bins: datasets.Dataset, max_length: int | None = None) -> list[np.ndarray]:
    """The sequences of each micro-batch of :func:`pack_pairs`, as their lengths: ``prompt + chosen`` and ``prompt +
    rejected`` of every pair (each at most ``max_length``), what a balanced sampler weighs a micro-batch by.

    >>> pairs = datasets.Dataset.from_dict({"prompt_ids": [[1, 2], [3]], "chosen_ids": [[4], [5, 6]],
    ...                                     "rejected_ids": [[7, 8, 9], [1]]})
    >>> [b.tolist() for b in bin_sequence_lengths(pack_pairs(pairs, capacity=20)[0])]
    [[3, 5, 3, 2]]
    """
    table = bins.with_format("arrow")[:]
    offsets = table.column("prompt_ids").combine_chunks().offsets.to_numpy()
    flat = {name: pc.list_value_length(pc.list_flatten(table.column(name))).to_numpy(zero_copy_only=False)
            for name in _PAIR_COLUMNS}
    lengths = np.stack([flat["prompt_ids"] + flat["chosen_ids"], flat["prompt_ids"] + flat["rejected_ids"]], axis=1)
    if max_length is not None:
        lengths = np.minimum(lengths, max_length)
    return np.split(lengths.reshape(-1).astype(np.int64), 2 * offsets[1:-1].astype(np.int64))


class PairBinsCollator:
    """Collate micro-batches of packed pairs (:func:`pack_pairs`): every pair of the given bins through TRL's own pair
    collator, as one padded pair batch (chosen first, then rejected), which padfree's forward runs as one row.

    >>> from trl.trainer.dpo_trainer import DataCollatorForPreference
    >>> collate = PairBinsCollator(DataCollatorForPreference(pad_token_id=0))
    >>> batch = collate([{"prompt_ids": [[1, 2], [3]], "chosen_ids": [[4], [5, 6]], "rejected_ids": [[7], [8]]}])
    >>> batch["input_ids"].tolist()
    [[1, 2, 4], [3, 5, 6], [1, 2, 7], [3, 8, 0]]
    """

    def __init__(self, pair_collator: Any) -> None:
        self.pair_collator = pair_collator

    def __call__(self, bins: Sequence[dict[str, Any]]) -> dict[str, Any]:
        pairs = [{name: values[i] for name, values in b.items()} for b in bins for i in range(len(b["prompt_ids"]))]
        return self.pair_collator(pairs)


# --------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------


def _decide(args: Any, model: Any, ref_model: Any, config: Any, processing_class: Any, data_collator: Any,
            train_dataset: Any) -> Decision:
    padding_free = as_tri_state(args.padding_free, "padding_free")
    packing = as_flag(getattr(args, "packing", False), "packing")
    explicit = isinstance(args, DPOConfig)  # a plain trl.DPOConfig cannot tell False from its default
    sample = first_sample(train_dataset) if train_dataset is not None else None
    if packing:
        if explicit and padding_free is False:
            raise InvalidArgumentError("packing=True with padding_free=False: packed pairs run as one unpadded row; "
                                       "drop padding_free=False, or unset packing")
        coupled = sorted(set(args.loss_type) & set(_BATCH_COUPLED))
        if coupled:
            raise InvalidArgumentError(
                f"packing=True with loss_type {coupled}: {coupled[0]!r} {_BATCH_COUPLED[coupled[0]]}, and packed "
                f"micro-batches hold a varying number of pairs, so it cannot equal the padded trainer's; use "
                f"padding_free=True (the padded micro-batches, run unpadded) or drop those loss types")
        if holds_images(sample):
            raise InvalidArgumentError("packing=True with images: pairs are packed across the train set from TRL's "
                                       "tokenized pairs, and image data is processed one batch at a time (TRL never "
                                       "tokenizes it ahead); use padding_free=True (each batch's pairs, images "
                                       "included, run as one packed row)")
        if isinstance(train_dataset, datasets.IterableDataset):
            raise InvalidArgumentError("packing=True packs the whole train set at once, which needs a "
                                       "datasets.Dataset; train_dataset is an IterableDataset — use padding_free=True")
        setting, mode = "packing=True", PACKING
    elif padding_free:
        setting, mode = "padding_free=True", PADDING_FREE
    elif explicit and padding_free is False:
        return Decision(STANDARD, "padding_free=False", auto=False)
    else:
        skip = skip_reason(args, model, config, processing_class, data_collator, sample, returns_logits=False,
                           vision=True)
        if skip is None and prompt_learning(model):
            skip = PROMPT_LEARNING_SKIP
        if skip is None and ref_model is not None and not isinstance(ref_model, str):
            skip = skip_reason(args, ref_model, getattr(ref_model, "config", None), processing_class, None, sample,
                               returns_logits=False, vision=True)
            skip = None if skip is None else Skip(f"the reference model: {skip.reason}", skip.cause)
        return auto_decision(skip, config)
    refuse_unsafe(setting, model, config, processing_class, data_collator, sample, vision=True)
    if ref_model is not None and not isinstance(ref_model, str):
        refuse_unsafe(setting, ref_model, getattr(ref_model, "config", None), processing_class, None, sample,
                      vision=True)
    refuse_prompt_learning(setting, model, f"unset {setting}")
    reason = setting if mode == PADDING_FREE else f"{setting}: pairs packed across the train set"
    return Decision(mode, reason, auto=False)


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _uneven_gathers(accelerator: Any, on: bool) -> Iterator[None]:
    """Inside the block, ``accelerator.gather`` of a per-pair tensor accepts ranks holding different numbers of pairs
    (packed micro-batches do): each rank's tensor is padded to the longest, gathered, and the padding dropped, so
    TRL's per-pair metrics gather every rank's pairs once. Scalars go through the plain gather."""
    if not on:
        yield
        return
    plain = accelerator.gather

    def gather(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.ndim == 0:
            return plain(tensor)
        sizes = plain(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        padded = accelerator.pad_across_processes(tensor, dim=0)
        width = int(padded.shape[0])
        keep = torch.cat([torch.arange(n, device=tensor.device) + r * width for r, n in enumerate(sizes)])
        return plain(padded).index_select(0, keep)

    accelerator.gather = gather
    try:
        yield
    finally:
        del accelerator.gather  # the instance attribute goes; the class's method is back


class DPOMixin(TrainerProtocol):
    """What :class:`DPOTrainer` adds to ``trl.DPOTrainer``: the decision, the unpadded forwards, packed pairs."""

    _padfree_step_pairs: torch.Tensor | None = None
    _padfree_sampler: Any = None
    _padfree_checked: tuple[int, ...] = ()
    _padfree_head_map: dict[Any, LogProbHead] | None = None
    _padfree_hidden = ("padding_free",)  # TRL warns and falls back for True; padfree runs the forwards instead

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None, *rest: Any,
                 **kwargs: Any) -> None:
        args = as_config(args, model, DPOConfig, trl.DPOConfig, "DPO")
        given = Construction(model, args, train_dataset, eval_dataset, processing_class, data_collator, ref_model)
        self._padfree_construct(given, functools.partial(super().__init__, model, ref_model, args, data_collator,
                                                         train_dataset, eval_dataset, processing_class, *rest,
                                                         **kwargs))

    # ---- the construction's hooks (padfree.integrations.base) ---------------------------------------------

    def _padfree_check(self, given: Construction, config: Any) -> None:
        # before TRL reads a row: each fault of the data is one error naming the column and the row
        self._padfree_checked = tuple(map(id, check_datasets(DPO_DATA, given.train_dataset, given.eval_dataset)))
        self._padfree_dropped: dict[str, int] = {}
        self._padfree_kept: np.ndarray | None = None  # train rows kept by TRL's rule (None: all)
        self._padfree_pairs: dict[str, list[int]] = {"train": [], "eval": []}

    def _padfree_decide(self, given: Construction, config: Any) -> Decision:
        return _decide(given.args, given.model, given.ref_model, config, given.processing_class,
                       given.data_collator, given.train_dataset)

    def _padfree_finish(self, given: Construction, decision: Decision) -> Any:
        return self._padfree_pack_train() if decision.mode == PACKING else None

    def _padfree_report(self, decision: Decision, plan: Any) -> dict[str, Any]:
        return {"loss": "pair" if decision.mode == PACKING else None, **plan_fields(plan, sequences_per_piece=2),
                "balance": self._padfree_balance_note(), "dropped": self._padfree_dropped}

    def _padfree_balance_note(self) -> str | None:
        sampler = self._padfree_balanced_sampler()
        return None if sampler is None else balance_note(sampler.schedule)

    def _padfree_pack_train(self) -> Any:
        args = self.args
        capacity = args.packing_length
        if capacity is None:
            if args.max_length is None:
                raise InvalidArgumentError("packing=True needs packing_length (tokens of one packed micro-batch) or "
                                           "max_length to derive it from; both are None")
            capacity = 2 * args.max_length * args.per_device_train_batch_size
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise InvalidArgumentError(f"packing_length must be an int >= 2 (tokens of one packed micro-batch), got "
                                       f"{describe(capacity)}")
        if not isinstance(self.train_dataset, datasets.Dataset):
            raise InvalidArgumentError(f"packing=True needs a datasets.Dataset train set, got "
                                       f"{describe(self.train_dataset)}")
        chosen, rejected = _pair_lengths(self.train_dataset.with_format("arrow")[:], args.max_length)
        refuse_long_pairs(chosen, rejected, capacity, setting="packing_length", trainer="DPOTrainer",
                          name="train_dataset", rows=self._padfree_kept, max_length=args.max_length)
        self.train_dataset, plan = pack_pairs(self.train_dataset, capacity, args.max_length, seed=args.seed)
        self._padfree_pair_collator = self.data_collator
        self.data_collator = PairBinsCollator(self.data_collator)
        # a micro-batch is one packed bin of <= packing_length tokens (per_device_train_batch_size sized the bins)
        self._train_batch_size = 1
        logger.info("padfree: packed %d pairs into %d micro-batches of packing_length=%d (efficiency %.2f%%)",
                    plan.num_sequences, plan.num_bins, capacity, 100 * plan.efficiency)
        return plan

    def _padfree_balanced_sampler(self) -> Any:
        """The all-ranks balanced sampler over the packed micro-batches, or None (one process, another mode, or
        ``padfree_balance=False``): each rank's share of a step has nearly equal tokens and Σ len²."""
        if (self._padfree_decision is None or self._padfree_decision.mode != PACKING
                or self.accelerator.num_processes < 2 or not as_flag(getattr(self.args, "padfree_balance", True),
                                                                      "padfree_balance")):
            return None
        if self._padfree_sampler is None:  # a packed micro-batch is one bin: weighed by its pairs' sequences
            self._padfree_sampler = balanced_sampler(
                self, bin_sequence_lengths(self.train_dataset, self.args.max_length), "rows",
                num_replicas=self.accelerator.num_processes, micro_batch_size=1)
            epochs = SamplerEpoch()
            epochs.sampler = self._padfree_sampler
            self.add_callback(epochs)
        return self._padfree_sampler

    def get_train_dataloader(self) -> Any:
        sampler = self._padfree_balanced_sampler()
        return super().get_train_dataloader() if sampler is None else batch_sampler_dataloader(self, sampler)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        if self._padfree_decision is None or self._padfree_decision.mode != PACKING:
            return super().get_eval_dataloader(eval_dataset)
        packed, self.data_collator = self.data_collator, self._padfree_pair_collator  # eval pairs are not packed
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = packed

    # ---- the data --------------------------------------------------------------------------------------

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        """TRL's preparation (prompt extraction, EOS, tokenization), the data checked first and the pairs TRL drops
        counted: with ``truncation_mode="keep_start"`` a pair whose prompt fills ``max_length`` would keep no
        completion token, and TRL drops it — here the same rule, counted and logged
        (:func:`~padfree.integrations.preference_data.drop_counted`)."""
        if id(dataset) not in self._padfree_checked:  # a dataset handed to evaluate() later
            check_dataset(dataset, DPO_DATA, dataset_label(dataset_name))
        limit = args.max_length if args.truncation_mode == "keep_start" else None
        if limit is None:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        unfiltered = copy.copy(args)
        unfiltered.max_length = None  # TRL's only use of it here is that filter, applied (and counted) below
        prepared = super()._prepare_dataset(dataset, processing_class, unfiltered, dataset_name)
        rule = DropRule(("prompt_ids",), lambda n: n["prompt_ids"] + 1, limit, "max_length", "prompt fills max_length",
                        f"prompt alone fills max_length={limit} tokens, so truncation_mode='keep_start' would leave "
                        f"no completion token to learn from (TRL's DPOTrainer drops such pairs)")
        prepared, kept = drop_counted(prepared, rule, trainer="DPOTrainer", split=dataset_name,
                                      dropped=self._padfree_dropped)
        if dataset_name == "train":
            self._padfree_kept = kept
        return prepared

    # ---- the forwards ----------------------------------------------------------------------------------

    def _padfree_heads(self) -> dict[Any, LogProbHead]:
        """padfree's answers to TRL's fused LM head on the packed rows (``padfree_fused_head``), by model: for the
        policy the fields TRL's DPO trainer asks its head for (the metrics' entropy, mean logits and top-1 hits, and
        ``log Σ p²`` for WPO's weights), for the reference model the log-probs alone."""
        if not fused_head_on(self.args):
            return {}
        if self._padfree_head_map is None:
            policy = ("log_probs", "entropy", "mean_logits", "is_top1")
            policy += ("log_sum_sq_probs",) if self.use_weighting else ()
            self._padfree_head_map = {self.model: LogProbHead(policy), self.ref_model: LogProbHead()}
        return self._padfree_head_map

    def compute_ref_log_probs(self, model: Any, inputs: dict[str, Any]) -> Any:
        if not self._padfree_on:
            return super().compute_ref_log_probs(model, inputs)
        with unpadded_forwards(model, self.model, heads=self._padfree_heads()):
            return super().compute_ref_log_probs(model, inputs)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if not self._padfree_on:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        packed = self._padfree_decision.mode == PACKING
        uneven = packed and self.accelerator.num_processes > 1
        with unpadded_forwards(model, self.ref_model, heads=self._padfree_heads()), \
                _uneven_gathers(self.accelerator, uneven):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        pairs = int(inputs["input_ids"].shape[0]) // 2
        mode = "train" if self.model.training else "eval"
        if mode == "train" and self._padfree_telemetry is not None:  # the row the model ran, not the padded batch
            self._padfree_telemetry.observe_unpadded(inputs["attention_mask"])
        if packed:  # TRL's per-pair metrics are means over every rank's pairs of the micro-batch: weigh them by it
            self._padfree_pairs[mode].append(pairs if not uneven else int(self.accelerator.gather(
                torch.tensor([pairs], device=inputs["input_ids"].device)).sum()))
        if packed and mode == "train" and self._padfree_step_pairs is not None:
            # TRL's loss is this micro-batch's pair mean and the Trainer divides it by the accumulation steps (and
            # DDP averages the ranks): rescale so that the step's gradient is that of the mean over its pairs
            scale = _PAIRS.mean_share(pairs, self._padfree_step_pairs, self.accelerator.num_processes,
                                      self.current_gradient_accumulation_steps)
            out = (out[0] * scale, out[1]) if return_outputs else out * scale
        return out

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._padfree_step_pairs = None
        if self._padfree_decision is not None and self._padfree_decision.mode == PACKING and batch_samples:
            count = torch.stack([_PAIRS.batch_count(b) for b in batch_samples]).sum().to(device)
            if self.accelerator.num_processes > 1:
                count = self.accelerator.gather(count.reshape(1)).sum()
            self._padfree_step_pairs = count
        return batch_samples, num_items

    # ---- metrics ---------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        weights = self._padfree_pairs.get(mode, [])
        if self._padfree_decision is not None and self._padfree_decision.mode == PACKING:
            metrics = self._metrics[mode]
            for key in _PAIR_METRICS:  # a micro-batch's mean counts as many times as it has pairs
                values = metrics.get(key)
                if values and len(values) == len(weights):
                    metrics[key] = [float(np.average(values, weights=weights))]
        weights.clear()
        super().log(logs, start_time)  # the telemetry's metrics join there (TelemetryLogMixin)


class DPOTrainer(DPOMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` with exact padding-free batching (automatic when safe) and pairs packed across the train set
    (``packing=True``): see the module docstring for the modes, the refusals and the opt-outs.

    Takes exactly ``trl.DPOTrainer``'s arguments. ``args`` may be a ``trl.DPOConfig`` or padfree's :class:`DPOConfig`
    (``padding_free=None`` lets padfree decide; adds ``packing``, ``packing_length`` and ``auto_padding_free``).

    Raises:
        InvalidArgumentError: ``padding_free=True`` / ``packing=True`` with a custom ``data_collator``;
            ``packing=True`` with images, a batch-coupled loss type, an ``IterableDataset`` or a bad
            ``packing_length``; a ``max_length`` that drops every pair of a dataset.
        InvalidSampleError: a dataset TRL cannot train (missing column, None, wrong type, empty completion, no rows).
        OverlongSequenceError: ``packing=True`` with a pair longer than ``packing_length``, named with its row.
        UnsupportedModelError: an explicit padfree mode on an unsupported model (policy or reference), with images
            padfree does not put in packed rows, or with a prompt-learning PEFT adapter.
    """

