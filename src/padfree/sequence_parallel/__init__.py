"""Sequence parallelism for packed rows: one row's tokens split across a group of ranks, exact.

- :mod:`~padfree.sequence_parallel.groups` — the group (:class:`SequenceParallel`) from an int, a process group or
  a 1-D ``DeviceMesh``;
- :mod:`~padfree.sequence_parallel.collectives` — the differentiable exchanges (tokens ↔ heads, the whole row, a
  convolution's history);
- :mod:`~padfree.sequence_parallel.split` — :func:`split_for_sequence_parallel`, a rank's slice of a batch with
  its labels shifted across the slice edges.

The model side (attention and mixers over the global boundaries) is :mod:`padfree.model.sharded`; the user guide is
``docs/sequence_parallel.md``.
"""

from padfree.sequence_parallel.groups import SequenceParallel, sequence_parallel_group
from padfree.sequence_parallel.split import SequenceParallelSlice, split_for_sequence_parallel

__all__ = ["SequenceParallel", "SequenceParallelSlice", "sequence_parallel_group", "split_for_sequence_parallel"]
