"""``padfree.enable``: the padfree version of any ``transformers.Trainer`` class, or of TRL's SFT, DPO, reward or
GRPO trainer class.

Every trainer module is below this one: :mod:`padfree.integrations.trainer` for ``Trainer`` subclasses and, only
when the class is TRL's, the module of that TRL trainer (:mod:`~padfree.integrations.trl`,
:mod:`~padfree.integrations.dpo`, :mod:`~padfree.integrations.reward`, :mod:`~padfree.integrations.grpo`) — so TRL
is imported only for a class that already needs it, and no trainer module has to know another.
"""

from __future__ import annotations

import importlib
import sys

from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.integrations.trainer import PadfreeTrainerMixin, Trainer, TrainerMixin

try:
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError("padfree.enable needs transformers; pip install 'padfree[torch,hf]'") from exc

__all__ = ["enable"]

# TRL's trainer -> (padfree module, its mixin, its trainer); the most derived TRL classes first
_TRL_TRAINERS = {
    "SFTTrainer": ("padfree.integrations.trl", "SFTMixin", "SFTTrainer"),
    "DPOTrainer": ("padfree.integrations.dpo", "DPOMixin", "DPOTrainer"),
    "RewardTrainer": ("padfree.integrations.reward", "RewardMixin", "RewardTrainer"),
    "GRPOTrainer": ("padfree.integrations.grpo", "GRPOMixin", "GRPOTrainer"),
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
    >>> [c.__name__ for c in enable(Mine).__mro__[:4]]
    ['PadfreeMine', 'TrainerMixin', 'PadfreeTrainerMixin', 'Mine']
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
    for name, (module, mixin_name, padfree_name) in _TRL_TRAINERS.items():
        trl_class = getattr(trl, name, None) if trl is not None else None
        if trl_class is None or not issubclass(trainer_class, trl_class):
            continue
        padfree_module = importlib.import_module(module)
        mixin, padfree_class = getattr(padfree_module, mixin_name), getattr(padfree_module, padfree_name)
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
