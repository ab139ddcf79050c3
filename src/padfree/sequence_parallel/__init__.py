"""Sequence parallelism for packed rows: one row's tokens split across a group of ranks, exact.

- :mod:`~padfree.sequence_parallel.groups` — the group (:class:`SequenceParallel`) from an int, a process group or
  a 1-D ``DeviceMesh``;
- :mod:`~padfree.sequence_parallel.collectives` — the differentiable exchanges (tokens ↔ heads, the whole row, a
  convolution's history);
- :mod:`~padfree.sequence_parallel.split` — :func:`split_for_sequence_parallel`, a rank's slice of a batch with
  its labels shifted across the slice edges.

The rest of sequence parallelism lives with the layer that uses it:

- the model side, :mod:`padfree.model.sharded` — :class:`~padfree.model.sharded.ShardedLayout`, the row's
  boundaries gathered from the slices, and the exchanges that attention and the mixers wrap around their exact
  packed code (``configure_packing(model, sequence_parallel=P)`` sets it up);
- the trainer side, :mod:`padfree.integrations.loaders` — a group's ranks load the same batches
  (:func:`~padfree.integrations.loaders.loaders_for_group`) and the trainer's model is configured for its groups
  (:func:`~padfree.integrations.loaders.setup_sequence_parallel`); :mod:`padfree.integrations.causal_lm` cuts each
  rank's slice before the forward.

The user guide is ``docs/sequence_parallel.md``.
"""

from padfree.sequence_parallel.groups import SequenceParallel, sequence_parallel_group
from padfree.sequence_parallel.split import SequenceParallelSlice, split_for_sequence_parallel

__all__ = ["SequenceParallel", "SequenceParallelSlice", "sequence_parallel_group", "split_for_sequence_parallel"]
