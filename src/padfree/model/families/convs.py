"""Short causal convolutions of newer hybrids, restarted at every sequence start: LFM3, Inkling, Inkling2, Zamba.

LFM3's ``Lfm3ShortConv``, Inkling's ``InklingShortConvolution`` and Inkling2's ``*ShortConvolution`` (on keys, values
and after every attention and MLP block) mix each token with the ``K - 1`` tokens before it; Zamba's
``ZambaMambaMixer`` is a short convolution followed by per-head Mamba-1 selective scans. In a packed row all of them
read across the boundary between two sequences. For a packed batch each installed instance runs transformers' own
forward with its sequence primitives swapped for boundary-exact ones (the references of
:mod:`padfree.model.mixers`): ``causal_conv1d_fn`` restarts from a zero history at every segment and
``mamba_selective_scan`` zeroes the state's decay there. Inkling2's *dynamic* short convolution already masks its
windows by a ``seq_idx`` argument; a packed batch hands it the layout's. Ordinary batches, and generation with a
cache, run transformers' code untouched; a packed batch that brings a cache is refused.

>>> import torch, transformers
>>> from padfree.model.install import install_packing  # configure_packing's machinery, no support table
>>> cfg = transformers.Lfm3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                               num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
...                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
>>> model = transformers.Lfm3ForCausalLM(cfg).eval()
>>> report = install_packing(model)
>>> report.mixers["model.layers.0.conv"]
'short convolution: exact torch conv, taps reset at segment starts'
>>> packed = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]])).logits
>>> alone = model(input_ids=torch.tensor([[8, 9]])).logits
>>> bool(torch.allclose(packed[0, 3:], alone[0], atol=1e-5))
True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import guards, mixers, scans
from padfree.model.packed import PackedLayout
from padfree.model.sharded import ShardedLayout, conv_window, selective_scan_channels
from padfree.model.state import current_layout, hooks_live, unpatch

__all__ = ["CLASSES", "SEQUENCE_PARALLEL", "install", "sharding_problem", "uninstall"]

# class name -> the mixers.py family whose primitives its forward calls (checked at install: see _packed_forward)
_REBOUND: dict[str, str] = {
    "Lfm3ShortConv": "short-conv",
    "InklingShortConvolution": "short-conv",
    "Inkling2ShortConvolution": "short-conv",
    "Inkling2LoopShortConvolution": "short-conv",
    "ZambaMambaMixer": "mamba",
}
# classes whose own forward restarts its windows at every change of a ``seq_idx`` keyword argument
_SEQ_IDX = ("Inkling2DynamicShortConvolution", "Inkling2LoopDynamicShortConvolution")

CLASSES: dict[str, str] = {
    **{name: "short causal convolution restarted at every sequence start" for name in _REBOUND},
    "ZambaMambaMixer": "multi-head Mamba-1: short convolution and selective scans restarted at every sequence start",
    **{name: "dynamic short convolution given the layout's seq_idx (its windows stop at sequence starts)"
       for name in _SEQ_IDX},
}

#: the classes that also run split across a sequence-parallel group (their conv reads the taps before the slice,
#: Zamba's scans run this rank's channels over the whole row); Inkling2's dynamic convolutions read seq_idx inside
#: their own forward and have no sharded path
SEQUENCE_PARALLEL = frozenset(_REBOUND)


def sharding_problem(module: torch.nn.Module, size: int) -> str | None:
    """Why ``module`` cannot run split across ``size`` ranks (None: it can): a Mamba head's channels that ``size``
    does not divide (each scan runs one head; the scan checks again on every call)."""
    channels = getattr(module, "mamba_head_dim", None)
    if isinstance(channels, int) and channels % size:
        return (f"{type(module).__name__} has {channels} channels per Mamba head, which sequence parallelism over "
                f"{size} ranks cannot split evenly; use a group size that divides {channels}")
    return None


_LAYOUT: ContextVar[PackedLayout | ShardedLayout | None] = ContextVar("padfree_conv_layout", default=None)


def _current(what: str) -> PackedLayout | ShardedLayout:
    lay = _LAYOUT.get()
    if lay is None:  # only reachable if someone calls a rebound forward by hand
        raise PackingDisabledError(f"{what} ran for a packed batch outside a configured module's forward")
    return lay


# ---- the packed primitives, with transformers' signatures ------------------------------------------------------
# Outside torch.compile's graphs: they read the boundaries on the host (see padfree.model.mixers).


@torch.compiler.disable
def _conv(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          activation: str | None = None, **kwargs: Any) -> torch.Tensor:
    x, lay, cut = conv_window(_current("causal_conv1d_fn"), hidden_states, weight.shape[-1])
    out = scans.segment_causal_conv1d(x, weight, bias, activation, lay)
    return out[..., cut:] if cut else out


@torch.compiler.disable
def _scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
          D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
          delta_softplus: bool = False, return_last_state: bool = False, **kwargs: Any) -> torch.Tensor:
    if return_last_state:
        raise PackingDisabledError("a packed batch reached a Mamba mixer with a cache; packed training never uses a "
                                   "cache (pass use_cache=False)")
    lay = _current("mamba_selective_scan")
    if isinstance(lay, ShardedLayout):  # this rank's channels over the whole row
        hidden_states, dt, A, B, C, D, z, delta_bias = selective_scan_channels(
            lay, "a multi-head Mamba-1 mixer", hidden_states, dt, A, B, C, D, z, delta_bias)
        out = scans.segment_selective_scan(hidden_states, dt, A, B, C, lay.full, D=D, z=z, delta_bias=delta_bias,
                                           delta_softplus=delta_softplus)
        return lay.to_tokens(out, seq_dim=2, head_dim=1)
    return scans.segment_selective_scan(hidden_states, dt, A, B, C, lay, D=D, z=z, delta_bias=delta_bias,
                                        delta_softplus=delta_softplus)


def _no_decode(*args: Any, **kwargs: Any) -> Any:
    raise PackingDisabledError("a packed batch reached a one-token cached decode step; packed training never uses a "
                               "cache (pass use_cache=False)")


def _no_fused_path(*args: Any, **kwargs: Any) -> None:
    return None  # the fused conv+scan kernel takes no boundaries: "unavailable" makes the model run them apart


_REPLACE: dict[str, Callable] = {
    "causal_conv1d_fn": _conv, "causal_conv1d_update": _no_decode, "mamba_selective_scan": _scan,
    "mamba_selective_state_update": _no_decode, "mamba_inner_fn": _no_fused_path,
}


# builtins a forward may use besides mixers' per-token globals: Zamba loops over its Mamba heads with range()
_BUILTINS = frozenset({"range", "enumerate", "zip"})


@functools.cache
def _packed_forward(cls: type) -> Callable:
    """``cls.forward`` resolving its sequence primitives to the packed ones; refuses a forward that calls anything
    else that is not per-token (a new transformers release must be proven again before it is trusted)."""
    family = mixers.FAMILIES[_REBOUND[cls.__name__]]
    forward = cls.forward
    module_globals = sys.modules[mixers.unwrap_function(forward).__module__].__dict__
    used = mixers.globals_used(forward)
    classes = {k for k, v in module_globals.items() if isinstance(v, type)}
    missing = [name for name in family.required if name not in used]
    unknown = sorted(used - set(family.replace) - mixers.PER_TOKEN_GLOBALS - _BUILTINS - classes)
    if missing or unknown:
        raise UnsupportedModelError(
            f"{cls.__name__}.forward does not have the shape padfree proved exact: missing calls {missing}, unknown "
            f"global functions {unknown}; it cannot be made packing-exact until it is proven again")
    for name, params in family.signatures.items():
        have = tuple(inspect.signature(mixers.unwrap_function(module_globals[name])).parameters)
        if have[:len(params)] != params:
            raise UnsupportedModelError(f"{cls.__name__}: transformers' {name} now takes {have}, padfree's "
                                        f"boundary-exact replacement expects {params}; refusing rather than guessing")
    scope = dict(module_globals)
    scope.update({name: _REPLACE[name] for name in family.replace})
    return mixers.rebind(forward, scope)


def _with_seq_idx(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    kwargs["seq_idx"] = _current(type(module).__name__).seq_idx
    return type(module).forward(module, *args, **kwargs)


# ---- installation ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Installed:
    state: Any
    packed: Callable


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, the packed one otherwise."""
    info: _Installed = self._padfree_conv
    hidden = args[0] if args else kwargs.get("hidden_states")
    lay = _layout(info.state, hidden, type(self).__name__)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    named = guards.bind(type(self).forward, (self, *args), kwargs) or {}
    # an int (Inkling2's cache_offset) is never a cache, whatever its parameter is called
    cache = guards.find_cache({k: v for k, v in named.items() if v is not self and not isinstance(v, int)},
                              type(self).forward)
    if cache is not None:
        raise PackingDisabledError(f"{type(self).__name__} got {cache} with a packed batch; packed training never "
                                   f"uses a cache (pass use_cache=False)")
    token = _LAYOUT.set(lay)
    try:
        return info.packed(self, *args, **kwargs)
    finally:
        _LAYOUT.reset(token)


@torch.compiler.disable
def _layout(state: Any, hidden: Any, who: str) -> PackedLayout | ShardedLayout | None:
    if hooks_live(state) and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
        return current_layout(state, hidden, who)
    return None


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one convolution instance boundary-exact for packed batches of the model ``state`` belongs to; returns
    what runs for them. Idempotent (a new ``configure_packing`` rebinds the state)."""
    name = type(module).__name__
    if name in _SEQ_IDX:
        if "seq_idx" not in inspect.getsource(type(module).forward):
            raise UnsupportedModelError(f"{name}.forward no longer reads a seq_idx argument; padfree cannot tell it "
                                        f"where sequences start")
        packed, description = _with_seq_idx, "dynamic short convolution: transformers' own windows, given seq_idx"
    elif name in _REBOUND:
        packed = _packed_forward(type(module))
        key = _REBOUND[name]
        description = ("short convolution: exact torch conv, taps reset at segment starts" if key == "short-conv" else
                       "Mamba-1 (selective scan): exact torch selective scan, decay zeroed at segment starts; conv: "
                       "exact torch conv, taps reset at segment starts")
    else:
        raise UnsupportedModelError(f"{name} is not a convolution padfree knows how to make packing-exact")
    module._padfree_conv = _Installed(state, packed)
    module.forward = types.MethodType(_forward, module)
    return description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_conv")
