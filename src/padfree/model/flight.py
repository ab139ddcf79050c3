"""Where a forward's boundaries live: the layout of each forward of a configured model, bound to that forward.

The model's hook reads a forward's boundaries from the call's own arguments and *enters* them for the length of the
call; modules that are not handed keyword arguments (sequence mixers, the attention of decoder layers that drop
their kwargs) read them with :func:`layout_in_flight`. Nothing is left behind when the forward returns, so no later
forward can read it, and two configured models (a policy and its reference) each read their own.

Activation checkpointing runs a layer again during backward, after its forward returned and other forwards of the
same model may have run. So every checkpointed layer call carries the frames it was made under, and the recompute
re-enters exactly those:

- transformers' own checkpointing (``gradient_checkpointing_enable``, both ``use_reentrant`` modes): the layers'
  checkpoint function is wrapped (:func:`bind_checkpoints`) so that the function it saves re-enters the frames of the
  call that saved it;
- a checkpoint around a layer module (``torch.utils.checkpoint.checkpoint(layer, ...)``, ``checkpoint_wrapper``):
  the layer's own hooks run again on recompute and find their frame from the layout in the layer's keyword
  arguments, or from the identity of the layer's input tensor, recorded when the layer first ran
  (:func:`layer_hooks`).

A module asked for the layout during backward with no frame of its model (a recompute that neither route could
bind) refuses with :class:`~padfree.errors.PackingDisabledError`; it never reads another forward's boundaries.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> state = object()  # a PackingState, in real use
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 0, 1, 2]]))
>>> with forward_of(state, lay):
...     layout_in_flight(state) is lay
True
>>> layout_in_flight(state) is None
True
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from typing import Any

import torch

from padfree.errors import PackingDisabledError

__all__ = ["LAYER_ATTR", "bind_checkpoints", "enter", "layer_hooks", "layout_in_flight", "leave", "unbind_checkpoints"]


@dataclasses.dataclass(frozen=True, eq=False)
class Frame:
    """One forward of one configured model: its ``state`` and ``layout`` (None: an ordinary, unpacked batch).
    ``unbound``: why a recompute could not be given its forward's layout (reading the frame refuses)."""

    state: Any
    layout: Any
    unbound: str = ""


# the frames in flight, innermost last: a forward nested in another model's (a reference model inside a loss) adds one
_FRAMES: ContextVar[tuple[Frame, ...]] = ContextVar("padfree_frames", default=())


def enter(state: Any, layout: Any, unbound: str = "") -> Token:
    """Enter a frame of ``state``'s model; :func:`leave` with the token when the call ends."""
    return _FRAMES.set((*_FRAMES.get(), Frame(state, layout, unbound)))


def leave(token: Token) -> None:
    _FRAMES.reset(token)


@contextlib.contextmanager
def forward_of(state: Any, layout: Any) -> Iterator[None]:
    """A block run as part of a forward of ``state``'s model with ``layout`` (a module called on its own, as a test
    or a probe would, sees the boundaries the model's hook would have entered)."""
    token = enter(state, layout)
    try:
        yield
    finally:
        leave(token)


def frame_of(state: Any) -> Frame | None:
    """The innermost frame of ``state``'s model in flight (None: no call of that model is running)."""
    for frame in reversed(_FRAMES.get()):
        if frame.state is state:
            return frame
    return None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def layout_in_flight(state: Any, hidden: torch.Tensor | None = None, who: str = "a module") -> Any:
    """The layout of the forward of ``state``'s model that this call belongs to (None: an ordinary batch, or a call
    outside any forward), checked against ``hidden`` (``(B, T, ...)``) when given.

    Raises:
        PackingDisabledError: a recompute during backward that could not be bound to its own forward, or a layout
            whose shape does not match ``hidden``.
    """
    frame = frame_of(state)
    if frame is None:
        if _in_backward():
            frame = Frame(state, None, "no checkpoint function or layer hook of the model saved its forward")
        else:
            return None
    if frame.unbound:
        raise PackingDisabledError(
            f"{who} was recomputed during backward (activation checkpointing) and padfree cannot tell which forward "
            f"it belongs to: {frame.unbound}. Checkpoint whole decoder layers (model.gradient_checkpointing_enable(), "
            f"torch.utils.checkpoint.checkpoint(layer, ...), checkpoint_wrapper) or the whole model, so that the "
            f"recompute carries its forward's boundaries")
    if frame.layout is not None and hidden is not None:
        frame.layout.check_tokens(hidden, who)
    return frame.layout


# ---- transformers' checkpointing: the checkpoint function saves the frames ------------------------------------------


class _Bound:
    """A layer's checkpoint function whose saved function re-enters, on recompute, the frames of the call that saved
    it (in the forward itself they are the frames already in flight)."""

    def __init__(self, checkpoint: Callable) -> None:
        self.checkpoint = checkpoint

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint(functools.partial(_replay, _FRAMES.get(), function), *args, **kwargs)


def _replay(frames: tuple[Frame, ...], function: Callable, *args: Any, **kwargs: Any) -> Any:
    token = _FRAMES.set(frames)
    try:
        return function(*args, **kwargs)
    finally:
        _FRAMES.reset(token)


_CHECKPOINT_FUNC = "_gradient_checkpointing_func"


@torch.compiler.disable
def bind_checkpoints(modules: list[torch.nn.Module]) -> None:
    """Wrap the checkpoint function transformers put on each of ``modules`` (``gradient_checkpointing_enable`` may
    run after configuring, and again later: called at every forward, it wraps what is new)."""
    for module in modules:
        func = module.__dict__.get(_CHECKPOINT_FUNC)
        if func is not None and not isinstance(func, _Bound):
            module.__dict__[_CHECKPOINT_FUNC] = _Bound(func)


def unbind_checkpoints(model: torch.nn.Module) -> None:
    """Give every module of ``model`` its checkpoint function back unwrapped."""
    for module in model.modules():
        func = module.__dict__.get(_CHECKPOINT_FUNC)
        if isinstance(func, _Bound):
            module.__dict__[_CHECKPOINT_FUNC] = func.checkpoint


# ---- a checkpoint around a layer module: its hooks run again ---------------------------------------------------


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


@dataclasses.dataclass(eq=False)
class _Inputs:
    """Layer input -> the frame it was first run under, keyed by the tensor's storage and view (a reentrant
    recompute hands the layer a detached tensor over the same storage), live only while that storage is."""

    entries: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def record(self, t: torch.Tensor, frame: Frame) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        key = self.key(t)
        old = self.entries.get(key)
        if old is not None and not old[0].expired() and old[1].layout is not frame.layout:
            # one tensor, live, fed to the layer by two forwards with different boundaries (the same inputs_embeds
            # passed twice): a recompute could not tell them apart
            frame = Frame(frame.state, None, "the same input tensor entered this layer in two forwards with "
                                             "different boundaries")
        elif len(self.entries) > 4096:
            self.entries = {k: v for k, v in self.entries.items() if not v[0].expired()}
        self.entries[key] = (StorageWeakRef(t.untyped_storage()), frame)

    def find(self, t: torch.Tensor) -> Frame | None:
        hit = self.entries.get(self.key(t))
        return None if hit is None or hit[0].expired() else hit[1]


LAYER_ATTR = "_padfree_layer"


@dataclasses.dataclass(eq=False)
class _Layer:
    """What a decoder layer's hooks read from the layer: its model's state, the keyword argument that carries a
    layout, the inputs it ran on, and the frames its pre-hooks entered."""

    state: Any
    layout_kwarg: str
    inputs: _Inputs = dataclasses.field(default_factory=_Inputs)
    tokens: list = dataclasses.field(default_factory=list)

    def __deepcopy__(self, memo: dict) -> _Layer:
        # a copied model's layer: the copy's state, none of the original's inputs or calls in flight
        return _Layer(copy.deepcopy(self.state, memo), self.layout_kwarg)


def layer_hooks(layer: torch.nn.Module, state: Any, layout_kwarg: str) -> list:
    """Hooks on a decoder layer that give it the frame of its forward whenever it runs: in the forward, the frame in
    flight (recorded against the layer's input); in a recompute outside any forward, the layout in its keyword
    arguments (``layout_kwarg``) or the frame recorded against its input tensor, else a frame that refuses."""
    layer.__dict__[LAYER_ATTR] = _Layer(state, layout_kwarg)
    return [layer.register_forward_pre_hook(_layer_pre_hook, with_kwargs=True),
            layer.register_forward_hook(_layer_post_hook, with_kwargs=True, always_call=True)]


@torch.compiler.disable
def _layer_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    info: _Layer = module.__dict__[LAYER_ATTR]
    frame = frame_of(info.state)
    hidden = _first_tensor(args, kwargs)
    if frame is not None:
        if hidden is not None:
            info.inputs.record(hidden, frame)
        info.tokens.append(_FRAMES.set(_FRAMES.get()))  # nothing new: the post-hook's reset stays balanced
        return
    carried = kwargs.get(info.layout_kwarg)
    found = info.inputs.find(hidden) if hidden is not None else None
    if carried is not None:
        frame = Frame(info.state, carried)
    elif found is not None:
        frame = found
    elif _in_backward():
        frame = Frame(info.state, None, f"{type(module).__name__} was recomputed with an input it never ran on")
    else:
        frame = Frame(info.state, None)  # called on its own, outside any forward: an ordinary batch
    info.tokens.append(_FRAMES.set((*_FRAMES.get(), frame)))


@torch.compiler.disable
def _layer_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    info: _Layer = module.__dict__[LAYER_ATTR]
    if info.tokens:
        _FRAMES.reset(info.tokens.pop())
