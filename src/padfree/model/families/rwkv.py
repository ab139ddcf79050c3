"""RWKV (v4) time mixing and channel mixing, restarted at every sequence start.

Both halves of an RWKV block look back: ``RwkvSelfAttention`` (time mixing) and ``RwkvFeedForward`` (channel
mixing) blend every token with the one before it (a *token shift*, ``nn.ZeroPad2d((0, 0, 1, -1))``), and the time
mixing runs the WKV recurrence, a state of three running quantities (numerator, denominator, running max) carried
from token to token. In a packed row both cross the boundary between two sequences. For a packed batch an installed
module runs transformers' own forward with

- its ``time_shift`` giving the first token of every segment the zero a lone sequence's first token gets;
- the WKV recurrence (``rwkv_linear_attention``) replaced by transformers' own recurrence over the time steps
  (``rwkv_linear_attention_cpu``, the same operations in the same dtypes) whose state is set back to its initial
  value — ``(0, 0, -1e38)`` — at every segment start (:func:`segment_wkv`).

Ordinary batches and generation with a state run transformers' code (and its CUDA kernel) untouched; a packed batch
with a state is refused.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> k, v = torch.zeros(1, 5, 1), torch.arange(1.0, 6.0).view(1, 5, 1)
>>> out = segment_wkv(torch.zeros(1), torch.zeros(1), k, v, lay)  # a decayed mean of the values so far
>>> [round(x, 3) for x in out.flatten().tolist()]  # the fourth token starts afresh: it sees only itself
[1.0, 1.5, 2.267, 4.0, 4.5]
"""

from __future__ import annotations

import functools
import sys
from contextvars import ContextVar
from typing import Any

import torch

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import guards, rebind
from padfree.model.families.rglru import segment_positions
from padfree.model.packed import PackedLayout
from padfree.model.state import layout_if_packed, patch, unpatch

CLASSES: dict[str, str] = {
    "RwkvSelfAttention": "time mixing: token shift and WKV state restarted at every sequence start",
    "RwkvFeedForward": "channel mixing: token shift restarted at every sequence start",
}

_LAYOUT: ContextVar[PackedLayout | None] = ContextVar("padfree_rwkv_layout", default=None)


def _starts(lay: PackedLayout) -> torch.Tensor:
    """``(B, T) bool``: the first token of every segment."""
    return lay.memo(("padfree.rwkv", "starts"), lambda: segment_positions(lay) == 0)


def segment_wkv(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                lay: PackedLayout) -> torch.Tensor:
    """RWKV-4's WKV recurrence with its state restarted at every segment: the exact torch reference.

    Args:
        time_decay, time_first: ``(H,)`` — the module's parameters (the decay is ``-exp(time_decay)``).
        key, value: ``(B, T, H)``.
        lay: the batch's layout.

    Returns:
        ``(B, T, H)`` in ``key``'s dtype: transformers' ``rwkv_linear_attention_cpu`` step for step, with the
        numerator, denominator and running max set back to their initial ``(0, 0, -1e38)`` at every segment start
        — exactly the state a lone sequence's first token sees.
    """
    num_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
    den_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
    max_state = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
    fresh = (num_state, den_state, max_state)
    time_decay = -torch.exp(time_decay)
    outs = []
    # transformers' recurrence, one step per token (its own CPU path loops the same way), on unbound slices: writing
    # output[:, t] as it does would make autograd carry a full-size gradient per step (quadratic in the length)
    steps = zip(key.unbind(1), value.unbind(1), _starts(lay).unbind(1), strict=True)
    for t, (current_key, current_value, start) in enumerate(steps):
        if t:  # the first column always starts a segment, and the state is fresh there already
            start = start[:, None]
            num_state, den_state, max_state = (torch.where(start, f, s) for f, s in zip(
                fresh, (num_state, den_state, max_state), strict=True))
        current_key = current_key.float()
        max_for_output = torch.maximum(max_state, current_key + time_first)
        e1 = torch.exp(max_state - max_for_output)
        e2 = torch.exp(current_key + time_first - max_for_output)
        numerator = e1 * num_state + e2 * current_value
        denominator = e1 * den_state + e2
        outs.append((numerator / denominator).to(key.dtype))
        max_for_state = torch.maximum(max_state + time_decay, current_key)
        e1 = torch.exp(max_state + time_decay - max_for_state)
        e2 = torch.exp(current_key - max_for_state)
        num_state = e1 * num_state + e2 * current_value
        den_state = e1 * den_state + e2
        max_state = max_for_state
    return torch.stack(outs, dim=1)


def _current(what: str) -> PackedLayout:
    lay = _LAYOUT.get()
    if lay is None:  # only reachable if someone calls a rebound forward by hand
        raise PackingDisabledError(f"{what} ran for a packed batch outside a configured RWKV module's forward")
    return lay


@torch.compiler.disable  # host-side boundaries (see padfree.model.rebind)
def _packed_wkv(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                state: Any = None, return_state: bool = False) -> tuple[torch.Tensor, None]:
    if state is not None or return_state:
        raise PackingDisabledError("a packed batch reached RWKV's WKV recurrence with a state; packed training never "
                                   "uses a cache (pass use_cache=False)")
    return segment_wkv(time_decay, time_first, key, value, _current("rwkv_linear_attention")), None


def _shift_forward(self: torch.nn.ZeroPad2d, hidden: torch.Tensor) -> torch.Tensor:
    """Installed as ``time_shift.forward``: the previous token, and a zero at every segment start when packed."""
    shifted = type(self).forward(self, hidden)
    lay = _LAYOUT.get()
    return shifted if lay is None else shifted.masked_fill(_starts(lay).unsqueeze(-1), 0.0)


@functools.cache
def _packed_forward(cls: type) -> Any:
    """``cls.forward`` with ``rwkv_linear_attention`` resolved to :func:`_packed_wkv` (time mixing), or the class's
    own forward (channel mixing: its token shift is the instance's ``time_shift``)."""
    forward = cls.forward
    used = rebind.globals_used(forward)
    expected = {"rwkv_linear_attention", "tuple"} if cls.__name__ == "RwkvSelfAttention" else {"torch"}
    if used != expected or rebind.globals_used(getattr(cls, "extract_key_value", forward)) != {"torch"}:
        raise UnsupportedModelError(
            f"{cls.__name__}.forward calls {sorted(used)}, not the {sorted(expected)} padfree proved exact; it "
            f"cannot be made packing-exact until it is proven again")
    if "rwkv_linear_attention" not in used:
        return forward
    scope = dict(sys.modules[forward.__module__].__dict__)
    scope["rwkv_linear_attention"] = _packed_wkv
    return rebind.rebind(forward, scope)


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as the module's ``forward``: transformers' forward, restarted at segment starts when packed."""
    hidden = args[0] if args else kwargs.get("hidden")
    lay = layout_if_packed(self._padfree_rwkv, hidden, type(self).__name__)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    named = guards.bind(type(self).forward, (self, *args), kwargs) or {}
    cache = guards.find_cache({k: v for k, v in named.items() if v is not self}, type(self).forward)
    if cache is not None or named.get("use_cache"):
        raise PackingDisabledError(f"{type(self).__name__} got {cache or 'use_cache=True'} with a packed batch; packed "
                                   f"training never uses a cache (pass use_cache=False)")
    token = _LAYOUT.set(lay)
    try:
        return _packed_forward(type(self))(self, *args, **kwargs)
    finally:
        _LAYOUT.reset(token)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one RWKV time-mixing or channel-mixing instance boundary-exact for packed batches of the model ``state``
    belongs to (see the module docstring); returns what runs for them. Idempotent."""
    name = type(module).__name__
    if name not in CLASSES:
        raise UnsupportedModelError(f"{name} is not an RWKV module padfree knows how to make packing-exact")
    shift = getattr(module, "time_shift", None)
    if not isinstance(shift, torch.nn.ZeroPad2d) or tuple(shift.padding) != (0, 0, 1, -1):
        raise UnsupportedModelError(f"{name}.time_shift is not the one-token shift nn.ZeroPad2d((0, 0, 1, -1)) padfree "
                                    f"proved exact")
    _packed_forward(type(module))  # refuses a forward of another shape now, not at the first packed batch
    patch(module, "_padfree_rwkv", state, _forward, {"time_shift": _shift_forward})
    if name == "RwkvSelfAttention":
        return ("RWKV time mixing: token shift zeroed at segment starts; WKV: transformers' recurrence over the "
                "tokens (its CPU path), state restarted at segment starts")
    return "RWKV channel mixing: token shift zeroed at segment starts"


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_rwkv", children=("time_shift",))
