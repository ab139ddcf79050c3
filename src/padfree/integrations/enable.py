"""``padfree.enable``: the padfree version of any ``transformers.Trainer`` or ``trl.SFTTrainer`` class.

Both trainer modules are below this one: :mod:`padfree.integrations.trainer` for ``Trainer`` subclasses and, only
when the class is TRL's, :mod:`padfree.integrations.trl` — so TRL is imported only for a class that already needs
it, and neither trainer module has to know the other.
"""

from __future__ import annotations

import sys

from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.integrations.trainer import PadfreeTrainerMixin, Trainer, TrainerMixin

try:
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError("padfree.enable needs transformers; pip install 'padfree[torch,hf]'") from exc

__all__ = ["enable"]


def enable(trainer_class: type) -> type:
    """The padfree version of a trainer class: ``enable(trl.SFTTrainer)`` is :class:`padfree.SFTTrainer`; a
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
    trl = sys.modules.get("trl")
    if trl is None and "SFTTrainer" in [c.__name__ for c in trainer_class.__mro__]:
        import trl
    if trl is not None and issubclass(trainer_class, trl.SFTTrainer):
        from padfree.integrations.trl import SFTMixin, SFTTrainer

        if trainer_class is trl.SFTTrainer:
            return SFTTrainer
        if issubclass(trainer_class, SFTMixin):
            return trainer_class
        return type(f"Padfree{trainer_class.__name__}", (SFTMixin, trainer_class), {"__module__": __name__})
    if issubclass(trainer_class, transformers.Trainer):
        if issubclass(trainer_class, PadfreeTrainerMixin):
            return trainer_class
        if trainer_class is transformers.Trainer:
            return Trainer
        return type(f"Padfree{trainer_class.__name__}", (TrainerMixin, trainer_class), {"__module__": __name__})
    raise InvalidArgumentError(
        f"enable takes a subclass of transformers.Trainer or trl.SFTTrainer, got {trainer_class.__qualname__}"
    )
