"""padfree for TRL's ``RewardTrainer``: every micro-batch of preference pairs scored as one packed row.

``padfree.integrations.reward.RewardTrainer`` is a drop-in subclass of ``trl.RewardTrainer`` (same arguments). TRL
still tokenizes the pairs, collates them (chosen sequences, then rejected), and keeps its Bradley-Terry loss (with
``margin`` and ``center_rewards_coefficient``), its metrics and its logging; padfree changes how the forward runs:

``"padding-free batching"`` (automatic when safe, or ``padding_free=True``)
    The ``2B`` sequences of a micro-batch run through the model's backbone as one row — the real tokens back to
    back, ``position_ids`` restarting at every sequence, no padding, no ``attention_mask`` — and the hidden states
    come back in the padded ``(2B, L, hidden)`` layout, where the model's own sequence-classification head scores
    them and pools each sequence's token exactly as it does for the padded batch. TRL's loss and metrics then run,
    unchanged, on the same ``(2B, 1)`` rewards the padded forward gives.
``"standard batching"``
    TRL's padded batches and forward, untouched.

The backbone goes through :func:`padfree.configure_packing` (attention and recurrent state that stop at every
boundary), which fails closed. The head must be one padfree can feed a packed backbone: the generic
``*ForSequenceClassification`` of transformers (``LlamaForSequenceClassification``,
``Qwen3_5TextForSequenceClassification``, ...: a backbone, then a per-token ``score`` pooled by the model itself);
any other class is refused by name (:func:`score_head_reason`). The automatic choice is skipped, with the reason
logged, on the same grounds as :class:`padfree.SFTTrainer`'s (``PADFREE_DISABLE_AUTO_PADDING_FREE=1`` or
``auto_padding_free=False``, a custom collator, a processor or vision-language model, a backbone padfree cannot make
exact), for such a head, and for prompt-learning PEFT adapters. ``padding_free=True`` refuses, naming why, what the
automatic choice would skip; ``padding_free=False`` is TRL's padded path. ``padfree.packing_status(trainer)`` says
which mode runs. Each micro-batch's loss is TRL's mean over its pairs, so gradient accumulation and data parallelism
are what they are for the padded trainer.

The datasets are read through :mod:`padfree.integrations.preference_data` before TRL sees them, whatever the mode:
a missing column, a None, a value of another type, an empty completion or no rows is one
:class:`~padfree.errors.InvalidSampleError` naming the column and the row (:class:`~padfree.errors.InvalidTokensError`
for a tokenized pair's id outside the vocabulary). The pairs TRL drops (a chosen or rejected sequence longer than
``max_length``) are counted in ``packing_status(trainer).dropped`` and logged once at WARNING; a ``max_length`` that
would drop them all is refused before training.

    from padfree.integrations.reward import RewardConfig, RewardTrainer
    trainer = RewardTrainer(model=seq_cls_model, args=RewardConfig("out"), train_dataset=pairs,
                            processing_class=tokenizer)
    trainer.train()

:func:`unpadded_scores` is the same forward outside a trainer:

>>> import torch, transformers
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
...                                   num_attention_heads=2, num_labels=1, pad_token_id=0)
>>> model = transformers.LlamaForSequenceClassification(config).eval()
>>> ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]])
>>> padded = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
>>> with unpadded_scores(model):  # configures the backbone for packing, then runs one packed row
...     packed = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
>>> packed.shape, bool(torch.allclose(packed, padded, atol=1e-6))
(torch.Size([3, 1]), True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from padfree.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedModelError, describe
from padfree.integrations.base import Construction, TrainerOptions, TrainerProtocol, as_config
from padfree.integrations.decide import (
    PROMPT_LEARNING_SKIP,
    Cause,
    Decision,
    Skip,
    as_tri_state,
    auto_decision,
    configure_model,
    first_sample,
    prompt_learning,
    refuse_unsafe,
    skip_reason,
)
from padfree.integrations.preference_data import (
    REWARD_DATA,
    DropRule,
    check_dataset,
    check_datasets,
    dataset_label,
    drop_counted,
)
from padfree.integrations.status import PADDING_FREE, STANDARD, model_facts
from padfree.integrations.unpadded import Unpadded
from padfree.model.wrappers import unwrap_model

try:
    import torch
    import transformers
    import trl
    from transformers.modeling_layers import GenericForSequenceClassification
except ImportError as exc:  # pragma: no cover - trl is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.reward needs trl and transformers; pip install 'padfree[trl]'"
    ) from exc

__all__ = ["RewardConfig", "RewardTrainer"]

logger = logging.getLogger("padfree")


@dataclasses.dataclass
class RewardConfig(TrainerOptions, trl.RewardConfig):
    """``trl.RewardConfig`` plus padfree's choice of batching.

    Args:
        padding_free: True: padding-free batching (refused, naming why, where it cannot be exact); False: TRL's
            padded batches; None (default): padfree decides (on when safe, see the module docstring).
        auto_padding_free: False turns the automatic choice off (as ``PADFREE_DISABLE_AUTO_PADDING_FREE=1`` does).
        padfree_telemetry: add :class:`~padfree.PackingTelemetryCallback`'s ``padfree/*`` metrics to the training
            logs when padding-free is on, measured on the packed rows the model ran.

    Every other argument is ``trl.RewardConfig``'s.

    >>> cfg = RewardConfig("out", report_to="none", use_cpu=True)
    >>> cfg.padding_free, cfg.auto_padding_free
    (None, True)
    """


# --------------------------------------------------------------------------------------------------
# The head and the packed backbone
# --------------------------------------------------------------------------------------------------


def score_head_reason(model: Any) -> str | None:
    """Why padfree cannot score ``model`` (wrapped or not) from a packed backbone; None when it can.

    padfree feeds the backbone of transformers' generic sequence-classification head
    (``GenericForSequenceClassification``: the backbone under ``base_model_prefix``, a per-token ``score``, the
    pooled token chosen by the model from the padded ``input_ids``); a class with its own ``forward`` may pool,
    mix or read the mask in ways a packed row does not reproduce, so it is named and refused.

    >>> import transformers
    >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                   num_attention_heads=2, num_labels=1)
    >>> score_head_reason(transformers.LlamaForSequenceClassification(config)) is None
    True
    >>> print(score_head_reason(transformers.LlamaForCausalLM(config)))  # doctest: +ELLIPSIS
    LlamaForCausalLM is not a sequence-classification model...
    """
    inner = unwrap_model(model)
    name = type(inner).__name__
    if not isinstance(inner, GenericForSequenceClassification):
        return (f"{name} is not a sequence-classification model of transformers' generic kind "
                f"(GenericForSequenceClassification: a backbone, then a per-token score pooled at each sequence's "
                f"last token); padfree's reward trainer scores packed rows only through that head")
    owner = next(c for c in type(inner).__mro__ if "forward" in vars(c))
    if owner is not GenericForSequenceClassification:
        return (f"{name}.forward (defined by {owner.__qualname__}) replaces transformers' generic "
                f"sequence-classification forward, so padfree cannot tell how it pools a packed row")
    backbone = getattr(inner, inner.base_model_prefix, None)
    if not isinstance(backbone, transformers.PreTrainedModel):
        return (f"{name}.{inner.base_model_prefix} is {describe(backbone)}, not a transformers backbone that "
                f"configure_packing can make exact")
    return None


def _backbone(model: Any) -> Any:
    inner = unwrap_model(model)
    return getattr(inner, inner.base_model_prefix)


class _PackedBackbone:
    """Hooks on the backbone of a sequence-classification model that, while :attr:`active`, turn its padded call
    into one packed row and give the hidden states back padded; the head above it runs untouched."""

    def __init__(self, head: Any, backbone: Any) -> None:
        self.active = 0
        self.ignore: frozenset[str] = frozenset()
        self.layout: Unpadded | None = None
        self.config = head.config
        # first among the backbone's pre-hooks: configure_packing's hook must see the packed row's position_ids
        self.handles = [backbone.register_forward_pre_hook(self.before, with_kwargs=True, prepend=True),
                        backbone.register_forward_hook(self.after, with_kwargs=True, prepend=True)]

    def before(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        self.layout = None
        ids = args[0] if args else kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        if (not self.active or len(args) > 1 or not isinstance(ids, torch.Tensor) or ids.ndim != 2
                or not isinstance(mask, torch.Tensor) or mask.ndim != 2 or kwargs.get("position_ids") is not None
                or kwargs.get("inputs_embeds") is not None or kwargs.get("output_attentions")
                or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None):
            return None  # not the padded scoring call: the backbone's own forward
        layout = Unpadded.from_attention_mask(mask)
        self._check_pooled(ids, layout)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "input_ids") and k not in self.ignore}
        kwargs["input_ids"] = layout.pack(ids)
        kwargs["position_ids"] = layout.position_ids.to(ids.device)
        self.layout = layout
        return (), kwargs

    def after(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        layout, self.layout = self.layout, None
        if layout is None:
            return None
        if isinstance(output, tuple):
            return (layout.unpack(output[0]), *output[1:])
        output["last_hidden_state"] = layout.unpack(output["last_hidden_state"])
        hidden = output.get("hidden_states") if hasattr(output, "get") else None
        if hidden is not None:
            output["hidden_states"] = tuple(layout.unpack(h) for h in hidden)
        return output

    def _check_pooled(self, ids: torch.Tensor, layout: Unpadded) -> None:
        """The generic head pools, per row, the rightmost token that is not ``pad_token_id``. Padding has no packed
        hidden state, so a row whose pooled token would be padding (the collator padded with another id, or a row of
        nothing but pad ids) is refused rather than scored differently."""
        pad = self.config.get_text_config().pad_token_id
        if pad is None:
            pooled = torch.full((ids.shape[0],), ids.shape[1] - 1, device=ids.device)
        else:
            positions = torch.arange(ids.shape[1], device=ids.device)
            pooled = (positions * (ids != pad)).argmax(-1)
        mask = layout.mask.to(ids.device)
        real = mask[torch.arange(ids.shape[0], device=ids.device), pooled]
        if not bool(real.all()):
            row = int(torch.nonzero(~real)[0, 0])
            raise InvalidArgumentError(
                f"row {row} of the batch would be scored at padding position {int(pooled[row])} (the head pools the "
                f"last token that is not pad_token_id={pad}; attention_mask {mask[row].int().tolist()}): a packed "
                f"row has no hidden state there — pad with pad_token_id, or use padding_free=False")


@contextlib.contextmanager
def unpadded_scores(model: Any, ignore: tuple[str, ...] = ()) -> Iterator[None]:
    """Inside the block, ``model(input_ids=..., attention_mask=...)`` of a sequence-classification ``model``
    (wrapped or not) runs its backbone on one packed row and returns the logits ``(N, num_labels)`` the padded
    forward returns.

    The backbone is configured by :func:`padfree.configure_packing` first (kept if it already is). Calls with
    ``position_ids``, ``inputs_embeds``, a cache or ``output_attentions`` run the padded forward.

    Args:
        model: a generic ``*ForSequenceClassification`` (:func:`score_head_reason`), wrapped or not.
        ignore: keyword arguments the model is handed but does not read, kept from the backbone (TRL's reward
            trainer hands the model its batch, the pairs' ``margin`` included; the padded attention lets it pass
            unread, padfree's packed attention refuses what it does not apply).

    Raises:
        UnsupportedModelError: a head padfree cannot feed (:func:`score_head_reason`) or a backbone
            ``configure_packing`` cannot make exact.
        InvalidArgumentError: (in the call) a row the head would score at a padding position.
    """
    why = score_head_reason(model)
    if why is not None:
        raise UnsupportedModelError(f"padfree cannot score a packed row: {why}")
    inner = unwrap_model(model)
    backbone = _backbone(inner)
    configure_model(backbone)
    hooks = getattr(backbone, "_padfree_scores", None)
    if hooks is None:
        hooks = _PackedBackbone(inner, backbone)
        backbone._padfree_scores = hooks
    hooks.active, previous, hooks.ignore = hooks.active + 1, hooks.ignore, frozenset(ignore)
    try:
        yield
    finally:
        hooks.active, hooks.ignore = hooks.active - 1, previous


# a tolerance is this many times what rounding alone moves a score: the factor of padfree's proofs (run time does not
# import the proof package: tests/test_house.py)
_ROUNDING_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class ScoreReport:
    """A reward model's packed scores against each sequence scored alone (:func:`prove_scores`).

    Attributes:
        num_sequences: the sequences compared.
        max_logit_diff: max |packed score - score alone| over them (named as :class:`~padfree.VerifyReport`'s, so
            the in-run proof logs both alike).
        atol: the tolerance: three times what rounding moves a score (the same sequences as an ordinary
            right-padded batch against alone), at least 1e-5 and one unit in the last place of the scores.
        rounding: that rounding distance.
        control: max |leaked score - score alone|: each sequence scored after the ones before it in one row whose
            positions never restart (a packing that leaks); it must land beyond ``atol``.
    """

    num_sequences: int
    max_logit_diff: float
    atol: float
    rounding: float
    control: float | None

    @property
    def ok(self) -> bool:
        return self.max_logit_diff <= self.atol

    @property
    def conclusive(self) -> bool | None:
        return None if self.control is None else self.control > self.atol

    def __str__(self) -> str:
        control = "none" if self.control is None else f"{self.control:.2e}"
        return (f"scores of {self.num_sequences} sequences: max |Δscore| {self.max_logit_diff:.2e}, atol "
                f"{self.atol:.2e} (rounding {self.rounding:.2e}), leaking control {control}: "
                f"{'OK' if self.ok else 'MISMATCH'}")


def prove_scores(model: Any, sequences: list[list[int]], compute_dtype: Any = None) -> ScoreReport | None:
    """Score ``sequences`` as one packed row (:func:`unpadded_scores`) and each alone, on ``model`` as it is (device,
    dtype, attention backend; autocast to ``compute_dtype`` when given), and compare: the in-run proof of
    :class:`RewardTrainer`, whose model scores sequences rather than predicting tokens.

    Args:
        model: a generic ``*ForSequenceClassification`` with a ``pad_token_id`` (wrapped or not).
        sequences: at least two token-id lists (``batch_sequences`` picks them from a micro-batch).

    Returns None for a model without ``pad_token_id``: its head pools each row's last position, so it can score a
    padded batch only of equal lengths, and neither the packed route nor the rounding reference applies.

    >>> import transformers
    >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                                   num_attention_heads=2, num_labels=1, pad_token_id=0)
    >>> report = prove_scores(transformers.LlamaForSequenceClassification(config), [[5, 6, 7], [8, 9], [10, 11, 12]])
    >>> report.ok, report.conclusive, report.max_logit_diff < 1e-5
    (True, True, True)
    """
    inner = unwrap_model(model)
    device = next(inner.parameters()).device
    pad = inner.config.get_text_config().pad_token_id
    if pad is None:
        return None
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad, device=device)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(sequences):  # a handful of sequences, a few hundred tokens: the proof's own batch
        ids[i, :len(seq)] = torch.tensor(seq, device=device)
        mask[i, :len(seq)] = 1
    autocast = torch.autocast(device.type, dtype=compute_dtype) if compute_dtype is not None else \
        contextlib.nullcontext()

    def score(**kwargs: Any) -> torch.Tensor:
        return inner(**kwargs).logits

    with torch.no_grad(), autocast:
        with unpadded_scores(inner):
            packed = score(input_ids=ids, attention_mask=mask)
        padded = score(input_ids=ids, attention_mask=mask)
        alone = torch.cat([score(input_ids=torch.tensor([seq], device=device)) for seq in sequences])
        joined = [t for seq in sequences for t in seq]
        ends = np.cumsum([len(seq) for seq in sequences]).tolist()
        leaked = [score(input_ids=torch.tensor([joined[:end]], device=device)) for end in ends[1:]]
    resolution = torch.finfo(packed.dtype).eps * float(alone.abs().max())
    packed, padded, alone = packed.float(), padded.float(), alone.float()
    rounding = float((padded - alone).abs().max())
    control = max(float((leak.float() - alone[i + 1]).abs().max()) for i, leak in enumerate(leaked)) \
        if leaked else None
    return ScoreReport(len(sequences), float((packed - alone).abs().max()),
                       max(1e-5, _ROUNDING_FACTOR * rounding, resolution), rounding, control)


# --------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------


def _head_or_adapter(model: Any) -> Skip | None:
    """Why the model's own make-up keeps padfree from scoring it packed (a head it cannot feed, a prompt-learning
    adapter), or None."""
    if isinstance(model, str):  # judged once TRL has loaded it
        return None
    if prompt_learning(model):
        return PROMPT_LEARNING_SKIP
    why = score_head_reason(model)
    return None if why is None else Skip(why, Cause.MODEL)


def _decide(args: Any, model: Any, config: Any, processing_class: Any, data_collator: Any, train_dataset: Any
            ) -> Decision:
    # a plain trl.RewardConfig has none: padfree decides
    padding_free = as_tri_state(getattr(args, "padding_free", None), "padding_free")
    if padding_free is False:
        return Decision(STANDARD, "padding_free=False", auto=False)
    sample = first_sample(train_dataset) if train_dataset is not None else None
    head = _head_or_adapter(model)
    # the support questions go to the backbone: configure_packing refuses classification heads as such
    target = model if isinstance(model, str) or head is not None else _backbone(model)
    if padding_free:
        if head is not None:
            raise UnsupportedModelError(f"padding_free=True: {head.reason}; unset padding_free to train with "
                                        f"standard batching")
        refuse_unsafe("padding_free=True", target, config, processing_class, data_collator, sample)
        return Decision(PADDING_FREE, "padding_free=True", auto=False)
    skip = skip_reason(args, target, config, processing_class, data_collator, sample, returns_logits=False) or head
    return auto_decision(skip, config)


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------


class RewardMixin(TrainerProtocol):
    """What :class:`RewardTrainer` adds to ``trl.RewardTrainer``: the decision and the packed scoring forward."""

    _padfree_checked: tuple[int, ...] = ()
    _padfree_vocab: int | None = None
    _padfree_fallback = "training the reward model with standard batching"

    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *rest: Any, **kwargs: Any) -> None:
        args = as_config(args, model, RewardConfig, trl.RewardConfig, "Reward")
        given = Construction(model, args, train_dataset, eval_dataset, processing_class, data_collator)
        self._padfree_construct(given, functools.partial(super().__init__, model, args, data_collator, train_dataset,
                                                         eval_dataset, processing_class, *rest, **kwargs))

    # ---- the construction's hooks (padfree.integrations.base) ---------------------------------------------

    def _padfree_check(self, given: Construction, config: Any) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        # tokenized pairs' ids must fit the embedding (which a cloned chat template may still grow)
        self._padfree_vocab = (None if getattr(given.args, "chat_template_path", None)
                               else getattr(text, "vocab_size", None))
        # before TRL reads a row: each fault of the data is one error naming the column and the row
        self._padfree_checked = tuple(map(id, check_datasets(REWARD_DATA, given.train_dataset, given.eval_dataset,
                                                             vocab_size=self._padfree_vocab)))
        self._padfree_dropped: dict[str, int] = {}

    def _padfree_decide(self, given: Construction, config: Any) -> Decision:
        return _decide(given.args, given.model, config, given.processing_class, given.data_collator,
                       given.train_dataset)

    def _padfree_modules(self, model: Any, ref_model: Any) -> list[Any]:
        # configure_packing refuses classification heads as such: the backbone is what runs packed
        return [model if isinstance(model, str) else _backbone(model)]

    def _padfree_settle(self, given: Construction, decision: Decision) -> Decision:
        if not decision.on:  # a model given by name is judged now that TRL has loaded it
            return decision
        head = _head_or_adapter(self.model)
        if head is None:
            return decision
        if not decision.auto:
            raise UnsupportedModelError(f"padding_free=True: {head.reason}; unset padding_free to train with "
                                        f"standard batching")
        return auto_decision(head, self.model.config)

    def _padfree_report(self, decision: Decision, plan: Any) -> dict[str, Any]:
        facts = model_facts(_backbone(self.model)) if decision.on else {}
        return {**facts, "dropped": self._padfree_dropped}

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        """TRL's preparation (EOS, tokenization), the data checked first and the pairs TRL drops counted: a pair
        whose chosen or rejected sequence is longer than ``max_length`` — here the same rule, counted and logged
        (:func:`~padfree.integrations.preference_data.drop_counted`)."""
        if id(dataset) not in self._padfree_checked:  # a dataset handed to evaluate() later
            check_dataset(dataset, REWARD_DATA, dataset_label(dataset_name), vocab_size=self._padfree_vocab)
        limit = args.max_length
        if limit is None:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        unfiltered = copy.copy(args)
        unfiltered.max_length = None  # TRL's only use of it here is that filter, applied (and counted) below
        prepared = super()._prepare_dataset(dataset, processing_class, unfiltered, dataset_name)
        rule = DropRule(("chosen_ids", "rejected_ids"), lambda n: np.maximum(n["chosen_ids"], n["rejected_ids"]),
                        limit, "max_length", "longer than max_length",
                        f"chosen or rejected sequence is longer than max_length={limit} tokens (TRL's RewardTrainer "
                        f"drops such pairs)")
        return drop_counted(prepared, rule, trainer="RewardTrainer", split=dataset_name,
                            dropped=self._padfree_dropped)[0]

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if not self._padfree_on:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if self.model.training:  # the training forward: its pairs' sequences proven first, then measured
            self._padfree_prove(model, inputs, check=prove_scores)
            if self._padfree_telemetry is not None:
                self._padfree_telemetry.observe_unpadded(inputs["attention_mask"])
        with unpadded_scores(self.model, ignore=("margin",)):  # TRL's loss and metrics, on one packed row's rewards
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)



class RewardTrainer(RewardMixin, trl.RewardTrainer):
    """``trl.RewardTrainer`` whose micro-batches run padding-free (automatic when safe): see the module docstring for
    the modes, the refusals and the opt-outs.

    Takes exactly ``trl.RewardTrainer``'s arguments. ``args`` may be a ``trl.RewardConfig`` (padfree decides) or
    padfree's :class:`RewardConfig` (``padding_free`` True / False / None, ``auto_padding_free``).

    Raises:
        InvalidArgumentError: ``padding_free=True`` with a custom ``data_collator`` or a ``ProcessorMixin``; a
            ``padding_free`` that is not a bool or None; ``args`` of another kind; a ``max_length`` that drops
            every pair of a dataset.
        InvalidSampleError: a dataset TRL cannot train (missing column, None, wrong type, empty completion, no rows).
        InvalidTokensError: a tokenized pair's id that is negative or not below the model's vocabulary size.
        UnsupportedModelError: ``padding_free=True`` on a vision-language model, a head padfree cannot feed
            (:func:`score_head_reason`), a prompt-learning adapter, or a backbone ``configure_packing`` refuses.
    """
