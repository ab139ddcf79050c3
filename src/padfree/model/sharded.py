"""The boundaries of a packed forward under sequence parallelism: the whole row's layout, and this rank's slice.

A configured model with ``sequence_parallel`` runs every forward on a slice of ``S = T / P`` tokens per row (see
:func:`padfree.split_for_sequence_parallel`). Per-token layers (embeddings, norms, MLPs, projections, RoPE on the
row's own positions) need nothing more. Token mixing needs the whole row, whose boundaries every rank knows: the
forward hook gathers the slices' ``position_ids`` once per forward into one :class:`ShardedLayout` — the row's
:class:`~padfree.model.packed.PackedLayout` plus the slice this rank holds — and the mixing layers go around it:

- **attention** and the **scans** (GatedDeltaNet, Mamba-2 SSD, Mamba-1) exchange tokens for heads (Ulysses): each
  rank runs the exact packed computation of :mod:`padfree.model.attention` / :mod:`padfree.model.scans` over the
  whole row for ``1/P`` of the heads (or channels), with the row's boundaries; no state crosses ranks;
- **short convolutions** read the ``K - 1`` tokens before the slice (:meth:`ShardedLayout.with_history`), which
  a boundary may cut like any other history.

Grouped key/value heads (attention), key heads (GatedDeltaNet) and B/C groups (Mamba-2) that the group size does
not divide are repeated per query / value head first, which is exact; query and value heads it does not divide are
refused by name (:class:`~padfree.errors.UnsupportedModelError`).

>>> from padfree.model.packed import PackedLayout
>>> import torch
>>> row = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]]))
>>> [row.columns(2 * r, 2 * r + 2).lengths.tolist() for r in range(4)]   # each rank's slice of a row of 8 on 4 ranks
[[2], [1, 1], [2], [1, 1]]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from padfree.errors import InvalidLayoutError, PackingDisabledError, UnsupportedModelError
from padfree.model.packed import PackedLayout
from padfree.sequence_parallel import collectives
from padfree.sequence_parallel.groups import SequenceParallel

__all__ = ["ShardedLayout", "conv_window", "gather_boundaries", "refuse_together", "selective_scan_channels"]


@dataclasses.dataclass(eq=False)
class ShardedLayout:
    """One rank's slice of a packed forward split across a sequence-parallel group.

    Attributes:
        full: the row's :class:`PackedLayout`, ``(B, T)``, the same on every rank of the group.
        sp: the group.
    """

    full: PackedLayout
    sp: SequenceParallel

    @property
    def width(self) -> int:
        """``S``: tokens per row on every rank."""
        return self.full.shape[1] // self.sp.size

    @property
    def start(self) -> int:
        """The first column of this rank's slice."""
        return self.sp.rank * self.width

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, S)``: the tokens this rank holds."""
        return self.full.shape[0], self.width

    @property
    def device(self) -> torch.device:
        return self.full.device

    @property
    def local(self) -> PackedLayout:
        """The layout of this rank's own columns (a sequence cut at the slice's start begins a segment there)."""
        return self.full.columns(self.start, self.start + self.width)

    @property
    def position_ids(self) -> torch.Tensor:
        """``(B, S)``: the row's positions over this slice (what RoPE must see)."""
        return self.local.position_ids

    def check_tokens(self, hidden: torch.Tensor, who: str) -> None:
        """Refuse a tensor whose ``(B, S)`` is not this slice's: the layout belongs to another forward."""
        if tuple(hidden.shape[:2]) != self.shape:
            raise InvalidLayoutError(
                f"{who} got inputs of shape {tuple(hidden.shape[:2])} but this rank's slice of the packed row is "
                f"{self.shape} (the row is {self.full.shape}, split over {self.sp.size} ranks); the boundaries "
                f"belong to another batch")

    # ---- the exchanges ---------------------------------------------------------------------------------------

    def heads_of(self, count: int, who: str, what: str = "heads") -> int:
        """``count / P``, the heads (channels) each rank runs; refuses a count the group size does not divide."""
        if count % self.sp.size:
            raise UnsupportedModelError(
                f"{who} has {count} {what}, which sequence parallelism over {self.sp.size} ranks cannot split "
                f"evenly (each rank runs 1/{self.sp.size} of them over the whole row); use a group size that divides "
                f"{count}")
        return count // self.sp.size

    def to_heads(self, x: torch.Tensor, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
        """Slice of tokens, all heads → the whole row, this rank's ``1/P`` of the heads."""
        return collectives.scatter_heads(x, self.sp, seq_dim, head_dim)

    def to_tokens(self, x: torch.Tensor, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
        """The inverse of :meth:`to_heads`."""
        return collectives.gather_heads(x, self.sp, seq_dim, head_dim)

    def whole_row(self, x: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """A tensor without a head dimension over the whole row (every rank the same)."""
        return collectives.gather_sequence(x, self.sp, seq_dim)

    def head_slice(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's ``1/P`` of a per-head parameter (sinks, ``A``, ``D``, ``dt_bias``) along ``dim``."""
        part = x.shape[dim] // self.sp.size
        return x.narrow(dim, self.sp.rank * part, part)

    def with_history(self, x: torch.Tensor, width: int, seq_dim: int) -> tuple[torch.Tensor, PackedLayout, int]:
        """``(x with the h tokens before the slice prepended, their layout, h)`` for a causal convolution of
        ``width + 1`` taps: run it on the extended tokens with that layout and drop the first ``h`` outputs.
        The prepended tokens reach the slice's first outputs only where no boundary lies between them."""
        before = collectives.history(x, self.sp, width, seq_dim)
        h = before.shape[seq_dim]
        # prepended on every rank, even empty (rank 0): the history's exchange must be in every rank's autograd
        # graph, or its backward would wait on rank 0 for ever
        window = self.full.columns(self.start - h, self.start + self.width)
        return torch.cat([before, x], dim=seq_dim), window, h


def conv_window(lay: PackedLayout | ShardedLayout, x: torch.Tensor, width: int
                ) -> tuple[torch.Tensor, PackedLayout, int]:
    """``(tokens, layout, cut)`` for a causal convolution of ``width`` taps over ``x`` ``(B, C, S)``: under
    sequence parallelism the slice with the ``width - 1`` tokens before it and their layout (drop the first ``cut``
    outputs), else ``x`` and its layout as they are."""
    if isinstance(lay, ShardedLayout):
        return lay.with_history(x, width - 1, seq_dim=2)
    return x, lay, 0


def selective_scan_channels(lay: ShardedLayout, who: str, hidden_states: torch.Tensor, dt: torch.Tensor,
                            A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                            z: torch.Tensor | None, delta_bias: torch.Tensor | None) -> tuple:
    """Mamba-1's selective-scan inputs for this rank's ``1/P`` of the channels over the whole row:
    ``hidden_states``, ``dt``, ``z`` ``(b, d, S)`` → ``(b, d/P, T)``; ``A`` ``(d, n)``, ``D``, ``delta_bias``
    ``(d,)`` sliced; ``B``, ``C`` ``(b, n, S)`` shared by every channel → ``(b, n, T)`` (the whole row)."""
    lay.heads_of(hidden_states.shape[1], who, "channels")
    hidden_states, dt, z = (None if t is None else lay.to_heads(t, seq_dim=2, head_dim=1)
                            for t in (hidden_states, dt, z))
    A, D, delta_bias = (None if t is None else lay.head_slice(t) for t in (A, D, delta_bias))
    return hidden_states, dt, A, lay.whole_row(B, seq_dim=2), lay.whole_row(C, seq_dim=2), D, z, delta_bias


def gather_boundaries(named: dict[str, Any], sp: SequenceParallel, batch: int, width: int, *,
                      refusal: str | None = None) -> dict[str, Any]:
    """The whole row's ``position_ids`` and ``attention_mask`` (each None when absent), gathered from the slices
    of every rank of the group, after checking that every rank holds a slice of the same shape and passes the same
    kinds of boundaries, and that no rank refused the forward (``refusal``: why this one does). Otherwise every
    rank raises — :class:`PackingDisabledError` for a refusal, :class:`InvalidLayoutError` for slices that are not
    of one row — and none is left waiting in a collective."""
    pos, mask = named.get("position_ids"), named.get("attention_mask")
    if isinstance(mask, dict) and all(v is None for v in mask.values()):
        mask = None  # a multimodal model's per-layer-type mapping, built empty for a packed forward
    if isinstance(pos, torch.Tensor) and pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[0] == 1 and batch > 1:
        pos = pos.expand(batch, -1)
    problem = None
    for key, value in (("position_ids", pos), ("attention_mask", mask)):
        if value is not None and not (isinstance(value, torch.Tensor) and tuple(value.shape) == (batch, width)
                                      and not value.dtype.is_floating_point):
            problem = (f"{key} must be an integer tensor of this rank's {batch} x {width} tokens, got "
                       f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    has_pos, has_mask = pos is not None and problem is None, mask is not None and problem is None
    device = next((t.device for t in (pos, mask) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    # one small exchange first: a rank whose slice differs must make every rank raise, not leave them waiting
    meta = torch.tensor([[batch, width, int(has_pos), int(has_mask), int(problem is not None),
                          int(refusal is not None)]], dtype=torch.int64)
    seen = collectives.all_gather_ints(meta.to(device), sp, dim=0).cpu()
    if refusal is not None:
        raise PackingDisabledError(refusal)
    _raise_for(sp, seen[:, 5])
    seen = seen[:, :5]
    if problem is not None or not bool((seen == seen[0]).all()):
        described = ", ".join(
            f"rank {r}: {b} x {w} tokens{' + position_ids' if p else ''}{' + attention_mask' if m else ''}"
            f"{' (unusable boundaries)' if bad else ''}" for r, (b, w, p, m, bad) in zip(sp.ranks, seen.tolist(),
                                                                                      strict=True))
        raise InvalidLayoutError(
            f"the ranks of the sequence-parallel group do not hold slices of one row ({described})"
            f"{'; here: ' + problem if problem else ''}; every rank must pass its slice of the same batch "
            f"(split_for_sequence_parallel)")
    return {
        "position_ids": collectives.all_gather_ints(pos.to(torch.int64), sp) if has_pos else None,
        "attention_mask": collectives.all_gather_ints(mask.to(torch.int64), sp) if has_mask else None,
    }


def refuse_together(sp: SequenceParallel, problem: str | None) -> None:
    """Raise :class:`PackingDisabledError` on every rank of the group when any rank has a ``problem`` (its text,
    or the ranks that have one): a rank that raised alone would leave the others waiting in the next collective."""
    flags = collectives.all_gather_ints(torch.tensor([[int(problem is not None)]]), sp, dim=0).view(-1)
    if problem is not None:
        raise PackingDisabledError(problem)
    _raise_for(sp, flags)


def _raise_for(sp: SequenceParallel, flags: torch.Tensor) -> None:
    if bool(flags.any()):
        bad = [r for r, f in zip(sp.ranks, flags.tolist(), strict=True) if f]
        raise PackingDisabledError(f"rank(s) {bad} of the sequence-parallel group refused this forward (see their "
                                   f"error); every rank of the group stops with it")
