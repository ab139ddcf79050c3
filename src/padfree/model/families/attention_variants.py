"""Attention that padfree's attention backends cannot reach, run per sequence with the inputs each sequence has alone.

padfree makes attention exact by handing its packed layout to the attention function transformers' interface calls
(:mod:`padfree.model.attention`). Some attention modules never get there, or compute more than the attention
function sees:

- they write their own attention instead of calling the interface (GPT-NeoX-Japanese; BLOOM, MPT and Falcon, the
  ALiBi models of :mod:`padfree.model.families.alibi`);
- their decoder layer does not hand its keyword arguments on, so the layout never arrives (StableLM);
- they compute from the row's positions inside the module: Llama-4 scales its queries on NoPE layers by a temperature
  of ``arange`` over the row, and its chunked layers count chunks from the row's start;
- they derive the attention from the tokens of the whole row: Doge's dynamic mask attention keeps the top-k keys of
  every row, and its CDMoE router reshapes the flattened batch so that one token's experts depend on others.

:func:`padfree.configure_packing` routes every instance of :data:`CLASSES` to :func:`install`, which patches the
instance so that a packed batch runs **the module's own forward** once per group of sequences
(:func:`padfree.model.packed.per_bucket`), each sequence a row of its own, with what that sequence has alone: the
same code, dtypes and autocast behaviour as transformers' lone-sequence path, by construction. An ordinary batch
runs transformers' own forward, untouched.

>>> import torch, transformers
>>> from padfree.model.install import install_packing, unconfigure_packing
>>> cfg = transformers.StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                   num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.StableLmForCausalLM(cfg).eval()
>>> print(install_packing(model).mixers["model.layers.0.self_attn"])
its own forward per bucket of sequences (the layout never reaches it: its decoder layer drops keyword arguments)
>>> packed = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]])).logits
>>> alone = model(input_ids=torch.tensor([[8, 9]])).logits
>>> bool(torch.allclose(packed[0, 3:], alone[0], atol=1e-5))
True
>>> unconfigure_packing(model)
True
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import InvalidLayoutError, PackingDisabledError, UnsupportedModelError
from padfree.model import guards
from padfree.model.packed import PackedLayout, per_bucket
from padfree.model.state import current_layout, hooks_live, unpatch

__all__ = ["CLASSES", "REPLAYS", "Replay", "install", "uninstall"]


@dataclasses.dataclass(frozen=True)
class Replay:
    """How the instances of one module class run per group of packed sequences.

    The first parameter of the forward is the ``(B, T, ...)`` hidden state, gathered per group. Arguments named
    ``attention_mask`` (``(B | 1, ..., T, T)``), ``position_ids`` (``(B | 1, T)``) and ``position_embeddings`` (a
    ``(B | 1, T, ...)`` table or a tuple of them) are cut to their first ``L`` positions; ``None``, bools and numbers
    pass unchanged; any other tensor is refused at the call (padfree does not guess what it means).

    Attributes:
        description: one line for the configured model's report.
        tokens: further ``(B, T, ...)`` per-token arguments, gathered like the hidden state.
        heads: ``(B·H, 1, T)`` or ``(B, H, 1, T)`` per-key biases (ALiBi): each group gets the first ``L`` keys
            of the first row's.
        same: position-free tensors, handed over unchanged.
        by: the grouping (:meth:`~padfree.model.packed.PackedLayout.buckets`): ``"bucket"``; ``"length"`` where the
            forward depends on a sequence's exact length; ``"sequence"`` where it mixes the rows of a batch.
        extras: combines the per-group values of the output's other entries (index -> function of the list); by
            default an entry every group returns as one object (a bias parameter) is kept and anything else
            (per-group attention weights) is None.
    """

    description: str
    tokens: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    same: tuple[str, ...] = ()
    by: str = "bucket"
    extras: Mapping[int, Callable[[list[Any]], Any]] = dataclasses.field(default_factory=dict)


def _router_logits(per_group: list[torch.Tensor]) -> torch.Tensor:
    # Doge's (2, tokens, keys) router logits of every sequence, sequence after sequence: the load-balancing loss
    # averages over tokens, so their order does not matter
    return torch.cat(per_group, dim=1)


_BUCKET = "its own forward per bucket of sequences"
REPLAYS: dict[str, Replay] = {
    "GPTNeoXJapaneseAttention": Replay(f"{_BUCKET} (hand-written attention outside transformers' interface)"),
    "StableLmAttention": Replay(f"{_BUCKET} (the layout never reaches it: its decoder layer drops keyword arguments)"),
    "Llama4TextAttention": Replay(f"{_BUCKET} (chunks and NoPE query temperature counted from each sequence's start)"),
    "DogeAttention": Replay("its own forward per group of sequences of one length (dynamic mask: top-k keys of each "
                            "sequence alone)", by="length"),
    "DogeCDMoE": Replay("its own forward per sequence (its router reshapes the whole flattened batch)",
                        by="sequence", extras={1: _router_logits}),
}
#: module class name -> what running it per sequence makes exact
CLASSES: dict[str, str] = {name: spec.description for name, spec in REPLAYS.items()}


@dataclasses.dataclass(eq=False)
class _Installed:
    """What a patched instance carries: the configured model's state and how its class runs per group."""

    state: Any
    spec: Replay
    hidden: str  # the name of the forward's first parameter


def _layout_in_flight(module: torch.nn.Module, info: _Installed, hidden: Any) -> PackedLayout | None:
    if not hooks_live(info.state) or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return None
    return current_layout(info.state, hidden, type(module).__name__)


def _patched_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, one run per group otherwise."""
    info: _Installed = self._padfree_replay
    lay = _layout_in_flight(self, info, args[0] if args else kwargs.get(info.hidden))
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    return _replay(self, info, lay, args, kwargs)


# ---- the inputs of one group: what its sequences get alone -------------------------------------------------------
# The model built these for rows without boundaries (the configured model's hook dropped them above it): positions
# 0 .. T-1 in every row, no padding. A sequence of n tokens alone gets the same values at its n positions, so a group
# of L-token slots takes the first L of the first row — sliced, never recomputed, so the dtypes and the arithmetic are
# the model's own.


def _cut_mask(value: torch.Tensor, lay: PackedLayout, who: str) -> Callable[[int, int], torch.Tensor]:
    batch, seq_len = lay.shape
    if value.dim() < 3 or tuple(value.shape[-2:]) != (seq_len, seq_len) or value.shape[0] not in (1, batch):
        raise PackingDisabledError(f"{who} got an attention_mask of shape {tuple(value.shape)} with a packed batch of "
                                   f"{batch} x {seq_len}; padfree expected the (B, ..., T, T) mask of a row")
    return lambda n, m: value[:1, ..., :n, :n].expand(m, *value.shape[1:-2], n, n)


def _cut_positions(value: torch.Tensor, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], torch.Tensor]:
    batch, seq_len = lay.shape
    if value.dim() < 2 or value.shape[1] != seq_len or value.shape[0] not in (1, batch):
        raise PackingDisabledError(f"{who} got {name} of shape {tuple(value.shape)} with a packed batch of "
                                   f"{batch} x {seq_len}; padfree expected one entry per position of a row")
    return lambda n, m: value[:1, :n].expand(m, n, *value.shape[2:])


def _cut_heads(value: torch.Tensor, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], torch.Tensor]:
    batch, seq_len = lay.shape
    if value.dim() == 4 and value.shape[0] in (1, batch) and value.shape[-1] == seq_len:  # (B, H, 1, T)
        return lambda n, m: value[:1, ..., :n].repeat(m, 1, 1, 1)
    if value.dim() != 3 or value.shape[0] % batch or value.shape[-1] != seq_len:
        raise PackingDisabledError(f"{who} got {name} of shape {tuple(value.shape)} with a packed batch of "
                                   f"{batch} x {seq_len}; padfree expected a (B * heads, 1, T) or (B, heads, 1, T) "
                                   f"bias")
    heads = value.shape[0] // batch
    return lambda n, m: value[:heads, :, :n].repeat(m, 1, 1)


def _cut_table(value: Any, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], Any]:
    if isinstance(value, torch.Tensor):
        return _cut_positions(value, lay, name, who)
    cuts = [_cut_positions(v, lay, name, who) for v in value]
    return lambda n, m: type(value)(cut(n, m) for cut in cuts)


def _rope_limit(module: torch.nn.Module) -> tuple[str, int] | None:
    """``(rope type, longest row)`` when the module's RoPE rescales its frequencies by the longest position of a
    call (``dynamic``, ``longrope``): a packed row longer than the original context would rescale every sequence."""
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
def _replay(module: torch.nn.Module, info: _Installed, lay: PackedLayout, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The module's own forward once per group of sequences, with the inputs each sequence has alone."""
    who, spec, forward = type(module).__name__, info.spec, type(module).forward
    named = guards.bind(forward, (module, *args), kwargs)
    if named is None:  # a call that does not fit: transformers raises its own error
        forward(module, *args, **kwargs)
        raise TypeError(f"{who}.forward does not accept this call")
    named.pop(next(iter(guards.parameters(forward))), None)
    cache = guards.find_cache(named, forward)
    if cache is not None:
        raise PackingDisabledError(f"{who} got {cache} with a packed batch; packed training never uses a cache "
                                   f"(pass use_cache=False)")
    rope = _rope_limit(module)
    if rope is not None and lay.shape[1] > rope[1]:
        raise PackingDisabledError(
            f"{who} uses {rope[0]} RoPE, which rescales its frequencies by the longest position of a call: a packed "
            f"row of {lay.shape[1]} tokens would rescale the sequences that are shorter than {rope[1]} alone; pack "
            f"rows of at most {rope[1]} tokens")
    if named.get("output_attentions"):
        named["output_attentions"] = False  # per-group weights have no (B, H, T, T) form
    token_names = (info.hidden, *spec.tokens)
    tokens = [named.pop(name) for name in token_names]
    for name, value in zip(token_names, tokens, strict=True):
        if not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != lay.shape:
            raise InvalidLayoutError(f"{who} got {name} of shape {tuple(getattr(value, 'shape', ()))} but the packed "
                                     f"layout of this forward is {lay.shape}")
    cuts: dict[str, Callable[[int, int], Any]] = {}
    for name, value in list(named.items()):
        if value is None or name in spec.same or isinstance(value, _PLAIN):
            continue
        if name in spec.heads and isinstance(value, torch.Tensor):
            cuts[name] = _cut_heads(value, lay, name, who)
        elif name == "attention_mask" and isinstance(value, torch.Tensor):
            cuts[name] = _cut_mask(value, lay, who)
        elif name == "position_ids" and isinstance(value, torch.Tensor):
            cuts[name] = _cut_positions(value, lay, name, who)
        elif name == "position_embeddings" and isinstance(value, (torch.Tensor, tuple, list)):
            cuts[name] = _cut_table(value, lay, name, who)
        else:  # e.g. a flex BlockMask of the row: what a sequence alone gets is not a slice padfree can take
            raise PackingDisabledError(
                f"{who} got {name} ({type(value).__name__}) with a packed batch; padfree runs {who} once per "
                f"sequence and does not know what a sequence alone gets for {name}")
        del named[name]
    outputs: list[Any] = []

    def run(length: int, count: int, *blocks: torch.Tensor) -> torch.Tensor:
        call = {**named, **{name: cut(length, count) for name, cut in cuts.items()},
                **dict(zip(spec.tokens, blocks[1:], strict=True))}
        out = forward(module, blocks[0], **call)
        outputs.append(out)
        return out[0] if isinstance(out, tuple) else out

    merged = per_bucket(run, lay, *tokens, by=spec.by)
    if not isinstance(outputs[0], tuple):
        return merged
    rest = []
    for i in range(1, len(outputs[0])):
        values = [out[i] for out in outputs]
        if i in spec.extras:
            rest.append(spec.extras[i](values))
        else:
            rest.append(values[0] if all(v is values[0] for v in values) else None)
    return (merged, *rest)


# ---- installation ------------------------------------------------------------------------------------------------


def install(module: torch.nn.Module, state: Any, replays: Mapping[str, Replay] = REPLAYS) -> str:
    """Make one instance of a class of ``replays`` run per sequence for packed batches of the model ``state``
    belongs to; returns the one-line description of its packed forward. Idempotent."""
    name = type(module).__name__
    spec = replays.get(name)
    if spec is None:
        raise UnsupportedModelError(f"{name} is not an attention module padfree knows how to run per sequence")
    if state.backend != "none":
        # the model's hook then sits on the decoder and hands restarting position_ids down: the per-position
        # inputs of the row would no longer be those of positions 0 .. T-1, which the groups are cut from
        raise UnsupportedModelError(
            f"{name} runs per sequence on the inputs its model builds for a row without boundaries, but this model "
            f"also has attention layers on padfree's {state.backend} backend, which receive restarting positions; "
            f"padfree proved {name} only in models whose attention it runs per sequence throughout")
    params = guards.parameters(type(module).forward)
    missing = [arg for arg in (*spec.tokens, *spec.heads, *spec.same) if arg not in params]
    if len(params) < 2 or missing:
        raise UnsupportedModelError(f"{name}.forward takes {params}, not the arguments padfree proved ({missing} "
                                    f"missing); refusing rather than guessing")
    module._padfree_replay = _Installed(state, spec, params[1])
    module.forward = types.MethodType(_patched_forward, module)
    return spec.description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_replay")
