"""What a configured model carries: its backend, hooks, the layout of the forward in flight, what to restore.

Shared by :mod:`padfree.model.install` (which creates it) and the boundary-aware modules it installs (which read
the layout of the call in flight from it), so that neither imports the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from padfree.model.packed import PackedLayout

__all__ = ["PackingState", "current_layout", "packing_state", "unpatch"]


@dataclasses.dataclass(eq=False)
class PackingState:
    """Per configured model: backend, report, hook handles, the layout of the forward in flight (for modules that
    are not handed keyword arguments), and what to restore.

    Attributes:
        backend: the attention implementation in use (``padfree_sdpa``, ..., ``none``).
        report: the :class:`~padfree.model.install.PackingReport` of the configuration.
        handles: the forward hooks installed on the model.
        layout: the :class:`~padfree.model.packed.PackedLayout` of the packed forward in flight (None otherwise).
        tokens: context tokens of the hook that marks a forward as packed.
        previous: ``(attention implementation, use_cache)`` before configuring.
        sp: the sequence-parallel group every forward is split across (None: each rank runs whole rows).
    """

    backend: str
    report: Any
    handles: list = dataclasses.field(default_factory=list)
    layout: PackedLayout | None = None
    tokens: list = dataclasses.field(default_factory=list)
    previous: tuple = (None, None)
    sp: Any = None


def packing_state(model: torch.nn.Module) -> PackingState | None:
    """The padfree state of a configured model (None if :func:`~padfree.configure_packing` was never called on it)."""
    return getattr(model, "_padfree_state", None)


def current_layout(state: PackingState, hidden: torch.Tensor, who: str) -> PackedLayout | None:
    """The layout of the forward in flight for a module that receives no keyword arguments (None: unpacked batch).

    Under sequence parallelism it is a :class:`~padfree.model.sharded.ShardedLayout` (checked against this rank's
    slice). The layout stays set after the forward so that activation checkpointing can recompute a layer during
    backward; its shape is checked against ``hidden`` so a stale layout is an error, never a silent wrong boundary.
    """
    lay = state.layout
    if lay is not None:
        lay.check_tokens(hidden, who)
    return lay


def hooks_live(state: Any) -> bool:
    """Whether ``state``'s hooks are still installed (False after ``unconfigure_packing`` or a refused configure):
    a stale layout must never reach a module."""
    handles = getattr(state, "handles", None)
    if not handles:
        return False
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is None or handle.id not in hooks:
            return False
    return True


def unpatch(model: torch.nn.Module, attr: str) -> bool:
    """Undo a family's patch on every module of ``model`` that carries ``attr``: the attribute and the instance's
    own ``forward`` go, the class's comes back. False if no module carried it."""
    done = False
    for sub in model.modules():
        if attr in sub.__dict__:
            del sub.__dict__[attr]
            sub.__dict__.pop("forward", None)
            done = True
    return done
