"""What a configured model carries: its backend, hooks and what to restore.

Shared by :mod:`padfree.model.install` (which creates it) and the boundary-aware modules it installs (which read
the layout of the call in flight for it, :mod:`padfree.model.flight`), so that neither imports the other.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.model.flight import layout_in_flight
from padfree.model.packed import PackedLayout

__all__ = ["PackingState", "current_layout", "packing_state", "patch", "unpatch"]


@dataclasses.dataclass(eq=False)
class PackingState:
    """Per configured model: backend, report, hook handles and what to restore. The layout of a forward is not
    kept here: it travels with that forward (:mod:`padfree.model.flight`).

    Attributes:
        backend: the attention implementation in use (``padfree_sdpa``, ..., ``none``).
        report: the :class:`~padfree.model.install.PackingReport` of the configuration.
        handles: the forward hooks installed on the model.
        tokens: per hooked call in flight, the context tokens its pre-hook set (its post-hook resets them).
        checkpointed: the modules whose activation-checkpointing function padfree binds to each forward.
        previous: ``(attention implementation, use_cache)`` before configuring.
        sp: the sequence-parallel group every forward is split across (None: each rank runs whole rows).
        image_check: ``(model) -> None | why``: whether images in packed rows are proven exact for this model, set
            by ``configure_packing`` (None: not asked — :func:`~padfree.model.install.install_packing` alone, the
            machinery the proofs themselves run); its answer is kept in ``images`` after the first packed batch
            with images.
    """

    backend: str
    report: Any
    handles: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    checkpointed: list = dataclasses.field(default_factory=list)
    previous: tuple = (None, None)
    sp: Any = None
    image_check: Any = None
    images: dict = dataclasses.field(default_factory=dict)


def packing_state(model: torch.nn.Module) -> PackingState | None:
    """The padfree state of a configured model (None if :func:`~padfree.configure_packing` was never called on it)."""
    return getattr(model, "_padfree_state", None)


def current_layout(state: PackingState, hidden: torch.Tensor, who: str) -> PackedLayout | None:
    """The layout of the forward ``hidden`` belongs to, for a module that receives no keyword arguments (None: an
    ordinary batch). Under sequence parallelism it is a :class:`~padfree.model.sharded.ShardedLayout` (checked
    against this rank's slice). Its shape is checked against ``hidden``; a recompute during backward that cannot be
    bound to its own forward refuses (see :mod:`padfree.model.flight`)."""
    return layout_in_flight(state, hidden, who)


@torch.compiler.disable
def layout_if_packed(state: Any, hidden: Any, who: str) -> PackedLayout | None:
    """The layout of a family's module call: its forward's (:func:`current_layout`) while ``state``'s hooks are live
    and ``hidden`` is a ``(B, T, D)`` tensor; None for an ordinary batch, a stale state or any other input (the
    module then runs transformers' own forward). Not traced by ``torch.compile`` (the layout is Python state)."""
    if hooks_live(state) and isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
        return current_layout(state, hidden, who)
    return None


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


def patch(module: torch.nn.Module, attr: str, value: Any, forward: Callable[..., Any],
          children: Mapping[str, Callable[..., Any]] | None = None) -> None:
    """A family's patch on one *instance*: ``value`` (what its forward reads: the configured model's state, a plan)
    under ``attr``, ``forward`` as the instance's own forward (the class's stays untouched), and, for each name of
    ``children``, that submodule's forward too (RWKV's token shift, RecurrentGemma's convolution). Undone by
    :func:`unpatch` with the same ``attr`` and children."""
    module.__dict__[attr] = value
    module.forward = types.MethodType(forward, module)
    for name, child_forward in (children or {}).items():
        child = getattr(module, name)
        child.forward = types.MethodType(child_forward, child)


def unpatch(model: torch.nn.Module, attr: str, children: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> bool:
    """Undo a family's patch on every module of ``model`` that carries ``attr``: the attribute (and the ``extra``
    ones) and the instance's own ``forward`` go — its ``children``'s too —, the class's comes back. False if no
    module carried it."""
    done = False
    for sub in model.modules():
        if attr in sub.__dict__:
            del sub.__dict__[attr]
            sub.__dict__.pop("forward", None)
            for name in extra:
                sub.__dict__.pop(name, None)
            for name in children:
                getattr(sub, name).__dict__.pop("forward", None)
            done = True
    return done
