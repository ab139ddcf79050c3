"""The three exchanges of sequence parallelism, differentiable, on ``torch.distributed``'s own collectives.

A rank holds a slice of ``S = T / P`` tokens of a row, with every head. Token mixing needs the whole row, so:

- :func:`scatter_heads` — slice of tokens, all heads → all tokens, ``1/P`` of the heads (one all-to-all); its
  inverse :func:`gather_heads` hands the mixed tokens back. Heads (or channels) are independent in attention and
  in the scans, so each rank runs the exact unsharded computation on its heads.
- :func:`gather_sequence` — every rank gets the whole row of a tensor without a head dimension (one all-gather;
  its backward sums the gradients and hands each rank its slice's).
- :func:`history` — the ``width`` tokens just before this rank's slice (a short convolution's taps): one
  all-gather of every rank's last tokens.

Each backward is the adjoint exchange (all-to-all for all-to-all, reduce-scatter for all-gather), so gradients
reach the rank that holds the token they belong to. Shapes below: ``S`` tokens per rank, ``T = P·S``, ``H`` heads.

>>> from padfree.sequence_parallel.collectives import scatter_heads  # needs an initialised process group to run
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from padfree.sequence_parallel.groups import SequenceParallel

__all__ = ["all_gather_ints", "gather_heads", "gather_sequence", "history", "scatter_heads"]


class _AllToAll(torch.autograd.Function):
    """``out[i] = `` block ``rank`` of rank ``i``'s ``x`` (``x``: ``(P, ...)``, contiguous). Its adjoint is itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty(x.shape)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # autograd may hand a strided gradient: the exchange reads and writes flat memory
        out = grad.new_empty(grad.shape)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _AllGather(torch.autograd.Function):
    """``(n, ...)`` on every rank → ``(P·n, ...)``, rank after rank; the backward sums and scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty(size * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[0] // size, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


def scatter_heads(x: torch.Tensor, sp: SequenceParallel, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
    """This rank's ``H / P`` heads over the whole row: ``S`` along ``seq_dim`` and ``H`` along ``head_dim`` in,
    ``T`` and ``H / P`` out (heads ``[rank·H/P, (rank+1)·H/P)``, tokens in row order). ``H % P == 0``."""
    x = x.movedim((seq_dim, head_dim), (0, 1))  # (S, H, ...)
    seq, heads, rest = x.shape[0], x.shape[1], x.shape[2:]
    x = x.reshape(seq, sp.size, heads // sp.size, *rest).transpose(0, 1).contiguous()  # block i: heads of rank i
    out = _AllToAll.apply(x, sp.group)  # block i: rank i's tokens, this rank's heads
    # contiguous, like the unsplit tensor: modeling code views its inputs and outputs freely
    return out.reshape(sp.size * seq, heads // sp.size, *rest).movedim((0, 1), (seq_dim, head_dim)).contiguous()


def gather_heads(x: torch.Tensor, sp: SequenceParallel, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
    """The inverse of :func:`scatter_heads`: ``T`` tokens of ``H / P`` heads in, this rank's ``S`` tokens of all
    ``H`` heads out."""
    x = x.movedim((seq_dim, head_dim), (0, 1))  # (T, H/P, ...)
    total, part, rest = x.shape[0], x.shape[1], x.shape[2:]
    x = x.reshape(sp.size, total // sp.size, part, *rest).contiguous()  # block i: rank i's tokens
    out = _AllToAll.apply(x, sp.group)  # block i: this rank's tokens, rank i's heads
    out = out.transpose(0, 1).reshape(total // sp.size, sp.size * part, *rest)
    return out.movedim((0, 1), (seq_dim, head_dim)).contiguous()


def gather_sequence(x: torch.Tensor, sp: SequenceParallel, seq_dim: int = 1) -> torch.Tensor:
    """The whole row of ``x``: ``S`` along ``seq_dim`` in, ``T`` out, every rank the same."""
    x = x.movedim(seq_dim, 0).contiguous()
    return _AllGather.apply(x, sp.group, sp.size).movedim(0, seq_dim).contiguous()


def history(x: torch.Tensor, sp: SequenceParallel, width: int, seq_dim: int = 1) -> torch.Tensor:
    """The ``h = min(width, rank·S)`` tokens of the row just before this rank's slice, ``h`` along ``seq_dim``
    (empty on rank 0). They may come from several ranks when ``S < width``. Every rank must use the result, empty
    or not, so that the exchange's backward runs on every rank."""
    seq = x.shape[seq_dim]
    keep = min(width, seq)
    tails = gather_sequence(x.narrow(seq_dim, seq - keep, keep), sp, seq_dim)  # rank j's last `keep` tokens
    start = sp.rank * seq
    h = min(width, start)
    wanted = torch.arange(start - h, start, device=x.device)  # global token indices
    owner = torch.div(wanted, seq, rounding_mode="floor")
    slot = owner * keep + wanted - (owner + 1) * seq + keep  # where in the gathered tails each one is
    return tails.index_select(seq_dim, slot)


def all_gather_ints(x: torch.Tensor, sp: SequenceParallel, dim: int = 1) -> torch.Tensor:
    """``x`` (no gradient) of every rank concatenated along ``dim``, rank after rank, on ``x``'s device (the
    exchange itself runs where the group's backend wants it: CUDA for NCCL)."""
    home = x.device
    wire = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(sp.group)) else home
    x = x.movedim(dim, 0).contiguous().to(wire)
    out = x.new_empty(sp.size * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x, group=sp.group)
    return out.to(home).movedim(0, dim)
