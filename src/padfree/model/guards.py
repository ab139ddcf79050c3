"""What must never reach a packed forward — a cache or a dense mask — found by what it is, not by what it is called.

transformers renames arguments between releases (5.24 calls the cache ``cache``; earlier releases called it
``past_key_values`` or ``cache_params``, and still accept those names), so a guard that looks for keyword strings
stops guarding on the day of a release. These checks bind the call to the forward's own signature (positional
arguments included) and look at every value:

- a **cache** is any instance of a transformers class named ``*Cache`` (``DynamicCache``, ``MambaCache``,
  ``xLSTMCache``, ...; their common base :class:`transformers.cache_utils.Cache` included), a legacy tuple of
  per-layer tensors, or anything but ``None`` / a bool in a parameter whose name or annotation says cache;
- a **dense mask** is a tensor shaped ``(B, T, T)`` or ``(B, *, T, T)`` over the batch's tokens, a flex
  ``BlockMask``, or a dict of those (transformers' per-layer-type mask mapping), whatever its name.

>>> import torch, transformers
>>> def forward(input_ids, attention_mask=None, cache=None, **kwargs): ...
>>> named = bind(forward, (torch.zeros(1, 4, dtype=torch.long),), {"past_key_values": transformers.DynamicCache()})
>>> find_cache(named)
'past_key_values=DynamicCache'
>>> find_dense_mask({"mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}, (1, 4))
'mask (a 4-D mask of shape (1, 1, 4, 4))'
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import PackingDisabledError, UnsupportedModelError

__all__ = ["bind", "find_cache", "find_dense_mask", "installed", "is_cache", "parameters", "proven_module",
           "refuse_a_cache"]

# parameter names that announce a cache (``cache``, ``past_key_values``, ``cache_params``, ``layer_past``,
# ``past_key_value``, ``mems``, ``state`` in recurrent models ...); ``use_cache`` and ``cache_position`` are not caches
_CACHE_NAME = re.compile(r"cache|past|^mems$|^state$|_state$|^states$")
_NOT_A_CACHE = frozenset({"use_cache", "cache_position", "return_dict", "output_hidden_states", "hidden_states",
                          "inputs_embeds", "return_last_state", "output_final_state"})


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a cache object: an instance of a transformers class named ``*Cache``, or a legacy
    tuple of per-layer tuples of tensors."""
    for cls in type(value).__mro__:
        if cls.__name__.endswith("Cache") and cls.__module__.split(".")[0] == "transformers":
            return True
    if isinstance(value, (tuple, list)) and value and all(isinstance(layer, (tuple, list)) for layer in value):
        return any(isinstance(t, torch.Tensor) for layer in value for t in layer)
    return False


@functools.lru_cache(maxsize=512)
def _signature(forward: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def parameters(forward: Callable) -> tuple[str, ...]:
    """The parameter names of ``forward`` (empty when it has no inspectable signature)."""
    sig = _signature(forward)
    return () if sig is None else tuple(sig.parameters)


def proven_module(module: Any, family: str, classes: Mapping[str, str],
                  signatures: Mapping[str, tuple[str, ...]]) -> str:
    """``classes[name]`` (the family's description of it) for a ``module`` whose class ``name`` the ``family`` knows
    and whose forward takes exactly the parameters ``signatures[name]`` it was proven with; else
    :class:`~padfree.errors.UnsupportedModelError` naming the class (a release that changes the forward is refused,
    not guessed at)."""
    name = type(module).__name__
    if name not in classes:
        raise UnsupportedModelError(f"{name} is not a module padfree's {family} family knows")
    params = parameters(type(module).forward)
    if params != signatures[name]:
        raise UnsupportedModelError(f"{name}.forward takes {params}, not the {signatures[name]} padfree proved; "
                                    f"refusing rather than guessing")
    return classes[name]


def bind(forward: Callable, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Every argument of the call ``forward(*args, **kwargs)`` by parameter name (``**kwargs`` flattened in); None
    when the call does not fit the signature (the forward then raises its own error)."""
    sig = _signature(forward)
    if sig is None:
        return None if args else dict(kwargs)
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:
        return None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        else:
            named[name] = value
    return named


def _cache_parameter(forward: Callable | None, name: str) -> bool:
    if name in _NOT_A_CACHE:
        return False
    if _CACHE_NAME.search(name):
        return True
    sig = _signature(forward) if forward is not None else None
    if sig is None or name not in sig.parameters:
        return False
    annotation = sig.parameters[name].annotation
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return "Cache" in text


def find_cache(named: dict[str, Any], forward: Callable | None = None) -> str | None:
    """``"name=DynamicCache"`` for the first argument of ``named`` that carries a cache, else None."""
    for name, value in named.items():
        if value is None or isinstance(value, (bool, int, float, str)):  # a flag or an offset, never a cache
            continue
        if is_cache(value) or _cache_parameter(forward, name):
            return f"{name}={type(value).__name__}"
    return None


def refuse_a_cache(who: str, named: dict[str, Any], forward: Callable | None = None) -> None:
    """:class:`~padfree.errors.PackingDisabledError` naming ``who`` when an argument of ``named`` carries a cache
    (:func:`find_cache`): packed training never uses one."""
    cache = find_cache(named, forward)
    if cache is not None:
        raise PackingDisabledError(f"{who} got {cache} with a packed batch; packed training never uses a cache (pass "
                                   f"use_cache=False)")


def _dense(value: Any, shape: tuple[int, int]) -> str | None:
    batch, seq_len = shape
    if isinstance(value, torch.Tensor):
        if value.dim() in (3, 4) and tuple(value.shape[-2:]) == (seq_len, seq_len) and value.shape[0] in (1, batch):
            return f"a {value.dim()}-D mask of shape {tuple(value.shape)}"
        return None
    if type(value).__name__ == "BlockMask":
        return "a flex_attention BlockMask"
    if isinstance(value, dict):
        for key, item in value.items():
            what = _dense(item, shape)
            if what is not None:
                return f"a mask mapping whose {key!r} entry is {what}"
    return None


# arguments that carry the tokens' (or images') data, never a mask
_TOKEN_DATA = frozenset({"inputs_embeds", "hidden_states", "per_layer_inputs", "encoder_hidden_states"})


def find_dense_mask(named: dict[str, Any], shape: tuple[int, int]) -> str | None:
    """``"name (what)"`` for the first argument of ``named`` that is a dense attention mask over a ``(B, T)``
    batch (a ``(B, [H,] T, T)`` tensor, a ``BlockMask``, or a dict of them), else None."""
    for name, value in named.items():
        if name in _TOKEN_DATA or name.endswith("_embeds") or name.startswith("pixel_values"):
            continue  # token data, (B, T, hidden): a mask only in shape when the hidden size equals the row width
        what = _dense(value, shape)
        if what is not None:
            return f"{name} ({what})"
    return None


def installed(package: str = "transformers") -> str:
    """The installed version of ``package`` (``"?"`` when it cannot be read): refusals name the release whose code
    they found."""
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # pragma: no cover - a package without metadata
        return "?"
