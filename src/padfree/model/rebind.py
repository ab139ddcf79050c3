"""Running transformers' own forward of a module with other sequence primitives: the toolkit of the mixer families.

A recurrent or convolutional mixer (GatedDeltaNet, Mamba, a short convolution, Kimi delta attention, ...) calls a few
module-level functions for its token mixing (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ...); the rest
of its forward — projections, gates, norms — is per token. A family makes such a mixer boundary-exact without
copying its code:

- :func:`packed_forward` builds, once per class, a copy of the class's forward whose globals resolve the named
  primitives to boundary-exact replacements (:func:`rebind`), after checking the forward calls nothing else that
  mixes tokens (a new transformers release must be proven again before it is trusted);
- :func:`install_mixer` patches one *instance*: :func:`mixer_forward` runs transformers' forward for an ordinary
  batch and, for a packed one, the rebound forward with the forward's layout in flight, which the replacements read
  through :func:`current_call`.

Nothing shared is mutated: not the class, not transformers' module globals.

>>> def scale(x):
...     return 2 * x
>>> def forward(x):
...     return scale(x) + 1
>>> sorted(globals_used(forward))
['scale']
>>> rebind(forward, {"scale": lambda x: 10 * x})(1), forward(1)
(11, 3)
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

import torch

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import guards, row_blocks
from padfree.model.packed import PackedLayout
from padfree.model.state import current_layout, hooks_live, patch, unpatch

__all__ = ["Mixer", "Primitives", "current_call", "globals_used", "install_mixer", "no_decode", "no_fused_path",
           "packed_forward", "rebind", "uninstall", "unwrap_function"]

#: global names a mixer's forward may use besides the primitives it has replaced: per-token helpers, modules and
#: builtins (Zamba loops over its Mamba heads with range())
PER_TOKEN_GLOBALS = frozenset({
    "apply_mask_to_padding_states", "torch", "F", "nn", "hasattr", "getattr", "isinstance", "len", "int", "float",
    "min", "max", "tuple", "list", "super", "ACT2FN", "logger", "math", "is_torchdynamo_compiling", "range",
    "enumerate", "zip",
})


def unwrap_function(fn: Callable) -> Callable:
    """The function inside ``fn``'s decorators (``functools.wraps`` chains, followed through ``__wrapped__``)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def globals_used(fn: Callable) -> set[str]:
    """The global names the code of ``fn`` (inside its decorators) loads."""
    return {ins.argval for ins in dis.get_instructions(unwrap_function(fn)) if ins.opname == "LOAD_GLOBAL"}


def rebind(fn: Callable, scope: dict[str, Any]) -> Callable:
    """A copy of ``fn`` (and of the decorator wrappers around it) whose innermost function resolves globals in
    ``scope`` instead of its module: the same code, other primitives, nothing shared mutated."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
        return new
    rebound = rebind(inner, scope)
    cells, swapped = [], False
    for cell in fn.__closure__ or ():
        try:
            hit = cell.cell_contents is inner
        except ValueError:
            hit = False
        cells.append(types.CellType(rebound) if hit else cell)
        swapped |= hit
    if not swapped:
        raise UnsupportedModelError(f"cannot rebuild the decorated forward {fn.__qualname__}: its wrapper does not "
                                    f"hold the wrapped function in a closure")
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    new.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(new, rebound)
    return new


def packed_forward(cls: type, replace: Mapping[str, Callable], signatures: Mapping[str, tuple[str, ...]],
                   required: tuple[str, ...]) -> Callable:
    """``cls.forward`` with the global functions named in ``replace`` swapped for boundary-exact ones.

    Refused (:class:`UnsupportedModelError`) when the forward does not call every primitive of ``required``, calls a
    global function that is neither replaced, a per-token helper (:data:`PER_TOKEN_GLOBALS`) nor a class, or when
    transformers' primitive no longer starts with the parameters of ``signatures``.
    """
    forward = cls.forward
    module_globals = sys.modules[unwrap_function(forward).__module__].__dict__
    used = globals_used(forward)
    missing = [name for name in required if name not in used]
    classes = {k for k, v in module_globals.items() if isinstance(v, type)}
    unknown = sorted(used - set(replace) - PER_TOKEN_GLOBALS - classes)
    if missing or unknown:
        raise UnsupportedModelError(
            f"{cls.__name__}.forward (transformers {guards.installed()}) does not have the shape padfree proved "
            f"exact: missing calls {missing}, unknown global functions {unknown}; it cannot be made packing-exact "
            f"until it is proven again")
    for name, params in signatures.items():
        have = tuple(inspect.signature(unwrap_function(module_globals[name])).parameters)
        if have[:len(params)] != params:
            raise UnsupportedModelError(
                f"{cls.__name__}: transformers' {name} now takes {have}, padfree's boundary-exact replacement "
                f"expects {params}; refusing rather than guessing")
    scope = dict(module_globals)
    scope.update(replace)
    return rebind(forward, scope)


def no_decode(*args: Any, **kwargs: Any) -> Any:
    """The replacement of a one-token cached decode primitive: a packed batch never has a cache."""
    raise PackingDisabledError("a packed batch reached a one-token cached decode step; packed training never uses a "
                               "cache (pass use_cache=False)")


def no_fused_path(*args: Any, **kwargs: Any) -> None:
    """The replacement of a fused conv+scan kernel, which takes no boundaries: "unavailable", so that the model runs
    its unfused path (conv and scan apart, each boundary-exact)."""
    return None


@dataclasses.dataclass(frozen=True)
class Primitives:
    """One kind of mixer: the packed replacement of each sequence primitive its forward may call (``replace``), the
    leading parameter names transformers' primitive must have for the replacement to be a drop-in (``signatures``),
    the primitives its forward must call (``required``), and the optional kernels that may serve its conv and its
    scan (:mod:`padfree.model.cuda_kernels`)."""

    name: str
    replace: dict[str, Callable]
    signatures: dict[str, tuple[str, ...]]
    required: tuple[str, ...]
    conv_kernel: str | None = None
    scan_kernel: str | None = None
    #: the forward is per token outside the primitives and hands its other arguments only to them, so it may run
    #: over blocks of whole segments (:mod:`padfree.model.row_blocks`)
    row_blocks: bool = False


@dataclasses.dataclass(eq=False)
class Mixer:
    """What a patched instance carries: the configured model's state, the packed forward and the choices made."""

    state: Any
    packed: Callable
    kind: str
    family: Primitives | None
    use_conv_kernel: bool
    use_scan_kernel: bool
    formulation: str
    description: str
    on_cuda: bool
    owner: str = "a mixer"
    block_tokens: int = 0  # tokens per block of a long packed row on the CPU (0: the row runs whole)


@dataclasses.dataclass
class _Call:
    lay: Any  # PackedLayout, or a ShardedLayout (a slice of the row on this rank)
    mixer: Mixer


_CALL: ContextVar[_Call | None] = ContextVar("padfree_mixer_call", default=None)


def current_call(what: str) -> _Call:
    """The layout and mixer of the packed mixer forward in flight (read by the replaced primitives)."""
    call = _CALL.get()
    if call is None:  # only reachable if someone calls the rebound forward by hand
        raise PackingDisabledError(f"{what} ran for a packed batch outside a configured mixer's forward")
    return call


# an ordinary batch's boundary arguments, which describe nothing to reset (see mixer_forward)
_TRIVIAL_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


# Outside torch.compile's graphs: the layout is read on the host, and traced, every new set of lengths would be a
# recompile. The projections around the primitives still compile.
@torch.compiler.disable
def _layout_of(info: Mixer, hidden: Any, who: str) -> tuple[bool, PackedLayout | None]:
    """``(hooks live, layout of the forward in flight or None)`` for one mixer call."""
    live = hooks_live(info.state)
    if live and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
        return live, current_layout(info.state, hidden, who)
    return live, None


def mixer_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, the packed one otherwise."""
    info: Mixer = self._padfree_mixer
    hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_states"))
    live, lay = _layout_of(info, hidden, type(self).__name__)
    if lay is None:
        if live:
            # An ordinary batch (one sequence per row): boundary kwargs a collator sent describe nothing to reset,
            # and transformers' own mixer refuses any of them without its CUDA kernels. Dropping them is exact.
            for key in _TRIVIAL_BOUNDARY_KWARGS:
                kwargs.pop(key, None)
        return type(self).forward(self, *args, **kwargs)
    return run_packed(self, lay, *args, **kwargs)


def run_packed(module: torch.nn.Module, lay: Any, *args: Any, **kwargs: Any) -> Any:
    """Run installed ``module``'s packed forward on ``args`` / ``kwargs`` with ``lay`` (a
    :class:`~padfree.model.packed.PackedLayout` of the batch, or this rank's sharded one) in flight: what
    :func:`mixer_forward` does once it has found the forward's layout. A cache among the arguments is refused. A
    family whose forward may run over blocks of whole segments does so for a long row on the CPU
    (:mod:`padfree.model.row_blocks`)."""
    _refuse_a_cache(module, args, kwargs)
    info: Mixer = module._padfree_mixer
    hidden = args[0] if args else kwargs.get("hidden_states")
    if info.block_tokens and type(lay) is PackedLayout and row_blocks.blockable_call(hidden, args, kwargs):
        if args:
            def block(sub: PackedLayout, x: torch.Tensor) -> Any:
                return _run(module, info, sub, x, *args[1:], **kwargs)
        else:
            def block(sub: PackedLayout, x: torch.Tensor) -> Any:
                return _run(module, info, sub, **{**kwargs, "hidden_states": x})
        out = row_blocks.run_in_blocks(block, hidden, lay, info.block_tokens)
        if out is not None:
            return out
    return _run(module, info, lay, *args, **kwargs)


def _run(module: torch.nn.Module, info: Mixer, lay: Any, *args: Any, **kwargs: Any) -> Any:
    token = _CALL.set(_Call(lay, info))
    try:
        return info.packed(module, *args, **kwargs)
    finally:
        _CALL.reset(token)


# Outside torch.compile's graphs: binding the call to the forward's signature is host-side Python (inspect), which
# dynamo would otherwise trace into every mixer's graph.
@torch.compiler.disable
def _refuse_a_cache(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Raise :class:`~padfree.errors.PackingDisabledError` when a cache is among the arguments of ``module``'s call."""
    named = guards.bind(type(module).forward, (module, *args), kwargs) or {}
    # an int (Inkling2's cache_offset) is never a cache, whatever its parameter is called
    guards.refuse_a_cache(type(module).__name__,
                          {k: v for k, v in named.items() if v is not module and not isinstance(v, int)},
                          type(module).forward)


def install_mixer(module: torch.nn.Module, state: Any, *, kind: str, packed: Callable, description: str,
                  family: Primitives | None = None, conv_kernel: bool = False, scan_kernel: bool = False,
                  formulation: str = "auto") -> str:
    """Patch one mixer instance: ``module.forward`` becomes :func:`mixer_forward`, which runs ``packed`` (a forward
    taking the module first) for a packed batch with the layout in flight. Idempotent (a new ``configure_packing``
    rebinds the state). Returns ``description``."""
    patch(module, "_padfree_mixer", Mixer(
        state=state, packed=packed, kind=kind, family=family, use_conv_kernel=conv_kernel, use_scan_kernel=scan_kernel,
        formulation=formulation, description=description, on_cuda=any(p.is_cuda for p in module.parameters()),
        owner=type(module).__name__,
        block_tokens=row_blocks.block_tokens(module) if family is not None and family.row_blocks else 0),
        mixer_forward)
    return description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install_mixer` on ``model`` and every module inside it; False if nothing was installed."""
    return unpatch(model, "_padfree_mixer")
