"""Which ranks split one packed row between them: the sequence-parallel group, and the data-parallel rest.

A group of ``P`` ranks trains on one packed row together, each holding a contiguous ``1/P`` slice of its tokens;
the ``W / P`` groups of a world of ``W`` ranks are the data-parallel replicas. :func:`sequence_parallel_group`
reads every way of naming the group — an int that builds the groups (consecutive ranks: ``[0, P)``, ``[P, 2P)``,
...), a ``torch.distributed`` process group, or a 1-D ``DeviceMesh`` — into one :class:`SequenceParallel`.

>>> sequence_parallel_group(None) is None and sequence_parallel_group(1) is None   # no process group needed
True
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch.distributed as dist

from padfree.errors import InvalidArgumentError, describe

__all__ = ["SequenceParallel", "sequence_parallel_group"]


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceParallel:
    """One rank's view of its sequence-parallel group.

    Attributes:
        group: the ``torch.distributed`` process group of the ``size`` ranks that share a row.
        size: ``P``, the ranks of the group; a row of ``T`` tokens is cut into ``P`` slices of ``T / P``.
        rank: this rank's place in the group: it holds slice ``rank``, tokens ``[rank·T/P, (rank+1)·T/P)``.
        ranks: the global ranks of the group, slice by slice.
        dp_size: how many groups the world holds (the data-parallel replicas).
        dp_rank: this rank's group among them (ranks of one group load the same batches).
    """

    group: Any
    size: int
    rank: int
    ranks: tuple[int, ...]
    dp_size: int
    dp_rank: int

    def __deepcopy__(self, memo: dict) -> SequenceParallel:
        return self  # a process group is this process's, not a model's: a copied model splits over the same one

    def __str__(self) -> str:
        consecutive = self.ranks == tuple(range(self.ranks[0], self.ranks[-1] + 1))
        span = f"ranks {self.ranks[0]}-{self.ranks[-1]}" if consecutive else f"ranks {list(self.ranks)}"
        return (f"{self.size} ranks ({span}; this rank holds slice {self.rank}), "
                f"{self.dp_size} data-parallel group{'s' if self.dp_size != 1 else ''}")


_BUILT: dict[tuple[int, int], SequenceParallel] = {}  # (P, world) -> the groups an int built, made once per run


def _world(what: str) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(
            f"sequence_parallel={what} needs torch.distributed initialised (torchrun, accelerate launch, or "
            f"torch.distributed.init_process_group) in every process; none is")
    return dist.get_rank(), dist.get_world_size()


def _from_size(size: int) -> SequenceParallel:
    rank, world = _world(str(size))
    if world % size:
        raise InvalidArgumentError(
            f"sequence_parallel={size} does not divide the {world} ranks of the world; accepted: a divisor of "
            f"{world} (the groups are consecutive ranks, the rest data parallel)")
    key = (size, world)
    if key not in _BUILT:
        mine = None
        for first in range(0, world, size):  # every rank creates every group, in the same order (a collective)
            ranks = tuple(range(first, first + size))
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = SequenceParallel(group, size, rank - first, ranks, world // size, first // size)
        _BUILT[key] = mine
    return _BUILT[key]


def _from_group(group: Any) -> SequenceParallel:
    rank, world = _world(f"a process group ({type(group).__name__})")
    ranks = tuple(dist.get_process_group_ranks(group))
    if rank not in ranks:
        raise InvalidArgumentError(f"sequence_parallel is a process group of ranks {list(ranks)}, which does not hold "
                                   f"this process (rank {rank})")
    size = len(ranks)
    if world % size:
        raise InvalidArgumentError(f"sequence_parallel is a group of {size} ranks, which does not divide the world of "
                                   f"{world}: the data-parallel groups would be uneven")
    # the data-parallel index of a group: its place among the groups of the world, ordered by their first rank
    firsts: list[int | None] = [None] * world
    dist.all_gather_object(firsts, min(ranks))
    order = sorted(set(firsts))
    if len(order) * size != world:
        raise InvalidArgumentError(f"the sequence-parallel groups of the world do not partition it into groups of "
                                   f"{size} ranks (first ranks {order})")
    return SequenceParallel(group, size, ranks.index(rank), ranks, world // size, order.index(min(ranks)))


def sequence_parallel_group(spec: Any, name: str = "sequence_parallel") -> SequenceParallel | None:
    """``spec`` as a :class:`SequenceParallel`, or None when it asks for none (``None``, ``False``, ``1``, or a
    group of one rank).

    Args:
        spec: an int ``P >= 1`` (the world is cut into groups of ``P`` consecutive ranks; every rank must make the
            call, since building process groups is collective), a ``torch.distributed`` process group (every rank
            of the world calls with its own group; the groups must partition the world), a 1-D
            ``DeviceMesh`` (its group), or a :class:`SequenceParallel`.
        name: the argument's name, for errors.
    """
    if spec is None or spec is False:
        return None
    if isinstance(spec, SequenceParallel):
        return spec
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool):
        if int(spec) < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, a process group or a 1-D DeviceMesh; got "
                                       f"{describe(spec)}")
        return None if int(spec) == 1 else _from_size(int(spec))
    if type(spec).__name__ == "DeviceMesh":
        if spec.ndim != 1:
            raise InvalidArgumentError(f"{name} is a {spec.ndim}-D DeviceMesh; pass its sequence-parallel dimension "
                                       f"(mesh['sp']), a 1-D mesh")
        spec = spec.get_group()
    if isinstance(spec, dist.ProcessGroup):
        found = _from_group(spec)
        return None if found.size == 1 else found
    raise InvalidArgumentError(f"{name} must be an int >= 1, a torch.distributed process group or a 1-D DeviceMesh; "
                               f"got {describe(spec)}")
