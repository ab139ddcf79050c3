"""Inkling2's dynamic short convolutions, handed the layout's ``seq_idx`` so that their windows stop at every
sequence start.

Inkling2's ``*DynamicShortConvolution`` mixes each token with the ``K - 1`` tokens before it through weights computed
per token, and already masks its windows by a ``seq_idx`` argument; in a packed row without one it reads across the
boundary between two sequences. For a packed batch each installed instance runs transformers' own forward with the
layout's ``seq_idx``. Ordinary batches, and generation with a cache, run transformers' code untouched; a packed batch
that brings a cache is refused. (The plain short convolutions of LFM2/3, Inkling and Inkling2, and Zamba's Mamba-1
mixer, run the primitives of :mod:`padfree.model.families.scan_mixers`.)

>>> sorted(CLASSES)
['Inkling2DynamicShortConvolution', 'Inkling2LoopDynamicShortConvolution']
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from padfree.errors import UnsupportedModelError
from padfree.model import rebind

# classes whose own forward restarts its windows at every change of a ``seq_idx`` keyword argument
_SEQ_IDX = ("Inkling2DynamicShortConvolution", "Inkling2LoopDynamicShortConvolution")

#: module class name -> what this family makes exact (read by :func:`padfree.configure_packing`)
CLASSES: dict[str, str] = {
    name: "dynamic short convolution given the layout's seq_idx (its windows stop at sequence starts)"
    for name in _SEQ_IDX}

_DESCRIPTION = "dynamic short convolution: transformers' own windows, given seq_idx"


def _with_seq_idx(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    kwargs["seq_idx"] = rebind.current_call(type(module).__name__).lay.seq_idx
    return type(module).forward(module, *args, **kwargs)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one convolution instance boundary-exact for packed batches of the model ``state`` belongs to; returns
    what runs for them. Idempotent (a new ``configure_packing`` rebinds the state)."""
    name = type(module).__name__
    if name not in _SEQ_IDX:
        raise UnsupportedModelError(f"{name} is not a convolution padfree knows how to make packing-exact")
    if "seq_idx" not in inspect.getsource(type(module).forward):
        raise UnsupportedModelError(f"{name}.forward no longer reads a seq_idx argument; padfree cannot tell it "
                                    f"where sequences start")
    return rebind.install_mixer(module, state, kind="dynamic-conv", packed=_with_seq_idx, description=_DESCRIPTION)


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return rebind.uninstall(model)
