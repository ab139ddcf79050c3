"""The construction every padfree TRL trainer runs: one sequence, the hooks a trainer fills in.

padfree's TRL trainers (:mod:`~padfree.integrations.sft`, :mod:`~padfree.integrations.dpo`,
:mod:`~padfree.integrations.reward`, :mod:`~padfree.integrations.grpo`) are a mixin before TRL's class. A mixin's
``__init__`` takes TRL's arguments, turns ``args`` into its config (:func:`as_config`) and hands TRL's constructor to
:meth:`TrainerProtocol._padfree_construct`, which runs the same sequence for all of them:

1. ``_padfree_check(given, config)`` — the trainer's own checks before TRL reads a row (datasets, options);
2. ``_padfree_decide(given, config)`` — the :class:`~padfree.integrations.decide.Decision`: mode, reason, cause;
3. ``_padfree_configure_given`` — :func:`padfree.configure_packing` on ``_padfree_modules`` of the models given as
   instances, so that a model padfree cannot make exact fails before anything is tokenized;
4. TRL's ``__init__``, with the flags named in ``_padfree_hidden`` off (padfree makes those batches, not TRL);
5. ``_padfree_settle`` — the decision once TRL has loaded a model given by name; ``configure_packing`` on the
   ``_padfree_modules`` TRL holds;
6. ``_padfree_finish`` — what the mode needs (collators, the packed train set): the packing plan or None;
7. the truth back in ``args`` (``padding_free``, and ``packing`` where hidden), the telemetry
   (:class:`~padfree.integrations.telemetry.TelemetryLogMixin`), the
   :class:`~padfree.integrations.status.PackingStatus` (``_padfree_report``) logged, and a warning when the
   automatic choice was skipped for the model's own limits (:attr:`Decision.warns`, read from its cause).

>>> class Toy(TrainerProtocol):
...     pass
>>> Toy()._padfree_on, Toy._padfree_fallback
(False, 'training with standard batching')
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.integrations.decide import (
    Decision,
    configure_for,
    default_output_dir,
    first_sample,
    model_config,
    warn_once,
)
from padfree.integrations.inrun import InRunProofMixin
from padfree.integrations.status import PACKING, PackingStatus, model_facts
from padfree.integrations.telemetry import TelemetryLogMixin
from padfree.packing.inputs import as_flag

try:
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError("padfree.integrations.base needs transformers; pip install 'padfree[hf]'") from exc

__all__ = ["Construction", "TrainerOptions", "TrainerProtocol", "as_config", "plan_fields"]

logger = logging.getLogger("padfree")


@dataclasses.dataclass
class TrainerOptions:
    """The options every padfree trainer config adds to TRL's: a base before TRL's config class, so that its
    ``output_dir`` stays the first argument (``class DPOConfig(TrainerOptions, trl.DPOConfig)``).

    >>> [f.name for f in dataclasses.fields(TrainerOptions)]
    ['padding_free', 'auto_padding_free', 'padfree_telemetry', 'padfree_verify']
    """

    padding_free: bool | None = dataclasses.field(
        default=None, metadata={"help": "True: padding-free batching; False: off; None: padfree decides."})
    auto_padding_free: bool = dataclasses.field(
        default=True, metadata={"help": "Let padfree turn padding-free batching on when it is safe."})
    padfree_telemetry: bool = dataclasses.field(
        default=True, metadata={"help": "Log packing telemetry (padfree/*) when a padfree mode is on."})
    padfree_verify: Any = dataclasses.field(
        default="first_step", metadata={"help": "Prove packed micro-batches against their sequences alone on the "
                                                "run's own model and precision: 'first_step', 'every:N' or False."})


@dataclasses.dataclass
class Construction:
    """What a trainer's constructor was given, as the protocol's hooks read it (``args`` already a config)."""

    model: Any
    args: Any
    train_dataset: Any = None
    eval_dataset: Any = None
    processing_class: Any = None
    data_collator: Any = None
    ref_model: Any = None
    rest: tuple = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def sample(self) -> Any:
        """The train set's first row (None without one): what the skip reasons read of the data."""
        return first_sample(self.train_dataset) if self.train_dataset is not None else None


def as_config(args: Any, model: Any, config_class: type, trl_class: type, suffix: str, *,
              from_training_arguments: bool = False) -> Any:
    """``args`` as a TRL config: padfree's ``config_class`` named after the model when None (so that padfree
    decides), as given when it is a ``trl_class`` (padfree's subclass or TRL's), converted from plain
    ``TrainingArguments`` where ``from_training_arguments`` (as ``trl.SFTTrainer`` converts them).

    >>> import trl
    >>> cfg = trl.SFTConfig("out", use_cpu=True, report_to="none")
    >>> as_config(cfg, "org/tiny-llama", trl.SFTConfig, trl.SFTConfig, "SFT") is cfg
    True
    >>> as_config("out", "org/tiny-llama", trl.SFTConfig, trl.SFTConfig, "SFT")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    padfree.errors.InvalidArgumentError: args must be an SFTConfig (padfree's or trl's), got ...
    """
    if args is None:
        return config_class(default_output_dir(model, suffix))
    if isinstance(args, trl_class):
        return args
    if from_training_arguments and isinstance(args, transformers.TrainingArguments):
        values = args.to_dict()
        values["hub_token"] = args.hub_token
        return config_class(**values)
    name = config_class.__name__
    article = "an" if name[0] in "AEFHILMNORSX" else "a"
    also = " or TrainingArguments" if from_training_arguments else ""
    raise InvalidArgumentError(f"args must be {article} {name} (padfree's or trl's){also}, got {describe(args)}")


def plan_fields(plan: Any, sequences_per_piece: int = 1) -> dict[str, Any]:
    """The :class:`PackingStatus` fields of a packing plan (a :class:`~padfree.PackResult`, or None): efficiency,
    rows, and the sequences in them (``sequences_per_piece`` per packed piece: 2 for a preference pair)."""
    if plan is None:
        return {}
    return {"efficiency": float(plan.efficiency), "rows": int(plan.num_bins),
            "sequences": sequences_per_piece * int(plan.num_pieces)}


class TrainerProtocol(InRunProofMixin, TelemetryLogMixin):
    """The construction sequence of padfree's TRL trainers (module docstring); a trainer fills in the hooks."""

    _padfree_decision: Decision | None = None
    _padfree_status: PackingStatus | None = None
    #: the ``args`` flags TRL must see off during its ``__init__`` (padfree builds those batches itself)
    _padfree_hidden: tuple[str, ...] = ()
    #: what the warning of a skip for the model's limits says the trainer does instead
    _padfree_fallback = "training with standard batching"
    #: the sequence-parallel group size the models are configured with (None: none)
    _padfree_sp_size: int | None = None

    @property
    def _padfree_on(self) -> bool:
        return self._padfree_decision is not None and self._padfree_decision.on

    # ---- the sequence --------------------------------------------------------------------------------------

    def _padfree_construct(self, given: Construction, init: Callable[[], None]) -> None:
        """Run the construction sequence; ``init`` is TRL's ``__init__`` bound to the given arguments."""
        args = given.args
        config = model_config(given.model, args)
        self._padfree_check(given, config)
        decision = self._padfree_decide(given, config)
        self._padfree_decision = decision
        self._padfree_configure_given(given, decision)
        for flag in self._padfree_hidden:
            setattr(args, flag, False)
        try:
            init()
        finally:
            self._padfree_tell(args, decision)
        decision = self._padfree_settle(given, decision)
        self._padfree_decision = decision
        if decision.on:  # a model given by name was loaded by TRL; an instance is configured already (kept)
            for module in self._padfree_modules(self.model, getattr(self, "ref_model", None)):
                configure_for(module, decision, self._padfree_sp_size)
        plan = self._padfree_finish(given, decision)
        self._padfree_tell(args, decision)
        if decision.on and as_flag(getattr(args, "padfree_telemetry", True), "padfree_telemetry"):
            self._padfree_attach_telemetry()
        if decision.on:
            self._padfree_attach_proof(getattr(args, "padfree_verify", "first_step"))
        fields = {**model_facts(self.model), **self._padfree_report(decision, plan)}
        self._padfree_status = PackingStatus(mode=decision.mode, reason=decision.reason, auto=decision.auto,
                                             packing=decision.mode == PACKING, padding_free=decision.on, **fields)
        logger.info("%s", self._padfree_status)
        if decision.warns:
            warn_once(f"padfree: {decision.reason}; {self._padfree_fallback}")

    def _padfree_configure_given(self, given: Construction, decision: Decision) -> None:
        """``configure_packing`` on the models given as instances, before TRL tokenizes anything."""
        if not decision.on:
            return
        for module in self._padfree_modules(given.model, given.ref_model):
            if not isinstance(module, str):
                configure_for(module, decision, self._padfree_sp_size)

    def _padfree_tell(self, args: Any, decision: Decision) -> None:
        """The decision written back into ``args``: after construction they tell the truth."""
        if "packing" in self._padfree_hidden:
            args.packing = decision.mode == PACKING
        args.padding_free = decision.on

    # ---- the hooks ---------------------------------------------------------------------------------------

    def _padfree_check(self, given: Construction, config: Any) -> None:
        """The trainer's checks before TRL reads anything (its datasets, its options)."""

    def _padfree_decide(self, given: Construction, config: Any) -> Decision:
        """The mode this trainer runs, why, and its cause."""
        raise NotImplementedError

    def _padfree_modules(self, model: Any, ref_model: Any) -> list[Any]:
        """The modules ``configure_packing`` makes exact (the policy and the reference model by default); ``model``
        may still be a name before TRL loads it."""
        return [m for m in (model, ref_model) if m is not None]

    def _padfree_settle(self, given: Construction, decision: Decision) -> Decision:
        """The decision once TRL built the trainer (a model given by name is loaded now)."""
        return decision

    def _padfree_finish(self, given: Construction, decision: Decision) -> Any:
        """What the mode needs after TRL's ``__init__`` (collators, the packed train set): the plan, or None."""
        return None

    def _padfree_report(self, decision: Decision, plan: Any) -> dict[str, Any]:
        """The trainer's own :class:`PackingStatus` fields (loss rule, plan, balance, dropped rows, ...)."""
        return {}
