"""``padfree.enable``: the padfree version of any ``transformers.Trainer`` class, or of TRL's SFT, DPO, reward or
GRPO trainer class.

Every trainer module is below this one: :mod:`padfree.integrations.trainer` for ``Trainer`` subclasses and, only
when the class is TRL's, the module of that TRL trainer (:mod:`~padfree.integrations.sft`,
:mod:`~padfree.integrations.dpo`, :mod:`~padfree.integrations.reward`, :mod:`~padfree.integrations.grpo`) — so TRL
is imported only for a class that already needs it, and no trainer module has to know another.
"""

from __future__ import annotations

import importlib
import sys

from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.integrations.causal_lm import PadfreeTrainerMixin
from padfree.integrations.trainer import Trainer, TrainerMixin

try:
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError("padfree.enable needs transformers; pip install 'padfree[torch,hf]'") from exc

__all__ = ["enable"]

# the registry: TRL's trainer ``<Name>Trainer`` -> the padfree module that holds ``<Name>Mixin`` (what padfree adds,
# on padfree.integrations.base's protocol) and ``<Name>Trainer`` (the mixin on TRL's class); most derived TRL first
_TRL_TRAINERS = {
    "SFTTrainer": "padfree.integrations.sft",
    "DPOTrainer": "padfree.integrations.dpo",
    "RewardTrainer": "padfree.integrations.reward",
    "GRPOTrainer": "padfree.integrations.grpo",
}


def enable(trainer_class: type) -> type:
    """The padfree version of a trainer class: ``enable(trl.SFTTrainer)`` is :class:`padfree.SFTTrainer` (and so for
    ``trl.DPOTrainer``, ``trl.RewardTrainer``, ``trl.GRPOTrainer``); a
    ``transformers.Trainer`` subclass gets the loss rule, telemetry and ``configure_packing`` of
    :class:`padfree.Trainer`; your own subclass of either keeps its overrides (padfree's come first in the method
    order). A class that is padfree's already comes back as it is.

    >>> import transformers
    >>> cls = enable(transformers.Trainer)
    >>> cls.__name__, issubclass(cls, transformers.Trainer)
    ('Trainer', True)
    >>> class Mine(transformers.Trainer):
    ...     pass
    >>> names = [c.__name__ for c in enable(Mine).__mro__]
    >>> names[:3], names[names.index("Mine") + 1]
    (['PadfreeMine', 'TrainerMixin', 'InRunProofMixin'], 'Trainer')
    """
    if not isinstance(trainer_class, type):
        raise InvalidArgumentError(
            f"enable takes a trainer class (e.g. trl.SFTTrainer or transformers.Trainer), got {describe(trainer_class)}"
            f"; build the trainer from the returned class — a constructed trainer has already prepared its data"
        )
    names = [c.__name__ for c in trainer_class.__mro__]
    trl = sys.modules.get("trl")
    if trl is None and any(name in _TRL_TRAINERS for name in names):
        import trl
    for name, module in _TRL_TRAINERS.items():
        trl_class = getattr(trl, name, None) if trl is not None else None
        if trl_class is None or not issubclass(trainer_class, trl_class):
            continue
        padfree_module = importlib.import_module(module)
        mixin = getattr(padfree_module, f"{name.removesuffix('Trainer')}Mixin")
        padfree_class = getattr(padfree_module, name)
        if trainer_class is trl_class:
            return padfree_class
        if issubclass(trainer_class, mixin):
            return trainer_class
        return type(f"Padfree{trainer_class.__name__}", (mixin, trainer_class), {"__module__": __name__})
    if issubclass(trainer_class, transformers.Trainer):
        if issubclass(trainer_class, PadfreeTrainerMixin):
            return trainer_class
        if trainer_class is transformers.Trainer:
            return Trainer
        return type(f"Padfree{trainer_class.__name__}", (TrainerMixin, trainer_class), {"__module__": __name__})
    raise InvalidArgumentError(
        f"enable takes a subclass of transformers.Trainer (TRL's SFT, DPO, reward and GRPO trainers included), got "
        f"{trainer_class.__qualname__}"
    )
