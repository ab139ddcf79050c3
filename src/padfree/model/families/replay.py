"""The replay engine of the families that run a module's own forward once per group of the sequences of a packed row.

A family that cannot rebind a module to boundary-exact primitives (:mod:`padfree.model.families.attention_variants`,
:mod:`padfree.model.families.alibi`, :mod:`padfree.model.families.indexers`) runs **the module's own forward** once
per group of sequences (:func:`padfree.model.packed.per_bucket`), each sequence a row of its own, with the inputs that
sequence has alone. A family describes one module class by a :class:`Plan` — what to gather per sequence, what to cut,
how to stitch the outputs' other entries back — and leaves the rest here: binding the call, the refusals (a cache, a
RoPE that rescales by the longest position of a call, an argument padfree cannot cut), the cuts, the run per group and
the instance patch (:func:`check`, :func:`record`; :func:`padfree.model.state.unpatch` undoes it).

The inputs of one group. The model built them for rows without boundaries (the configured model's hook dropped them
above the module): positions ``0 .. T-1`` in every row, no padding. A sequence of ``n`` tokens alone gets the same
values at its ``n`` positions, so a group of ``m`` slots of ``L`` tokens takes the first ``L`` of the first row —
sliced, never recomputed, so the dtypes and the arithmetic are the model's own. Every cut is a function
``(L, m) -> value``:

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> cos = torch.arange(5.0).view(1, 5, 1)  # a (B | 1, T, D) rotary table of the row
>>> cut_table({"full": (cos, cos)}, lay, "position_embeddings", "Attention")(2, 3)["full"][0][..., 0].tolist()
[[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]
>>> cut_mask(torch.zeros(1, 1, 5, 5), lay, "Attention")(3, 2).shape
torch.Size([2, 1, 3, 3])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from padfree.errors import InvalidLayoutError, PackingDisabledError, UnsupportedModelError
from padfree.model import guards
from padfree.model.packed import PackedLayout, per_bucket
from padfree.model.state import current_layout, hooks_live, patch

__all__ = ["Plan", "check", "cut_mask", "record", "run", "shared"]

# stitches the per-group values of one entry of the forward's output (in the order of ``lay.buckets(by)``) into the
# row's: (values, lay, by) -> value
_Stitch = Callable[[list[Any], PackedLayout, str], Any]


def shared(values: list[Any], lay: PackedLayout, by: str) -> Any:
    """The default stitch of an output entry: the one object every group returns (a bias parameter, None) is kept;
    anything else (per-group attention weights, which have no ``(B, H, T, T)`` form) is None."""
    return values[0] if all(v is values[0] for v in values) else None


@dataclasses.dataclass(eq=False)
class Plan:
    """What a patched instance carries: how its forward runs per group of packed sequences.

    The forward's first parameter (after ``self``) is the ``(B, T, ...)`` hidden state, gathered per group.
    Arguments named ``attention_mask`` (``(B | 1, ..., T, T)``), ``position_ids`` (``(B | 1, T)``) and
    ``position_embeddings`` (a ``(B | 1, T, ...)`` table, or a tuple / list / dict of them) are cut to the group's
    first ``L`` positions; ``None``, switches and sizes (bools, numbers, strings, dtypes) pass unchanged; any other
    argument is refused at the call (padfree does not guess what a sequence alone gets for it).

    Attributes:
        state: the configured model's :class:`~padfree.model.state.PackingState`.
        hidden: the name of the forward's first parameter.
        by: the grouping (:meth:`~padfree.model.packed.PackedLayout.buckets`): ``"bucket"``; ``"length"`` where the
            forward depends on a sequence's exact length; ``"sequence"`` where it mixes the rows of a batch.
        tokens: further ``(B, T, ...)`` per-token arguments, gathered like the hidden state; refused when missing.
        optional: per-token arguments that may be None or missing (then left to the forward's default).
        heads: ``(B·H, 1, T)`` or ``(B, H, 1, T)`` per-key biases (ALiBi): each group gets the first ``L`` keys of
            the first row's.
        same: position-free tensors, handed over unchanged.
        stitch: output index -> ``(values, lay, by) -> value``, which stitches the per-group values of that entry of
            the output (groups in the order of ``lay.buckets(by)``) into the row's; :func:`shared` for the others.
    """

    state: Any
    hidden: str
    by: str = "bucket"
    tokens: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    same: tuple[str, ...] = ()
    stitch: Mapping[int, _Stitch] = dataclasses.field(default_factory=dict)


# ---- installation ------------------------------------------------------------------------------------------------


def check(module: torch.nn.Module, state: Any, needed: Sequence[str], reads: str, receives: str) -> str:
    """The refusals of an install; returns the name of the forward's first parameter (the hidden state).

    ``reads`` says what the module reads of the row (the groups are cut from it), ``receives`` what padfree's
    attention backends get instead, for the refusal of a model that has both."""
    name = type(module).__name__
    if state.backend != "none":
        # the model's hook then sits on the decoder and hands restarting position_ids down: the per-position inputs
        # of the row would no longer be those of positions 0 .. T-1, which the groups are cut from
        raise UnsupportedModelError(
            f"{name} runs per sequence on {reads}, but this model also has attention layers on padfree's "
            f"{state.backend} backend, which receive {receives}; padfree proved {name} only in models whose "
            f"attention it runs per sequence throughout")
    params = guards.parameters(type(module).forward)
    missing = [arg for arg in needed if arg not in params]
    if len(params) < 2 or missing:
        raise UnsupportedModelError(f"{name}.forward takes {params}, not the arguments padfree proved ({missing} "
                                    f"missing); refusing rather than guessing")
    return params[1]


def record(module: torch.nn.Module, attr: str, plan: Plan, forward: Callable[..., Any]) -> None:
    """Patch the instance (never its class): ``plan`` under ``attr``, ``forward`` (which calls :func:`run` with it)
    as its ``forward``. Idempotent; :func:`padfree.model.state.unpatch` with ``attr`` undoes it."""
    patch(module, attr, plan, forward)


def run(module: torch.nn.Module, plan: Plan, args: tuple, kwargs: dict[str, Any]) -> Any:
    """What a patched forward does: transformers' forward for an ordinary batch, one run per group otherwise."""
    hidden = args[0] if args else kwargs.get(plan.hidden)
    lay = None
    if hooks_live(plan.state) and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
        lay = current_layout(plan.state, hidden, type(module).__name__)
    if lay is None:
        return type(module).forward(module, *args, **kwargs)
    return _replay(module, plan, lay, args, kwargs)


# ---- the inputs of one group: the row's, cut to its length -------------------------------------------------------


def cut_rows(value: torch.Tensor, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], torch.Tensor]:
    """A ``(B | 1, T, ...)`` per-position input -> its first ``L`` positions for ``m`` sequences."""
    batch, seq_len = lay.shape
    if value.dim() < 2 or value.shape[1] != seq_len or value.shape[0] not in (1, batch):
        raise PackingDisabledError(f"{who} got {name} of shape {tuple(value.shape)} with a packed batch of {batch} x "
                                   f"{seq_len}; padfree expected one entry per position of a row")
    return lambda n, m: value[:1, :n].expand(m, n, *value.shape[2:])


def cut_table(value: Any, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], Any]:
    """Rotary tables: a tensor, a tuple / list ``(cos, sin)`` or a dict of those per rope type, cut alike."""
    if isinstance(value, torch.Tensor):
        return cut_rows(value, lay, name, who)
    if isinstance(value, Mapping):
        cuts = {key: cut_table(item, lay, f"{name}[{key!r}]", who) for key, item in value.items()}
        return lambda n, m: {key: cut(n, m) for key, cut in cuts.items()}
    if isinstance(value, (tuple, list)):
        parts = [cut_table(item, lay, name, who) for item in value]
        return lambda n, m: type(value)(cut(n, m) for cut in parts)
    raise PackingDisabledError(f"{who} got {name} ({type(value).__name__}) with a packed batch; padfree expected "
                               f"rotary tables (tensors, tuples or dicts of them)")


def cut_mask(value: torch.Tensor, lay: PackedLayout, who: str) -> Callable[[int, int], torch.Tensor]:
    """The row's ``(B | 1, ..., T, T)`` mask -> its top-left ``L x L`` block: the mask of ``L`` tokens alone
    (causal and sliding-window masks depend on positions only, and every row's positions run ``0 .. T-1``)."""
    batch, seq_len = lay.shape
    if value.dim() < 3 or tuple(value.shape[-2:]) != (seq_len, seq_len) or value.shape[0] not in (1, batch):
        raise PackingDisabledError(f"{who} got an attention_mask of shape {tuple(value.shape)} with a packed batch of "
                                   f"{batch} x {seq_len}; padfree expected the (B, ..., T, T) mask of a row")
    return lambda n, m: value[:1, ..., :n, :n].expand(m, *value.shape[1:-2], n, n)


def cut_heads(value: torch.Tensor, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], torch.Tensor]:
    """A ``(B·H, 1, T)`` or ``(B, H, 1, T)`` per-key bias -> the first ``L`` keys of the first row's, ``m`` times."""
    batch, seq_len = lay.shape
    if value.dim() == 4 and value.shape[0] in (1, batch) and value.shape[-1] == seq_len:  # (B, H, 1, T)
        return lambda n, m: value[:1, ..., :n].repeat(m, 1, 1, 1)
    if value.dim() != 3 or value.shape[0] % batch or value.shape[-1] != seq_len:
        raise PackingDisabledError(f"{who} got {name} of shape {tuple(value.shape)} with a packed batch of "
                                   f"{batch} x {seq_len}; padfree expected a (B * heads, 1, T) or (B, heads, 1, T) "
                                   f"bias")
    heads = value.shape[0] // batch
    return lambda n, m: value[:heads, :, :n].repeat(m, 1, 1)


def _rope_limit(module: torch.nn.Module) -> tuple[str, int] | None:
    """``(rope type, longest row)`` when the module's RoPE rescales its frequencies by the longest position of a
    call (``dynamic``, ``longrope``): the row's table would then not be the table a shorter sequence builds alone."""
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    for entry in (params, *(v for v in params.values() if isinstance(v, dict))):
        kind = entry.get("rope_type")
        if kind in ("dynamic", "longrope"):
            limit = entry.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings", 0)
            return kind, int(limit)
    return None


_PLAIN = (bool, int, float, str, torch.dtype)  # switches and sizes: the same for every sequence


@torch.compiler.disable  # host-side group sizes: traced, every new set of lengths would recompile
def _replay(module: torch.nn.Module, plan: Plan, lay: PackedLayout, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The module's own forward once per group of sequences, with the inputs each sequence has alone."""
    who, forward = type(module).__name__, type(module).forward
    named = guards.bind(forward, (module, *args), kwargs)
    if named is None:  # a call that does not fit: transformers raises its own error; never the row's forward
        forward(module, *args, **kwargs)
        raise TypeError(f"{who}.forward does not accept this call")
    named.pop(next(iter(guards.parameters(forward))), None)
    guards.refuse_a_cache(who, named, forward)
    rope = _rope_limit(module)
    if rope is not None and lay.shape[1] > rope[1]:
        raise PackingDisabledError(
            f"{who} uses {rope[0]} RoPE, which rescales its frequencies by the longest position of a call: a packed "
            f"row of {lay.shape[1]} tokens would rescale the sequences that are shorter than {rope[1]} alone; pack "
            f"rows of at most {rope[1]} tokens")
    if named.get("output_attentions"):
        named["output_attentions"] = False  # per-group weights have no (B, H, T, T) form
    tokens: dict[str, torch.Tensor] = {}
    for name in (plan.hidden, *plan.tokens, *plan.optional):
        value = named.pop(name, None)
        if value is None and name in plan.optional:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != lay.shape:
            raise InvalidLayoutError(f"{who} got {name} of shape {tuple(getattr(value, 'shape', ()))} but the packed "
                                     f"layout of this forward is {lay.shape}")
        tokens[name] = value
    cuts: dict[str, Callable[[int, int], Any]] = {}
    for name, value in list(named.items()):
        if value is None or name in plan.same or isinstance(value, _PLAIN):
            continue
        if name in plan.heads and isinstance(value, torch.Tensor):
            cuts[name] = cut_heads(value, lay, name, who)
        elif name == "attention_mask" and isinstance(value, torch.Tensor):
            cuts[name] = cut_mask(value, lay, who)
        elif name == "position_ids" and isinstance(value, torch.Tensor):
            cuts[name] = cut_rows(value, lay, name, who)
        elif name == "position_embeddings":
            cuts[name] = cut_table(value, lay, name, who)
        else:  # e.g. a flex BlockMask of the row: what a sequence alone gets is not a slice padfree can take
            raise PackingDisabledError(
                f"{who} got {name} ({type(value).__name__}) with a packed batch; padfree runs {who} once per group of "
                f"sequences and does not know what a sequence alone gets for {name}")
        del named[name]
    outputs: list[Any] = []
    names = list(tokens)

    def one_group(length: int, count: int, *blocks: torch.Tensor) -> torch.Tensor:
        call = {**named, **{name: cut(length, count) for name, cut in cuts.items()},
                **dict(zip(names[1:], blocks[1:], strict=True))}
        out = forward(module, blocks[0], **call)
        outputs.append(out)
        return out[0] if isinstance(out, tuple) else out

    merged = per_bucket(one_group, lay, *tokens.values(), by=plan.by)
    if not isinstance(outputs[0], tuple):
        return merged
    rest = [plan.stitch.get(i, shared)([out[i] for out in outputs], lay, plan.by) for i in range(1, len(outputs[0]))]
    return (merged, *rest)
