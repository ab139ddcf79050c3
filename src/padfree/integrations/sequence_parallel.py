"""Sequence parallelism in a ``transformers.Trainer``: which batches a rank loads, and the slice it trains.

Under ``configure_packing(model, sequence_parallel=P)`` the ``P`` ranks of a group train on the same rows, each on
its slice. So the loader deals batches to the *groups* (``W / P`` data-parallel replicas: every rank of a group
loads the same batch) and each rank keeps its slice (:func:`padfree.split_for_sequence_parallel`) right before the
forward. Gradients need nothing new: DDP or FSDP2 over all ``W`` ranks sums the group's partial gradients and
averages the replicas in one reduction, which padfree's loss rule (the step's targets divided by ``W``) turns into
the token mean of the whole step.

accelerate's ``ParallelismConfig`` has no sequence-parallel dimension outside DeepSpeed (its ``sp_size`` routes the
Trainer into DeepSpeed's own loss and loader), so padfree reads the group from the configured model and prepares the
loaders itself with accelerate's ``prepare_data_loader``, for the data-parallel rank and size of the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from padfree.errors import InvalidArgumentError
from padfree.integrations.decide import configure_model
from padfree.model.state import packing_state
from padfree.model.wrappers import unwrap_model
from padfree.packing.inputs import as_int
from padfree.sequence_parallel import SequenceParallel

__all__ = ["group_of", "loaders_for_group", "sequence_parallel_size", "setup_sequence_parallel"]


def group_of(model: Any) -> SequenceParallel | None:
    """The sequence-parallel group of the transformers model inside ``model`` (None: none, or not configured)."""
    base = unwrap_model(model)
    state = packing_state(base) if base is not None else None
    return None if state is None else state.sp


def sequence_parallel_size(value: Any, name: str) -> int:
    """``value`` as a sequence-parallel size: the ranks that split one row, an integer >= 1 (None: 1)."""
    return 1 if value is None else as_int(value, name, minimum=1)


def _prepare(accelerator: Any, sp: SequenceParallel, data_loader: Any, device_placement: Any = None,
             slice_fn_for_dispatch: Any = None) -> Any:
    """``accelerator.prepare_data_loader`` for the data-parallel replicas of ``sp``: ranks of one group load the
    same batches."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import DistributedType

    if accelerator.dispatch_batches:
        raise InvalidArgumentError(
            "accelerate's dispatch_batches with sequence parallelism: process 0 would deal different slices of "
            "batches to the ranks of a group; set dispatch_batches=False (accelerator_config)")
    if device_placement is None:
        device_placement = accelerator.device_placement if accelerator.distributed_type != DistributedType.XLA \
            else False
    prepared = prepare_data_loader(
        data_loader, accelerator.device, num_processes=sp.dp_size, process_index=sp.dp_rank,
        split_batches=accelerator.split_batches, put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    accelerator._dataloaders.append(prepared)  # where accelerate keeps them for save_state / load_state
    return prepared


@contextlib.contextmanager
def loaders_for_group(accelerator: Any, sp: SequenceParallel | None) -> Iterator[None]:
    """Inside the block, the loaders ``accelerator`` prepares are dealt to the data-parallel replicas of ``sp``
    (every rank of a group the same batches) instead of to every process; no effect when ``sp`` is None."""
    if sp is None:
        yield
        return
    original = accelerator.prepare_data_loader

    def prepare(data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None) -> Any:
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return original(data_loader, device_placement, slice_fn_for_dispatch)
        return _prepare(accelerator, sp, data_loader, device_placement, slice_fn_for_dispatch)

    accelerator.prepare_data_loader = prepare  # this accelerator only, for the duration of the block
    try:
        yield
    finally:
        del accelerator.prepare_data_loader


def setup_sequence_parallel(model: Any, args: Any, size: int, loss: str | None) -> None:
    """Configure ``model`` to split every forward across groups of ``size`` ranks (nothing for 1): the process
    group is set up from the launcher's environment through ``args`` first, as the Trainer would."""
    if size <= 1:
        return
    import transformers

    if not isinstance(args, transformers.TrainingArguments):
        raise InvalidArgumentError(f"sequence parallelism needs the trainer's args (TrainingArguments) to set up "
                                   f"torch.distributed, got {type(args).__name__}")
    _ = args.device  # transformers initialises the process group from the launcher's variables here
    configure_model(model, sequence_parallel=size)
