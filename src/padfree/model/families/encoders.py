"""Encoder families run as causal decoders (BERT and its descendants, RoFormer, XLM, GIT, ModernBERT's decoder):
self-attention per packed sequence, positions restarting.

These models build their attention masks themselves, compute attention inline or through transformers' attention
interface, and count positions over the row: a packed row would be one long sequence to them. For a packed batch of
a configured model, every claimed self-attention runs *transformers' own forward* once per bucket of equal-length
segments (:meth:`padfree.model.packed.PackedLayout.buckets`) under the mask a padded batch of those sequences gets —
causal when the model is a decoder (``is_decoder`` / ``causal``), bidirectional within the sequence otherwise, a
sliding window where the layer has one — reading the rotary or sinusoidal rows of each sequence's own positions;
every claimed embeddings module reads the layout's restarting ``position_ids``. Projections, norms and feed-forward
blocks never see a boundary and run on the packed tokens unchanged. An unpacked batch, and generation with a cache,
run transformers' code untouched.

Refused, with the reason: BigBird's block-sparse attention (chosen for the whole row, and bidirectional even in a
decoder), XLM's row-level ``lengths``, cross-attention inputs, GIT's image tokens, a cache, and attention
implementations that take no per-sequence mask (flash-attn, flex).

Every sequence of a packed row gets the mask it gets alone; a bucket pads shorter sequences with slots no real
token may see (here the sequences of 3 and 2 tokens share one bucket: the second one's third slot is padding, seen
by no real token):

>>> import torch
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> causal = bucket_masks(lay, causal=True, window=None)[0]  # (sequences, slots, slots), True = may attend
>>> causal.shape[0], causal[1, :3, :3].int().tolist()
(2, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
>>> bucket_masks(lay, causal=False, window=None)[0][1, 0, :3].tolist()  # bidirectional, within the sequence
[True, True, False]
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from padfree.errors import InvalidLayoutError, PackingDisabledError, UnsupportedModelError
from padfree.model import guards
from padfree.model.flight import layout_in_flight
from padfree.model.packed import PackedLayout
from padfree.model.state import current_layout, hooks_live, patch, unpatch

_ATTR = "_padfree_encoder"
# keyword arguments that describe the whole packed row: a per-bucket call must not carry them into attention
_ROW_KWARGS = ("padfree_layout", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# ---- what each claimed class needs ----------------------------------------------------------------------------------


def _is_causal(module: torch.nn.Module) -> bool:
    return bool(module.is_causal)


def _is_decoder(module: torch.nn.Module) -> bool:
    return bool(module.is_decoder)


def _always(module: torch.nn.Module) -> bool:
    return True


def _config_decoder(module: torch.nn.Module) -> bool:
    return bool(module.config.is_decoder)


def _no_window(module: torch.nn.Module) -> int | None:
    return None


def _own_window(module: torch.nn.Module) -> int | None:
    window = getattr(module, "sliding_window", None)
    return int(window) if window is not None and window > 0 else None


def _full_attention_only(module: torch.nn.Module) -> str | None:
    if module.attention_type == "original_full":
        return None
    return (f"{type(module).__name__} runs block-sparse attention (attention_type={module.attention_type!r}): "
            f"BigBirdModel chooses it for rows longer than (5 + 2 * num_random_blocks) * block_size tokens and lays "
            f"its global, sliding and random blocks over the whole padded row, so packed sequences would attend "
            f"across boundaries and each differently from the same sequence alone (which may even run full "
            f"attention); configure attention_type='original_full', or pack rows no longer than that")


@dataclasses.dataclass(frozen=True)
class _Attention:
    """How to run one self-attention class per bucket.

    Attributes:
        hidden: the forward's parameter holding the ``(B, T, D)`` input.
        mask: its parameter taking the attention mask.
        causal: whether an instance attends causally (else bidirectionally within its sequence).
        window: the instance's sliding window ``W`` (keys with ``q - k < W``), or None.
        interface: the forward dispatches through transformers' attention interface (the mask format then follows
            the implementation: boolean for SDPA, additive for eager); else it adds an additive mask inline.
        keep_mask: XLM's format: 1 = keep, ``(m, L)`` per key (bidirectional) or ``(m, L, L)`` (causal).
        tables: parameters holding per-position tables the model built for the whole row (``(..., T, D)``, or a
            tuple of them), as ``name -> "index"`` (built for positions ``0..T-1``; a sequence alone reads rows
            ``0..n-1``) or ``name -> "position_ids"`` (built from the call's ``position_ids``; a sequence alone reads
            the rows of its own position ids).
        cross: the parameter of cross-attention inputs (refused in a packed batch), if any.
        guard: a reason to refuse the instance's current mode in a packed batch, or None.
        empty_cache_ok: XLMModel hands every layer a fresh, empty cache of its own; only a filled one is refused.
    """

    hidden: str = "hidden_states"
    mask: str = "attention_mask"
    causal: Callable[[torch.nn.Module], bool] = _is_decoder
    window: Callable[[torch.nn.Module], int | None] = _no_window
    interface: bool = False
    keep_mask: bool = False
    tables: tuple[tuple[str, str], ...] = ()
    cross: str | None = "encoder_hidden_states"
    guard: Callable[[torch.nn.Module], str | None] | None = None
    empty_cache_ok: bool = False


_INTERFACE = _Attention(causal=_is_causal, interface=True, cross=None)
_INLINE = _Attention()

#: self-attention class -> how it runs per bucket
ATTENTION: dict[str, _Attention] = {
    **{f"{p}SelfAttention": _INTERFACE for p in (
        "Bert", "BertGeneration", "Camembert", "Data2VecText", "Electra", "Ernie", "Roberta", "RobertaPreLayerNorm",
        "RoCBert", "XLMRoberta", "XLMRobertaXL", "Xmod")},
    "MegatronBertSelfAttention": _INLINE,
    "RemBertSelfAttention": _INLINE,
    "RoFormerSelfAttention": dataclasses.replace(_INLINE, tables=(("sinusoidal_pos", "index"),)),
    "BigBirdAttention": dataclasses.replace(_INLINE, causal=_config_decoder, guard=_full_attention_only),
    "GitSelfAttention": _Attention(causal=_always, cross=None),
    "ModernBertDecoderAttention": _Attention(causal=_is_causal, window=_own_window, interface=True, cross=None,
                                             tables=(("position_embeddings", "position_ids"),)),
}
#: XLMModel's attention layers (claimed through XLMModel, which owns their mask and positions)
_XLM_ATTENTION = _Attention(hidden="input", mask="mask", keep_mask=True, cross="kv", empty_cache_ok=True)

#: cross-attention classes: a packed batch with encoder states is refused
_CROSS_ATTENTION = frozenset(f"{p}CrossAttention" for p in (
    "Bert", "BertGeneration", "Camembert", "Data2VecText", "Electra", "Ernie", "Roberta", "RobertaPreLayerNorm",
    "RoCBert", "XLMRoberta", "XLMRobertaXL", "Xmod"))
#: embeddings classes with a learned absolute position table indexed by ``position_ids``
_EMBEDDINGS = frozenset(f"{p}Embeddings" for p in (
    "Bert", "BertGeneration", "BigBird", "Camembert", "Data2VecText", "Electra", "Ernie", "MegatronBert", "RemBert",
    "Roberta", "RobertaPreLayerNorm", "RoCBert", "XLMRoberta", "XLMRobertaXL", "Xmod", "Git"))

_ATTENTION_DOC = "self-attention per packed sequence (transformers' own forward per bucket of equal-length segments)"
#: the classes this module makes boundary-exact (read by :func:`padfree.configure_packing`)
CLASSES: dict[str, str] = {
    **{name: _ATTENTION_DOC for name in ATTENTION},
    **{name: "learned absolute positions restarting at every packed sequence" for name in sorted(_EMBEDDINGS)},
    **{name: "cross-attention, refused in a packed batch" for name in sorted(_CROSS_ATTENTION)},
    "XLMModel": "XLM: positions and the padding rule per packed sequence, its attention per sequence",
}


# ---- the boundaries, in the forms the per-bucket calls want (cached on the layout: built once per batch) -----------


def _slot_index(lay: PackedLayout) -> torch.Tensor:
    """``(B·T,) int64``: every token's index inside its segment (padding runs count as segments)."""
    def build() -> torch.Tensor:
        lengths = lay.lengths
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        return torch.from_numpy(np.arange(int(lengths.sum()), dtype=np.int64) - starts).to(lay.device)
    return lay.memo(("padfree.encoders", "index"), build)


def _valid_slots(lay: PackedLayout) -> torch.Tensor:
    """``(slots,) bool``: the bucket slots that hold a token of their segment (the rest pad the bucket)."""
    def build() -> torch.Tensor:
        plan = lay.buckets()
        valid = torch.zeros(plan.slots.numel(), dtype=torch.bool, device=lay.device)
        valid[plan.inverse] = True
        return valid
    return lay.memo(("padfree.encoders", "valid"), build)


def bucket_masks(lay: PackedLayout, causal: bool, window: int | None) -> list[torch.Tensor]:
    """One ``(m, L, L)`` boolean mask per bucket of ``lay`` (True = may attend): a key must be a token of the
    query's sequence (not a slot padding the bucket), before or at the query when ``causal``, and with
    ``q - k < window``. A slot that pads the bucket sees itself only, so every query keeps a key.

    >>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0]]))  # sequences of 3 and 1 tokens
    >>> [m.shape[0] for m in bucket_masks(lay, True, None)], bucket_masks(lay, False, None)[0][1, 0, :2].tolist()
    ([2], [True, False])
    """
    def build() -> list[torch.Tensor]:
        plan, valid = lay.buckets(), _valid_slots(lay)
        masks = []
        for part, length, count in zip(valid.split(plan.sizes), plan.lengths, plan.counts, strict=True):
            real = part.view(count, length)
            allowed = real.unsqueeze(1).expand(count, length, length)
            pos = torch.arange(length, device=lay.device)
            gap = pos[:, None] - pos[None, :]
            if causal:
                allowed = allowed & (gap >= 0)
            if window is not None:
                allowed = allowed & (gap < window)
            # a padding slot sees itself only: its output is dropped, but a query with no key at all would give
            # SDPA a NaN row whose backward poisons the gradient of the token the slot repeats
            allowed = allowed | ((gap == 0) & ~real.unsqueeze(-1))
            masks.append(allowed.contiguous())
        return masks
    return lay.memo(("padfree.encoders", "masks", causal, window), build)


def _row_index(lay: PackedLayout, rows: int, length: int, how: str, source: Any) -> torch.Tensor:
    """``(B·T,) int64``: the row of a ``(rows, T, D)`` table (flattened) that each token reads when its sequence
    runs alone.

    ``how == "index"``: the table holds positions ``0..T-1``; a token reads the row of its index in its sequence.
    ``how == "position_ids"``: the table was built from ``source``, the position ids the model saw — ``0..T-1``
    (None: the model counted them itself) or the layout's own — and a token reads the row of its own position id.
    """
    batch, seq_len = lay.shape
    offset = (torch.arange(batch, device=lay.device).repeat_interleave(seq_len) * seq_len if rows == batch
              else torch.zeros((), dtype=torch.long, device=lay.device))
    if how == "position_ids" and _built_from_layout(lay, source):
        column = torch.arange(seq_len, device=lay.device).repeat(batch)
        return column + offset  # each token's row already holds its own position
    target = _slot_index(lay) if how == "index" else lay.position_ids.reshape(-1)
    if int(target.max()) >= length:
        raise PackingDisabledError(f"a packed sequence reads position {int(target.max())} of a position table the "
                                   f"model built for {length} positions (a row of {seq_len} tokens); position ids "
                                   f"that run past the row's length have no row of that table")
    return target + offset


def _built_from_layout(lay: PackedLayout, source: Any) -> bool:
    """Whether ``source`` (the position ids a model built its tables from) are the layout's own positions (True)
    or ``0..T-1`` / None (False); anything else belongs to another batch. Cached per forward: every layer asks."""
    if source is None:
        return False
    hit = lay._cache.get(("padfree.encoders", "source"))
    if hit is not None and hit[0] is source:
        return hit[1]
    batch, seq_len = lay.shape
    if not isinstance(source, torch.Tensor) or source.shape[-1] != seq_len:
        raise InvalidLayoutError(f"position ids of shape {tuple(getattr(source, 'shape', ()))} reached a layer of a "
                                 f"packed batch of shape {lay.shape}; the boundaries belong to another batch")
    own = bool(torch.equal(source.expand(batch, seq_len), lay.position_ids))
    if not own and not bool((source == torch.arange(seq_len, device=source.device)).all()):
        raise InvalidLayoutError("the position tables of this forward were built from position ids that are neither "
                                 "the packed layout's nor 0..T-1; the boundaries belong to another batch")
    lay._cache[("padfree.encoders", "source")] = (source, own)  # holds the tensor: its id cannot be reused
    return own


def gather_table(table: Any, lay: PackedLayout, how: str, source: Any) -> list[Any]:
    """Per bucket, the rows of ``table`` (``(b, 1, ..., T, D)`` with ``b`` 1 or B, or a tuple of such) its slots
    read, shaped ``(m, 1, ..., L, D)``."""
    if isinstance(table, (tuple, list)):
        parts = [gather_table(t, lay, how, source) for t in table]
        return [type(table)(p) for p in zip(*parts, strict=True)]
    batch, seq_len = lay.shape
    if not isinstance(table, torch.Tensor) or table.dim() < 3 or table.shape[-2] != seq_len or \
            table.shape[0] not in (1, batch) or any(d != 1 for d in table.shape[1:-2]):
        raise InvalidLayoutError(f"a position table of shape {tuple(getattr(table, 'shape', ()))} does not cover "
                                 f"the packed batch {lay.shape}")
    rows, mid = table.shape[0], table.shape[1:-2]
    flat = table.reshape(rows * seq_len, table.shape[-1])
    plan = lay.buckets()
    picked = flat.index_select(0, _row_index(lay, rows, seq_len, how, source).index_select(0, plan.slots))
    return [p.view(count, *mid, length, table.shape[-1])
            for p, length, count in zip(picked.split(plan.sizes), plan.lengths, plan.counts, strict=True)]


# ---- the per-segment forward ----------------------------------------------------------------------------------------


def _masks_for(spec: _Attention, module: torch.nn.Module, lay: PackedLayout, causal: bool, window: int | None,
               dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Per bucket, the mask ``module``'s forward takes for a padded batch of its sequences: boolean for
    transformers' SDPA, additive (0 / the dtype's minimum, in the hidden states' dtype, as transformers' eager masks)
    otherwise. The cheapest form that is exact: none where SDPA's own causal path applies (a slot that pads a
    sequence comes after all of its tokens), one row of keys ``(m, 1, 1, L)`` for bidirectional attention, the full
    ``(m, 1, L, L)`` of :func:`bucket_masks` otherwise."""
    boolean = spec.interface and _implementation(module) == "sdpa"
    if boolean and causal and window is None:
        return [None] * len(lay.buckets().lengths)  # what a sequence alone runs: SDPA with is_causal

    def build() -> list[torch.Tensor]:
        plan = lay.buckets()
        if not causal and window is None:
            masks = [v.view(count, 1, 1, length) for v, length, count in
                     zip(_valid_slots(lay).split(plan.sizes), plan.lengths, plan.counts, strict=True)]
        else:
            masks = [m.unsqueeze(1) for m in bucket_masks(lay, causal, window)]
        if boolean:
            return masks
        return [torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
                for m in masks]
    return lay.memo(("padfree.encoders", "masks", causal, window, None if boolean else dtype), build)


def _implementation(module: torch.nn.Module) -> str:
    """The transformers attention function ``module`` calls for a padded batch (a padfree backend's base)."""
    from padfree.model.attention import BACKENDS

    name = str(module.config._attn_implementation)
    return BACKENDS[name].base if name in BACKENDS else name


@torch.compiler.disable  # host-side bucket sizes: traced, every new set of lengths would recompile (see configure)
def per_segment(module: torch.nn.Module, spec: _Attention, named: dict[str, Any], lay: PackedLayout) -> Any:
    """Run ``module``'s own forward once per bucket of equal-length segments of ``lay`` and put the outputs back.

    Args:
        module: a claimed self-attention instance.
        spec: how its forward takes inputs, mask and position tables (this module's entry for its class).
        named: the call's arguments by parameter name (``spec.hidden`` holds ``(B, T, D)``).
        lay: the packed batch's layout.

    Returns:
        What the forward returns, its first output ``(B, T, D')`` reassembled from the buckets (attention weights,
        which have no packed form, are None). Slots that pad a bucket repeat their segment's last token and no real
        query attends to them; one gather feeds every bucket and one gather puts the outputs back.
    """
    hidden = named[spec.hidden]
    batch, seq_len = lay.shape
    plan = lay.buckets()
    parts = hidden.reshape(batch * seq_len, *hidden.shape[2:]).index_select(0, plan.slots).split(plan.sizes)
    causal, window = spec.causal(module), spec.window(module)
    masks = (bucket_masks(lay, causal, window) if spec.keep_mask
             else _masks_for(spec, module, lay, causal, window, hidden.dtype))
    source = named.get("position_ids")
    tables = {name: gather_table(named[name], lay, how, source) for name, how in spec.tables
              if named.get(name) is not None}
    keys = None
    if spec.keep_mask and not causal:  # XLM's padding rule: the tokens a sequence alone drops are no keys either
        keep = named[spec.mask].reshape(-1).index_select(0, plan.slots).bool()
        keys = (keep & _valid_slots(lay)).split(plan.sizes)
    call = {k: v for k, v in named.items() if k not in _ROW_KWARGS}
    if "cache" in call:
        call["cache"] = None  # a per-bucket call writes nothing anywhere (XLMModel's own empty cache included)
    outs, first = [], None
    for i, (length, count) in enumerate(zip(plan.lengths, plan.counts, strict=True)):
        call[spec.hidden] = parts[i].view(count, length, *hidden.shape[2:])
        call[spec.mask] = keys[i].view(count, length) if keys is not None else masks[i]
        call.update({name: table[i] for name, table in tables.items()})
        out = type(module).forward(module, **call)
        first = out[0] if isinstance(out, tuple) else out
        outs.append(first.reshape(count * length, *first.shape[2:]))
    merged = torch.cat(outs).index_select(0, plan.inverse).view(batch, seq_len, *first.shape[2:])
    return (merged, *(None,) * (len(out) - 1)) if isinstance(out, tuple) else merged


# ---- the installed forwards ----------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Installed:
    """What a patched instance carries: the configured model's state, and for attention how it runs per bucket."""

    state: Any
    spec: _Attention | None = None
    owner: torch.nn.Module | None = None  # XLM's attention layers: the XLMModel whose ``causal`` they follow


@torch.compiler.disable  # host-side state (see per_segment)
def _in_flight(info: _Installed) -> bool:
    """This call belongs to a packed forward of the configured model (its hooks live)."""
    return hooks_live(info.state) and layout_in_flight(info.state) is not None


def _bound(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    forward = type(module).forward
    named = guards.bind(forward, (module, *args), kwargs)
    if named is None:
        raise PackingDisabledError(f"{type(module).__name__} was called with arguments its forward does not take")
    named.pop(next(iter(guards.parameters(forward))), None)  # self
    return named


def _layout_for(info: _Installed, tokens: Any, who: str) -> PackedLayout | None:
    """The layout of the packed forward in flight, checked against ``tokens`` (``(B, T, ...)``)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return None
    lay = layout_in_flight(info.state)
    if tokens.shape[0] == lay.shape[0] and tokens.shape[1] != lay.shape[1]:
        why = next((w for prefix, w in _ADDED_TOKENS.items() if who.startswith(prefix)), "")
        raise PackingDisabledError(
            f"{who} got {tokens.shape[1]} tokens per row in a packed batch of {lay.shape[1]}: the model added tokens "
            f"of its own to the row{why}, which no packed sequence has alone; pass such batches unpacked")
    return current_layout(info.state, tokens, who)


# why a model adds tokens to a packed row (see _layout_for)
_ADDED_TOKENS = {
    "Git": " (its image tokens, which every sequence of the row would attend to)",
    "BigBird": (" (BigBirdModel pads a row for block-sparse attention, which it runs on rows longer than "
                "(5 + 2 * num_random_blocks) * block_size tokens over the whole row; configure "
                "attention_type='original_full')"),
}


def _refuse_cache(module: torch.nn.Module, named: dict[str, Any], empty_ok: bool = False) -> None:
    forward = type(module).forward
    for name, value in named.items():
        if value is None or isinstance(value, bool) or value is module:
            continue
        if guards.is_cache(value) or guards.find_cache({name: value}, forward) is not None:
            if empty_ok and hasattr(value, "get_seq_length") and int(value.get_seq_length()) == 0:
                continue  # XLMModel's own fresh cache: nothing in it, and the per-bucket calls write nothing
            raise PackingDisabledError(f"{type(module).__name__} got {name}={type(value).__name__} with a packed "
                                       f"batch; packed training never uses a cache (pass use_cache=False)")


def _attention_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``forward`` of a claimed self-attention: transformers' forward, per packed sequence."""
    if not _in_flight(getattr(self, _ATTR)):
        return type(self).forward(self, *args, **kwargs)
    return _packed_attention(self, args, kwargs)


@torch.compiler.disable  # host-side boundaries (see per_segment)
def _packed_attention(self: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    info: _Installed = getattr(self, _ATTR)
    spec = info.spec
    why = spec.guard(self) if spec.guard is not None else None
    if why is not None:
        raise PackingDisabledError(why)
    named = _bound(self, args, kwargs)
    if spec.cross is not None and named.get(spec.cross) is not None:
        raise PackingDisabledError(_CROSS.format(name=type(self).__name__, arg=spec.cross))
    lay = _layout_for(info, named.get(spec.hidden), type(self).__name__)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    _refuse_cache(self, named, spec.empty_cache_ok)
    if spec.interface:
        _check_implementation(self, PackingDisabledError)
    if info.owner is not None:  # XLM: causal is the model's flag, not the layer's
        spec = dataclasses.replace(spec, causal=lambda _m, owner=info.owner: bool(owner.causal))
    return per_segment(self, spec, named, lay)


_CROSS = ("{name} got {arg} with a packed batch: cross-attention to encoder states has no per-sequence form in a "
          "packed row (every sequence would need encoder states of its own); pass such batches unpacked")


def _cross_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``forward`` of a cross-attention: transformers' forward, refused in a packed batch."""
    if _in_flight(getattr(self, _ATTR)):
        raise PackingDisabledError(_CROSS.format(name=type(self).__name__, arg="encoder_hidden_states"))
    return type(self).forward(self, *args, **kwargs)


def _embeddings_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``forward`` of a claimed embeddings module: positions from the layout in a packed batch."""
    if not _in_flight(getattr(self, _ATTR)):
        return type(self).forward(self, *args, **kwargs)
    return _packed_embeddings(self, args, kwargs)


@torch.compiler.disable  # host-side boundaries (see per_segment)
def _packed_embeddings(self: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    named = _bound(self, args, kwargs)
    lay = _layout_for(getattr(self, _ATTR), _tokens(named), type(self).__name__)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    if named.get("cache_length"):
        raise PackingDisabledError(f"{type(self).__name__} got cache_length={named['cache_length']} with a packed "
                                   f"batch; packed training never uses a cache (pass use_cache=False)")
    named["position_ids"] = _alone_positions(self, named, lay)  # what each sequence reads alone, restarting
    return type(self).forward(self, **named)


def _alone_positions(module: torch.nn.Module, named: dict[str, Any], lay: PackedLayout) -> torch.Tensor:
    """The position ids every sequence of the packed row gets alone by default. Most embeddings count from 0; the
    RoBERTa family (embeddings with ``create_position_ids_from_input_ids``) counts from ``padding_idx + 1`` over the
    non-padding tokens — per sequence, so the count restarts at every sequence start."""
    padding_idx = getattr(module, "padding_idx", None)
    if not hasattr(module, "create_position_ids_from_input_ids") or padding_idx is None:
        return lay.position_ids
    ids = named.get("input_ids")
    if ids is None:  # inputs_embeds: transformers counts every token
        return lay.position_ids + padding_idx + 1
    real = (ids != padding_idx).long()
    count = real.cumsum(dim=1)
    start = torch.arange(ids.shape[1], device=ids.device) - lay.position_ids  # each token's sequence start
    before = count.gather(1, (start - 1).clamp(min=0)) * (start > 0)
    return (count - before) * real + padding_idx


def _tokens(named: dict[str, Any]) -> Any:
    ids = named.get("input_ids")
    return ids if isinstance(ids, torch.Tensor) else named.get("inputs_embeds")


def _xlm_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``forward`` of XLMModel: per packed sequence, its positions and XLM's padding rule."""
    if not _in_flight(getattr(self, _ATTR)):
        return type(self).forward(self, *args, **kwargs)
    return _packed_xlm(self, args, kwargs)


@torch.compiler.disable  # host-side boundaries (see per_segment)
def _packed_xlm(self: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    named = _bound(self, args, kwargs)
    lay = _layout_for(getattr(self, _ATTR), _tokens(named), "XLMModel")
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    _refuse_cache(self, named)
    for name in ("lengths", "attention_mask"):
        if named.get(name) is not None:
            raise PackingDisabledError(
                f"XLMModel got {name} with a packed batch: it describes one sequence per row; pass the boundaries "
                f"alone (position_ids restarting at 0) and XLMModel's padding rule is applied per sequence")
    ids = named.get("input_ids")
    named["position_ids"] = lay.position_ids
    named["attention_mask"] = xlm_keep(lay, ids if isinstance(ids, torch.Tensor) else None, self.pad_index)
    return type(self).forward(self, **named)


def xlm_keep(lay: PackedLayout, ids: torch.Tensor | None, pad: int) -> torch.Tensor:
    """``(B, T) int64``: XLMModel's padding rule per packed sequence. Alone, a sequence of ``n`` tokens holding
    ``k`` pad ids keeps its first ``n - k`` tokens (its ``lengths`` counts the tokens that are not pad ids);
    with ``inputs_embeds`` it keeps all of them."""
    if ids is None:
        return torch.ones(lay.shape, dtype=torch.long, device=lay.device)
    seg = lay.seq_idx.reshape(-1).long()
    pads = torch.zeros(lay.num_segments, dtype=torch.long, device=lay.device).index_add_(
        0, seg, (ids.reshape(-1) == pad).long())
    kept = torch.from_numpy(lay.lengths).to(lay.device) - pads
    return (_slot_index(lay) < kept.index_select(0, seg)).long().view(lay.shape)


# ---- installation ---------------------------------------------------------------------------------------------------


def _check_implementation(module: torch.nn.Module, error: type[Exception]) -> None:
    impl = _implementation(module)
    if impl not in ("sdpa", "eager"):
        raise error(f"{type(module).__name__} runs attn_implementation={module.config._attn_implementation!r}, "
                    f"which takes no per-sequence mask; padfree runs this attention per packed sequence under "
                    f"'sdpa' or 'eager' (model.set_attn_implementation('sdpa'))")


def _check_shape(module: torch.nn.Module, params: tuple[str, ...]) -> None:
    have = inspect.signature(type(module).forward).parameters
    missing = [p for p in params if p not in have]
    if missing:
        raise UnsupportedModelError(
            f"{type(module).__name__}.forward no longer takes {', '.join(missing)}: it is not the shape padfree "
            f"proved exact per packed sequence; refusing rather than guessing")


def _patch(module: torch.nn.Module, forward: Callable, info: _Installed) -> None:
    patch(module, _ATTR, info, forward)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one claimed instance boundary-exact for packed batches of the model ``state`` belongs to; returns the
    one-line description of what it now does. Idempotent (a new ``configure_packing`` rebinds the state)."""
    name = type(module).__name__
    if name in _EMBEDDINGS:
        _check_shape(module, ("input_ids", "position_ids", "inputs_embeds"))
        _patch(module, _embeddings_forward, _Installed(state))
        return "learned absolute positions: the layout's, restarting at every packed sequence"
    if name in _CROSS_ATTENTION:
        _patch(module, _cross_forward, _Installed(state))
        return "cross-attention: unpacked batches only (a packed batch with encoder states is refused)"
    if name == "XLMModel":
        _check_shape(module, ("input_ids", "attention_mask", "position_ids", "lengths", "inputs_embeds"))
        _patch(module, _xlm_forward, _Installed(state))
        for layer in module.attentions:
            _check_shape(layer, (_XLM_ATTENTION.hidden, _XLM_ATTENTION.mask, "kv", "cache"))
            _patch(layer, _attention_forward, _Installed(state, _XLM_ATTENTION, owner=module))
        mode = "causal" if module.causal else "bidirectional"
        return f"XLM: positions and padding rule per packed sequence; {mode} {_ATTENTION_DOC}"
    spec = ATTENTION.get(name)
    if spec is None:
        raise UnsupportedModelError(f"{name} is not an encoder-family module padfree knows how to make packing-exact")
    _check_shape(module, (spec.hidden, spec.mask, *(t for t, _ in spec.tables)))
    if spec.interface:
        _check_implementation(module, UnsupportedModelError)
    _patch(module, _attention_forward, _Installed(state, spec))
    mode = "causal" if spec.causal(module) else "bidirectional"
    window = spec.window(module)
    return f"{mode} {_ATTENTION_DOC}" + (f", sliding window {window}" if window is not None else "")


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, _ATTR)
