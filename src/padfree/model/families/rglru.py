"""RecurrentGemma's recurrent block (Griffin / Hawk), restarted at every sequence start.

``RecurrentGemmaRecurrentBlock`` runs a depthwise causal ``conv_1d`` of ``conv1d_width`` taps and then the RG-LRU, a
gated linear recurrence over the tokens. In a packed row the convolution reads the last tokens of the previous
sequence, and the recurrence carries its state into the next one. For a packed batch an installed block runs
transformers' own forward with

- its ``conv_1d`` computing the same depthwise convolution restarted from a zero history at every segment
  (:func:`padfree.model.scans.segment_causal_conv1d`: one ``F.conv1d``, as ``nn.Conv1d`` runs it);
- the RG-LRU given the positions inside each segment: it resets where a position is 0 — it multiplies the carried
  state by 0 and skips the input normalisation there, exactly what the first token of a lone sequence gets —
  so transformers' own recurrence (its loop over time steps) runs unchanged.

Ordinary batches and generation with a cache run transformers' code untouched; a packed batch with a cache is
refused.

>>> import torch
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> segment_positions(lay).tolist()  # what the RG-LRU is given: it resets where this is 0
[[0, 1, 2, 0, 1]]
>>> x = torch.arange(1.0, 6.0).view(1, 1, 5)  # (batch, channels, tokens)
>>> conv = torch.nn.Conv1d(1, 1, kernel_size=2, groups=1, padding=1, bias=False)
>>> with torch.no_grad():
...     _ = conv.weight.fill_(1.0)
...     segment_conv(x, conv.weight, None, lay).tolist()  # x[t-1] + x[t] inside a segment
[[[1.0, 3.0, 5.0, 4.0, 9.0]]]
"""

from __future__ import annotations

import inspect
import re
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import guards
from padfree.model.packed import PackedLayout
from padfree.model.scans import segment_causal_conv1d
from padfree.model.state import layout_if_packed, patch, unpatch

__all__ = ["segment_positions"]

CLASSES: dict[str, str] = {
    "RecurrentGemmaRecurrentBlock": "temporal conv1d restarted and RG-LRU state reset at every sequence start",
}

_DESCRIPTION = ("RG-LRU: transformers' recurrence reset where the segment position is 0; conv: exact torch conv, "
                "taps reset at segment starts")

_LAYOUT: ContextVar[PackedLayout | None] = ContextVar("padfree_rglru_layout", default=None)


def segment_positions(lay: PackedLayout) -> torch.Tensor:
    """``(B, T) int64``: every token's index inside its segment (a padding run counts as a segment of its own).

    >>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    >>> segment_positions(lay).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    def build() -> torch.Tensor:
        lengths = lay.lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        pos = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        return torch.from_numpy(pos).to(lay.device).view(lay.shape)
    return lay.memo(("padfree.rglru", "positions"), build)


# The shape of transformers' code this family relies on, checked at install: a new release that computes the reset
# or runs the convolution some other way must be proven again before it is trusted.
_BLOCK_CONV = re.compile(r"x_branch = self\.conv_1d\(x_branch\)\[\.\.\., :seq_len\]")
_LRU_RESET = re.compile(r"reset = position_ids\[:, :, None\] == 0")


def _check(block: torch.nn.Module) -> None:
    name = type(block).__name__
    conv, lru = getattr(block, "conv_1d", None), getattr(block, "rg_lru", None)
    if not isinstance(conv, torch.nn.Conv1d) or lru is None:
        raise UnsupportedModelError(f"{name} has no depthwise conv_1d and rg_lru; padfree cannot make it exact")
    width = conv.kernel_size[0]
    if (conv.groups != conv.in_channels or conv.out_channels != conv.in_channels or conv.padding != (width - 1,)
            or conv.stride != (1,) or conv.dilation != (1,)):
        raise UnsupportedModelError(f"{name}.conv_1d is not a depthwise causal convolution (groups={conv.groups}, "
                                    f"padding={conv.padding}, stride={conv.stride}, dilation={conv.dilation})")
    try:
        block_src, lru_src = inspect.getsource(type(block).forward), inspect.getsource(type(lru).forward)
    except (OSError, TypeError) as exc:
        raise UnsupportedModelError(f"{name}: the source of its forward cannot be read ({exc})") from exc
    if not _BLOCK_CONV.search(block_src) or not _LRU_RESET.search(lru_src):
        raise UnsupportedModelError(
            f"{name}.forward (or {type(lru).__name__}.forward) no longer runs conv_1d over the whole sequence and "
            f"resets the recurrence where position_ids == 0, the shape padfree proved exact")


def _conv_forward(self: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Installed as ``conv_1d.forward``: restarted at segment starts inside a packed block call, else nn.Conv1d."""
    lay = _LAYOUT.get()
    if lay is None:
        return type(self).forward(self, x)
    return segment_conv(x, self.weight, self.bias, lay)


@torch.compiler.disable  # host-side boundaries (see padfree.model.rebind)
def segment_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lay: PackedLayout
                  ) -> torch.Tensor:
    # (B, C, T); the block keeps [..., :seq_len] of it, which is all of it
    return segment_causal_conv1d(x, weight[:, 0, :], bias, None, lay)


def _block_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as the block's ``forward``: transformers' forward, with the boundaries for a packed batch."""
    hidden = args[0] if args else kwargs.get("input_states")
    lay = layout_if_packed(self._padfree_rglru, hidden, type(self).__name__)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    named = guards.bind(type(self).forward, (self, *args), kwargs)
    if named is None:  # a call that does not fit the signature: let transformers raise its own error
        return type(self).forward(self, *args, **kwargs)
    named = {k: v for k, v in named.items() if v is not self}
    cache = guards.find_cache(named, type(self).forward)
    if cache is not None or named.get("use_cache"):
        raise PackingDisabledError(f"{type(self).__name__} got {cache or 'use_cache=True'} with a packed batch; packed "
                                   f"training never uses a cache (pass use_cache=False)")
    # the recurrence resets where the position is 0: the positions inside each segment, whatever the caller sent
    named.update(position_ids=segment_positions(lay), use_cache=False)
    token = _LAYOUT.set(lay)
    try:
        return type(self).forward(self, **named)
    finally:
        _LAYOUT.reset(token)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one ``RecurrentGemmaRecurrentBlock`` boundary-exact for packed batches of the model ``state`` belongs to
    (see the module docstring); returns what runs for them. Idempotent."""
    if type(module).__name__ not in CLASSES:
        raise UnsupportedModelError(f"{type(module).__name__} is not a recurrent block padfree knows how to make "
                                    f"packing-exact")
    _check(module)
    patch(module, "_padfree_rglru", state, _block_forward, {"conv_1d": _conv_forward})
    return _DESCRIPTION


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_rglru", children=("conv_1d",))
