"""Linear-attention mixers built from the primitives :mod:`padfree.model.mixers` already makes boundary-exact.

Some hybrids carry a GatedDeltaNet under their own name (LaraMini's ``LaraMiniGatedDeltaNet`` is Qwen3.5's, calling
the same ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``). This family installs mixers.py's machinery on
them unchanged: transformers' own forward for an ordinary batch; for a packed one the same forward with its
convolution restarting at every segment and its delta rule starting every segment from a zero state. The installer
it uses, :func:`install_mixer` with :func:`packed_forward`, is shared by the other linear-attention families
(:mod:`padfree.model.families.kda`).

>>> from padfree.model import mixers
>>> from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Gdn
>>> family = mixers.FAMILIES["gated-delta-net"]
>>> inner = mixers.unwrap_function(packed_forward(Gdn, family.replace, family.signatures, family.required))
>>> inner.__code__ is mixers.unwrap_function(Gdn.forward).__code__  # transformers' own code ...
True
>>> inner.__globals__["torch_chunk_gated_delta_rule"] is family.replace["torch_chunk_gated_delta_rule"]  # new calls
True
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import UnsupportedModelError
from padfree.model import mixers, versions

__all__ = ["CLASSES", "SEQUENCE_PARALLEL", "install", "install_mixer", "packed_forward", "sharding_problem",
           "uninstall"]

#: transformers class name -> the mixers.py family whose primitives its forward calls
_GDN_CLASSES = {"LaraMiniGatedDeltaNet": "gated-delta-net"}

#: the classes this module makes boundary-exact (read by :func:`padfree.configure_packing`)
CLASSES: dict[str, str] = {
    "LaraMiniGatedDeltaNet": "GatedDeltaNet (Qwen3.5's): conv taps and delta-rule state reset at every segment start",
}


#: the classes that also run split across a sequence-parallel group: their token mixing is mixers.py's primitives
SEQUENCE_PARALLEL = frozenset(_GDN_CLASSES)


def sharding_problem(module: torch.nn.Module, size: int) -> str | None:
    """Why ``module`` cannot be split across ``size`` ranks (None: it can), as :func:`mixers.sharding_problem`."""
    return mixers.sharding_problem(module, size, _GDN_CLASSES[type(module).__name__])


def packed_forward(cls: type, replace: Mapping[str, Callable], signatures: Mapping[str, tuple[str, ...]],
                   required: tuple[str, ...]) -> Callable:
    """``cls.forward`` with the global functions named in ``replace`` swapped for boundary-exact ones.

    The same code runs, nothing shared is mutated (see mixers.py). Refused (:class:`UnsupportedModelError`) when the
    forward does not call every primitive of ``required``, calls a global function that is neither replaced nor a
    per-token helper, or when transformers' primitive no longer starts with the parameters of ``signatures``: a
    new transformers version must be proven again before it is trusted.
    """
    forward = cls.forward
    module_globals = sys.modules[mixers.unwrap_function(forward).__module__].__dict__
    used = mixers.globals_used(forward)
    missing = [name for name in required if name not in used]
    classes = {k for k, v in module_globals.items() if isinstance(v, type)}
    unknown = sorted(used - set(replace) - mixers.PER_TOKEN_GLOBALS - classes)
    if missing or unknown:
        raise UnsupportedModelError(
            f"{cls.__name__}.forward (transformers {versions.installed()}) does not have the shape padfree proved "
            f"exact: missing calls {missing}, unknown global functions {unknown}; it cannot be made packing-exact "
            f"until it is proven again")
    for name, params in signatures.items():
        have = tuple(inspect.signature(mixers.unwrap_function(module_globals[name])).parameters)
        if have[:len(params)] != params:
            raise UnsupportedModelError(
                f"{cls.__name__}: transformers' {name} now takes {have}, padfree's boundary-exact replacement "
                f"expects {params}; refusing rather than guessing")
    scope = dict(module_globals)
    scope.update(replace)
    return mixers.rebind(forward, scope)


def install_mixer(module: torch.nn.Module, state: Any, *, kind: str, family: Any, packed: Callable,
                  description: str, conv_kernel: bool = False, scan_kernel: bool = False) -> str:
    """Patch one mixer instance the way :func:`padfree.model.mixers.install` does, with a forward built here.

    ``module.forward`` becomes mixers.py's dispatcher: transformers' forward for an ordinary batch; for a packed
    one the cache guard, then ``packed`` with the batch's layout in flight for the packed primitives to read.
    ``kind`` names a mixers.py family only when its kernels may be switched on (their fallback rewrites the report
    through that family); a family defined elsewhere runs its exact references. Returns ``description``.
    """
    on_cuda = any(p.is_cuda for p in module.parameters())
    module._padfree_mixer = mixers.Mixer(
        state=state, packed=packed, kind=kind, family=family, use_conv_kernel=conv_kernel,
        use_scan_kernel=scan_kernel, formulation="auto", description=description, on_cuda=on_cuda,
        owner=type(module).__name__)
    module.forward = types.MethodType(mixers.mixer_forward, module)
    return description


@functools.cache
def _gdn_forward(cls: type) -> Callable:
    family = mixers.FAMILIES[_GDN_CLASSES[cls.__name__]]
    return packed_forward(cls, family.replace, family.signatures, family.required)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one mixer instance of :data:`CLASSES` boundary-exact for packed batches of the model ``state`` belongs
    to: mixers.py's GatedDeltaNet primitives, its kernels on CUDA when usable; returns the implementation chosen."""
    name = type(module).__name__
    if name not in _GDN_CLASSES:
        raise UnsupportedModelError(f"{name} is not a linear-attention mixer padfree knows how to make packing-exact")
    key = _GDN_CLASSES[name]
    packed = _gdn_forward(type(module))
    on_cuda = any(p.is_cuda for p in module.parameters())
    conv_on, scan_on, description = mixers.describe_mixer(key, "auto", on_cuda)
    return install_mixer(module, state, kind=key, family=mixers.FAMILIES[key], packed=packed,
                         description=description, conv_kernel=conv_on, scan_kernel=scan_on)


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` (and :func:`install_mixer`) on every module of ``model``; False if nothing was."""
    return mixers.uninstall(model)
