"""Which batching mode a trainer uses, and why: :class:`PackingStatus` and :func:`packing_status`.

padfree's trainers decide at construction between three modes — ``"sample packing"`` (the dataset packed globally
into rows), ``"padding-free batching"`` (every loader batch flattened into one row) and ``"standard batching"``
(padded batches) — record the decision with its reason and the model's packed implementation, and log it once.
:func:`packing_status` reads it back, or reconstructs it from the arguments and collator of any other trainer.

>>> status = PackingStatus(mode=PADDING_FREE, reason="padding_free=True", auto=False, packing=False,
...                        padding_free=True, attention="padfree_sdpa", loss="token")
>>> status.enabled
True
>>> print(status)
padfree: padding-free batching (padding_free=True); attention padfree_sdpa; loss = token mean over the optimizer step
"""

from __future__ import annotations

import dataclasses
from typing import Any

from padfree.data.batch import PackedCollator, PaddingFreeCollator
from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.model.state import packing_state
from padfree.model.wrappers import unwrap_model

try:
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.status needs transformers; pip install 'padfree[torch,hf]'"
    ) from exc

__all__ = ["PACKING", "PADDING_FREE", "STANDARD", "PackingStatus", "model_facts", "packing_status"]

PACKING, PADDING_FREE, STANDARD = "sample packing", "padding-free batching", "standard batching"
MODES = (PACKING, PADDING_FREE, STANDARD)


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
        loss: ``"token"`` or ``"sequence"`` (the loss rule), ``"pair"`` (packed DPO: the mean over the step's pairs),
            None when padfree's loss rule is off.
        efficiency: real tokens / row slots of the packed training set (sample packing only).
        rows, sequences: packed rows and the sequences in them (sample packing only).
        sequence_parallel: the group every row is split across (None: no sequence parallelism).
        balance: how the packed rows are dealt to data-parallel ranks (``world_size > 1`` with a train dataset of
            packed rows only, else None): ``"balanced across W ranks: ..."`` with the idle time left by the
            imbalance of tokens and of attention cost (Σ len²), or why the Trainer's own sampler is used.
        dropped: rows the trainer dropped from its datasets by its own rule, counted: ``"split: reason"`` -> rows
            (``{"train: longer than max_length": 7}``); empty when none was (a streamed dataset's count grows as
            it is read).
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
    sequence_parallel: str | None = None
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)

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
        if self.sequence_parallel:
            text += f"; sequence parallel over {self.sequence_parallel}"
        if self.loss is not None:
            text += f"; loss = {self.loss} mean over the optimizer step"
        if self.balance is not None:
            text += f"; {self.balance}"
        if self.dropped:
            text += f"; dropped {', '.join(f'{n} rows ({why})' for why, n in self.dropped.items())}"
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
                         padding_free=padding_free or packing, **model_facts(trainer.model))


def model_facts(model: Any) -> dict[str, Any]:
    """The :class:`PackingStatus` fields that describe ``model`` (wrapped or not): ``model_type``, ``attention``
    and, when :func:`padfree.configure_packing` configured it, ``mixers``."""
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    state = packing_state(base) if base is not None else None
    facts: dict[str, Any] = {"model_type": getattr(config, "model_type", None)}
    if state is not None:
        facts.update(attention=state.report.backend, mixers=dict(state.report.mixers),
                     sequence_parallel=state.report.sequence_parallel or None)
    elif config is not None:
        facts["attention"] = getattr(config, "_attn_implementation", None)
    return facts
