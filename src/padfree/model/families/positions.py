"""Absolute positions that restart at every packed sequence, and the attention that transformers' interface misses.

Many decoders take their positions from an ``arange`` over the row (BART-family and Pegasus-family decoders, TrOCR,
MVP, XGLM) or from the token ids (TrOCR's sinusoidal table), and several write their own attention instead of going
through transformers' attention interface (GPT-1, XGLM, TrOCR, MVP); a few mix every token of a row with every other
(CPM-Ant and XLNet attend both ways, ProphetNet runs n-gram streams over the whole row, Reformer hashes and chunks the
whole row). In a packed row all of them cross the boundaries. :func:`padfree.configure_packing` routes every
instance of :data:`CLASSES` to :func:`install`, which patches that instance so that, for a packed batch,

- a **position table** looks up the positions each sequence has alone (``layout.position_ids``, plus the table's own
  offset, or recounted per sequence where the model counts non-padding tokens);
- a **hand-written attention** runs its own forward once per bucket of equal-length sequences, under the causal mask
  a lone sequence gets, and its outputs are scattered back;
- a **row-mixing model** runs its own forward once per group of sequences of one length, each sequence a row of its
  own, exactly as it runs alone.

An ordinary batch (no packed layout in flight) runs transformers' own forward, untouched.

>>> import torch, transformers
>>> from padfree.model.install import install_packing, unconfigure_packing
>>> cfg = transformers.BartConfig(vocab_size=64, d_model=32, decoder_layers=1, decoder_attention_heads=2,
...                               decoder_ffn_dim=64, max_position_embeddings=64)
>>> model = transformers.BartForCausalLM(cfg).eval()
>>> print(install_packing(model, backend="sdpa").mixers["model.decoder.embed_positions"])
learned position table: the positions of each sequence alone (offset 2)
>>> packed = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]])).logits
>>> alone = model(input_ids=torch.tensor([[8, 9]])).logits
>>> bool(torch.allclose(packed[0, 3:], alone[0], atol=1e-5))
True
>>> unconfigure_packing(model)
True
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
from padfree.model.packed import Buckets, PackedLayout, bucket_length
from padfree.model.state import hooks_live, patch, unpatch

# nn.Embedding subclasses whose forward returns ``weight[arange(cache_length, cache_length + T) + offset]``
_TABLES = (
    "BartLearnedPositionalEmbedding", "MBartLearnedPositionalEmbedding", "PLBartLearnedPositionalEmbedding",
    "MvpLearnedPositionalEmbedding", "TrOCRLearnedPositionalEmbedding", "BlenderbotLearnedPositionalEmbedding",
    "BlenderbotSmallLearnedPositionalEmbedding", "BigBirdPegasusLearnedPositionalEmbedding",
    "PegasusSinusoidalPositionalEmbedding", "MarianSinusoidalPositionalEmbedding",
)
# attention modules with their own eager formula (q/k/v/out projections per token, a softmax over the mask given)
_ATTENTIONS = ("MvpAttention", "TrOCRAttention", "XGLMAttention")
# models whose forward mixes a whole row beyond what one attention call sees: run per group of equal lengths
_ROW_MODELS = ("CpmAntModel", "XLNetModel", "ProphetNetDecoder", "ReformerModel")

CLASSES: dict[str, str] = {
    **dict.fromkeys(_TABLES, "absolute position table indexed by the positions of each sequence alone"),
    "XGLMSinusoidalPositionalEmbedding": "sinusoidal positions indexed by the positions of each sequence alone",
    "TrOCRSinusoidalPositionalEmbedding": "sinusoidal positions counted per sequence (padding tokens skipped)",
    **dict.fromkeys(_ATTENTIONS, "hand-written attention, run per bucket of equal-length sequences"),
    "OpenAIGPTModel": "learned positions of each sequence alone; its attention run per bucket of sequences",
    "CpmAntModel": "bidirectional attention over a per-row prompt: run per group of equal-length sequences",
    "XLNetModel": "bidirectional relative attention: run per group of equal-length sequences",
    "ProphetNetDecoder": "main and n-gram streams over the whole row: run per group of equal-length sequences",
    "ReformerModel": "LSH / chunked local attention over the whole row: run per group of equal-length sequences",
}


#: the classes that also run on a slice of a row split across a sequence-parallel group: a position table reads the
#: positions of its tokens, which the slice's layout carries (the row's own, not counted from the slice's start)
SEQUENCE_PARALLEL = frozenset({*_TABLES, "XGLMSinusoidalPositionalEmbedding"})


@dataclasses.dataclass(eq=False)
class _Installed:
    """What a patched instance carries: the configured model's state and its packed forward."""

    state: Any
    packed: Callable[..., Any]


@torch.compiler.disable  # host-side state: traced, every new batch's layout would recompile the graph
def _layout_in_flight(info: _Installed) -> PackedLayout | None:
    """The packed layout of the forward in flight, or None (an ordinary batch, or the hooks are gone)."""
    return layout_in_flight(info.state) if hooks_live(info.state) else None


def _patched_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, the packed one otherwise."""
    info: _Installed = self._padfree_positions
    lay = _layout_in_flight(info)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    return info.packed(self, lay, *args, **kwargs)


def _bind(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (``self`` left out)."""
    forward = type(module).forward
    named = guards.bind(forward, (module, *args), kwargs)
    if named is None:  # a call that does not fit the signature: transformers raises its own error
        forward(module, *args, **kwargs)
        raise TypeError(f"{type(module).__name__}.forward does not accept this call")  # pragma: no cover
    named.pop(next(iter(guards.parameters(forward))), None)
    return named


def _refuse_cache(module: torch.nn.Module, named: dict[str, Any]) -> None:
    cache = guards.find_cache(named, type(module).forward)
    if cache is not None:
        raise PackingDisabledError(f"{type(module).__name__} got {cache} with a packed batch; packed training never "
                                   f"uses a cache (pass use_cache=False)")


def _refuse_encoder(module: torch.nn.Module, named: dict[str, Any], *names: str) -> None:
    for name in names:
        if named.get(name) is not None:
            raise PackingDisabledError(
                f"{type(module).__name__} got {name} with a packed batch: cross-attention to an encoder's output "
                f"has one source per row, not one per packed sequence; pack decoder-only batches (no "
                f"encoder_hidden_states) or pass the sequences unpacked"
            )


def _check_shape(lay: PackedLayout, shape: tuple[int, ...], who: str) -> None:
    if tuple(shape[:2]) != lay.shape:
        raise InvalidLayoutError(f"{who} got inputs of shape {tuple(shape[:2])} but the packed layout of this "
                                 f"forward is {lay.shape}; the boundaries belong to another batch")


# ---- grouping the sequences of a packed batch ----------------------------------------------------------------------


def _group(lay: PackedLayout, padded: np.ndarray) -> Buckets:
    """The segments grouped by ``padded`` (one padded length per segment, ``>= its length``), longest first; slots
    past a segment's end repeat its last token (see :class:`~padfree.model.packed.Buckets`)."""
    lengths = lay.lengths
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    sizes, counts, slots = [], [], []
    inverse = np.empty(int(lengths.sum()), dtype=np.int64)
    base = 0
    for size in np.unique(padded)[::-1]:
        members = np.flatnonzero(padded == size)
        col = np.arange(size)
        n = lengths[members, None]
        gather = starts[members, None] + np.minimum(col, n - 1)
        valid = col < n
        inverse[gather[valid]] = base + np.flatnonzero(valid.reshape(-1))
        sizes.append(int(size))
        counts.append(int(members.size))
        slots.append(gather.reshape(-1))
        base += gather.size
    return Buckets(tuple(sizes), tuple(counts), torch.from_numpy(np.concatenate(slots)).to(lay.device),
                   torch.from_numpy(inverse).to(lay.device))


def _plan(lay: PackedLayout, *, cap: int | None = None, exact: bool = False) -> Buckets:
    """The layout's buckets (shared with padfree's attention), buckets no longer than ``cap``, or — ``exact`` —
    groups of segments of one length (no padding slot at all), each built once per batch."""
    if exact:
        return lay.memo(("padfree.positions", "exact"), lambda: _group(lay, lay.lengths))
    plan = lay.buckets()
    if cap is None or max(plan.lengths) <= cap:
        return plan
    # a segment longer than the cap runs at its own length (the module then fails as it fails for it alone)
    return lay.memo(("padfree.positions", "cap", cap), lambda: _group(
        lay, np.maximum(np.minimum(bucket_length(lay.lengths), cap), lay.lengths)))


def bucketed(run: Callable[..., torch.Tensor], lay: PackedLayout, *tokens: torch.Tensor | None,
             cap: int | None = None, exact: bool = False) -> torch.Tensor:
    """``run`` once per bucket of equal-length segments, its outputs put back in packed order.

    Args:
        run: ``run(length, count, *blocks) -> (count, length, ...)``; block ``i`` is ``tokens[i]`` of the bucket's
            segments, ``(count, length, ...)`` (None stays None). Slots past a segment's end repeat its last token:
            ``run`` must let no real token see them (causal attention does not).
        lay: the packed layout of the ``(B, T)`` batch.
        tokens: ``(B, T, ...)`` per-token tensors.
        cap: the longest bucket ``run`` accepts; exact: one group per segment length (no repeated slots at all).

    Returns:
        ``(B, T, ...)``: every token's output from the run of its own segment.

    >>> import torch
    >>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    >>> x = torch.arange(6.0).view(1, 6, 1)
    >>> bucketed(lambda n, m, b: b.cumsum(1), lay, x).view(-1).tolist()  # a running sum per sequence
    [0.0, 1.0, 3.0, 3.0, 7.0, 5.0]
    """
    plan = _plan(lay, cap=cap, exact=exact)
    batch, seq_len = lay.shape
    parts = [None if t is None else t.reshape(batch * seq_len, *t.shape[2:]).index_select(0, plan.slots)
             .split(plan.sizes) for t in tokens]
    outs = []
    for i, (length, count) in enumerate(zip(plan.lengths, plan.counts, strict=True)):
        blocks = [None if p is None else p[i].view(count, length, *p[i].shape[1:]) for p in parts]
        out = run(length, count, *blocks)
        outs.append(out.reshape(count * length, *out.shape[2:]))
    merged = torch.cat(outs).index_select(0, plan.inverse)
    return merged.view(batch, seq_len, *merged.shape[1:])


# ---- position tables -----------------------------------------------------------------------------------------------


def _table_lookup(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    return torch.nn.Embedding.forward(module, positions + getattr(module, "offset", 0))


def _check_table(module: torch.nn.Module) -> None:
    """Refuse a table whose forward is not ``weight[arange(T) + offset]`` (what the packed lookup replaces)."""
    if module.weight.is_meta:  # nothing to read yet: the proof of the loaded model decides
        return
    first = tuple(inspect.signature(type(module).forward).parameters)[1]
    probe: Any = torch.zeros(1, 3, dtype=torch.long) if first == "input_ids" else torch.Size((1, 3))
    with torch.no_grad():
        try:
            want = type(module).forward(module, probe)
        except Exception as exc:  # a forward of another shape: not the one proven
            want = exc
        got = _table_lookup(module, torch.arange(3, device=module.weight.device))
    if not isinstance(want, torch.Tensor) or not torch.equal(want.reshape(got.shape), got):
        raise UnsupportedModelError(
            f"{type(module).__name__}.forward does not return its table at positions arange(T) + "
            f"{getattr(module, 'offset', 0)} (got {type(want).__name__}); padfree cannot restart its positions per "
            f"sequence without knowing them"
        )


def _table_call(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A position table's call by name; a cache length (the model was handed a cache) is refused."""
    named = _bind(module, args, kwargs)
    if named.get("cache_length"):
        raise PackingDisabledError(f"{type(module).__name__} got cache_length={named['cache_length']} with a packed "
                                   f"batch; packed training never uses a cache (pass use_cache=False)")
    _refuse_cache(module, {k: v for k, v in named.items() if k != "cache_length"})
    return named


@torch.compiler.disable
def _packed_table(module: torch.nn.Module, lay: PackedLayout, *args: Any, **kwargs: Any) -> torch.Tensor:
    named = _table_call(module, args, kwargs)
    shape = next((tuple(v.shape if isinstance(v, torch.Tensor) else v) for k, v in named.items()
                  if k in ("input_ids", "input_ids_shape") and v is not None), None)
    if shape is not None:
        _check_shape(lay, shape, type(module).__name__)
    return _table_lookup(module, lay.position_ids)


@torch.compiler.disable
def _packed_indexed(module: torch.nn.Module, lay: PackedLayout, *args: Any, **kwargs: Any) -> torch.Tensor:
    """XGLM: its own forward, handed the positions of each sequence alone instead of the row's arange."""
    named = _table_call(module, args, kwargs)
    positions = named.get("position_ids")
    if positions is not None:  # the model's arange: (1, T), broadcast over the rows
        _check_shape(lay, (lay.shape[0], positions.shape[-1]), type(module).__name__)
    return type(module).forward(module, lay.position_ids.to(positions.device if positions is not None
                                                             else lay.device))


@torch.compiler.disable
def _packed_counted(module: torch.nn.Module, lay: PackedLayout, *args: Any, **kwargs: Any) -> torch.Tensor:
    """TrOCR's sinusoidal table: position = padding_idx + the number of non-padding tokens of the sequence so far
    (padding tokens sit at padding_idx, a zero row), counted from each sequence's start instead of the row's."""
    named = _table_call(module, args, kwargs)
    input_ids = named["input_ids"]
    _check_shape(lay, tuple(input_ids.shape), type(module).__name__)
    batch, seq_len = input_ids.shape
    real = input_ids.ne(module.padding_idx).int()
    count = torch.cumsum(real, dim=1).type_as(real)
    start = torch.arange(seq_len, device=input_ids.device) - lay.position_ids.to(input_ids.device)
    before = (count - real).gather(1, start)  # real tokens of the row ahead of this sequence
    positions = ((count - before) * real).long() + module.padding_idx
    if module.weights is None or module.padding_idx + 1 + seq_len > module.weights.size(0):
        # the table grows as the model grows it (rows are independent of its size)
        module.weights = module.get_embedding(module.padding_idx + 1 + seq_len, module.embedding_dim,
                                              module.padding_idx)
    return module.weights.index_select(0, positions.view(-1)).view(batch, seq_len, -1).detach()


# ---- hand-written attention ----------------------------------------------------------------------------------------


def _causal_block(lay: PackedLayout, length: int, like: torch.Tensor) -> torch.Tensor:
    """The ``(L, L)`` causal mask of one bucket in the form the model built for the row: boolean (True = attend) or
    additive (0 / the dtype's minimum), as transformers' masks for a lone sequence are."""
    allowed = lay.local_mask(length, None)
    if like.dtype == torch.bool:
        return allowed
    return lay.memo(("padfree.positions", "additive", length, like.dtype, like.device), lambda: torch.zeros(
        (), dtype=like.dtype, device=like.device).masked_fill(~allowed, torch.finfo(like.dtype).min))


def _first_out(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _like(out: Any, merged: torch.Tensor) -> Any:
    """``out``'s container with ``merged`` first and every other entry (attention weights of a bucket) None."""
    if isinstance(out, (tuple, list)):
        return type(out)([merged, *[None] * (len(out) - 1)])
    return merged


_CROSS = ("key_value_states", "encoder_hidden_states")


@torch.compiler.disable  # host-side bucket sizes: traced, every new set of lengths would recompile
def _packed_attention(module: torch.nn.Module, lay: PackedLayout, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward per bucket of equal-length sequences, under the causal mask a lone sequence gets."""
    forward = type(module).forward
    hidden_name = tuple(guards.parameters(forward))[1]
    named = _bind(module, args, kwargs)
    hidden = named.pop(hidden_name)
    who = type(module).__name__
    _check_shape(lay, tuple(hidden.shape), who)
    _refuse_cache(module, named)
    _refuse_encoder(module, named, *_CROSS)
    if "output_attentions" in named:
        named["output_attentions"] = False  # per-bucket weights have no (B, H, T, T) form
    mask = named.get("attention_mask")
    last: list[Any] = []

    def run(length: int, count: int, block: torch.Tensor) -> torch.Tensor:
        call = dict(named)
        if mask is not None:
            causal = _causal_block(lay, length, mask)
            call["attention_mask"] = causal.expand(count, *mask.shape[1:-2], length, length)
        out = forward(module, block, **call)
        last[:] = [out]
        return _first_out(out)

    merged = bucketed(run, lay, hidden, cap=getattr(module, "_padfree_cap", None))
    return _like(last[0], merged)


def _install_attention(module: torch.nn.Module, state: Any) -> str:
    if "bias" in module._buffers and module.bias is not None and module.bias.dim() == 4:
        module._padfree_cap = int(module.bias.shape[-1])  # GPT-1 crops its causal mask from an n_positions buffer
    _patch(module, state, _packed_attention)
    return "its own attention per bucket of equal-length sequences, under the causal mask of a lone sequence"


# ---- GPT-1 ---------------------------------------------------------------------------------------------------------


def _packed_openai(module: torch.nn.Module, lay: PackedLayout, *args: Any, **kwargs: Any) -> Any:
    """GPT-1's own forward, handed the positions of each sequence alone (its attention layers are patched too)."""
    named = _bind(module, args, kwargs)
    ids = named.get("input_ids")
    ref = ids if ids is not None else named.get("inputs_embeds")
    if ref is not None:
        _check_shape(lay, tuple(ref.shape), type(module).__name__)
    named["position_ids"] = _restarting_positions(lay, ref.device if ref is not None else lay.device)
    return type(module).forward(module, **named)  # traced as usual: only the boundaries are read outside the graph


@torch.compiler.disable
def _restarting_positions(lay: PackedLayout, device: torch.device) -> torch.Tensor:
    return lay.position_ids.to(device)


def _install_openai(module: torch.nn.Module, state: Any) -> str:
    attention = [m for m in module.modules() if type(m).__name__ == "Attention"
                 and type(m).__module__ == type(module).__module__]
    if not attention:
        raise UnsupportedModelError(f"{type(module).__name__} holds no Attention module of its own modeling file; "
                                    f"padfree proved the GPT-1 layout only")
    for sub in attention:
        _install_attention(sub, state)
    _patch(module, state, _packed_openai)
    return (f"learned positions of each sequence alone; {len(attention)} attention layers run per bucket of "
            f"equal-length sequences under GPT-1's own causal mask")


# ---- models that mix a whole row -----------------------------------------------------------------------------------

# per model: the per-token inputs gathered per group, inputs that relate tokens across a row (refused next to a
# packed batch), and the switches that keep a group's run from building a cache
_ROWS: dict[str, tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]]] = {
    "CpmAntModel": (("input_ids",), (), {"use_cache": False}),
    "XLNetModel": (("input_ids", "inputs_embeds", "token_type_ids", "input_mask"), ("perm_mask", "target_mapping"),
                   {"use_mems": False}),
    "ProphetNetDecoder": (("input_ids", "inputs_embeds"), ("encoder_attention_mask",), {"use_cache": False}),
    "ReformerModel": (("input_ids", "inputs_embeds"), (), {"use_cache": False}),
}


@torch.compiler.disable  # host-side group sizes: traced, every new set of lengths would recompile
def _packed_rows(module: torch.nn.Module, lay: PackedLayout, *args: Any, **kwargs: Any) -> Any:
    """The model's own forward once per group of equal-length sequences, each sequence a row of its own."""
    name = type(module).__name__
    token_names, refused, switches = _ROWS[name]
    named = _bind(module, args, kwargs)
    _refuse_cache(module, named)
    _refuse_encoder(module, named, "encoder_hidden_states")
    for key in refused:
        if named.get(key) is not None:
            raise PackingDisabledError(f"{name} got {key} with a packed batch; it relates tokens across the packed "
                                       f"sequences of a row; pass the sequences unpacked")
    present = [k for k in token_names if named.get(k) is not None]
    for key in present:
        _check_shape(lay, tuple(named[key].shape), name)
    params = guards.parameters(type(module).forward)
    named.update({k: v for k, v in switches.items() if k in params})
    named.update({k: False for k in ("output_attentions", "output_hidden_states") if k in params})
    named["return_dict"] = True
    last: list[Any] = []

    def run(length: int, count: int, *blocks: torch.Tensor) -> torch.Tensor:
        out = type(module).forward(module, **{**named, **dict(zip(present, blocks, strict=True))})
        last[:] = [out]
        ngram = getattr(out, "last_hidden_state_ngram", None)
        if ngram is None:
            return out.last_hidden_state
        # ProphetNet's n-gram streams, (m, ngram * L, D): carried per token next to the main stream
        streams = ngram.view(count, -1, length, ngram.shape[-1]).transpose(1, 2)
        return torch.cat([out.last_hidden_state.unsqueeze(2), streams], dim=2)

    merged = bucketed(run, lay, *(named[k] for k in present), exact=True)
    if merged.dim() == 3:
        return type(last[0])(last_hidden_state=merged)
    batch, _, _, width = merged.shape
    ngram = merged[:, :, 1:].transpose(1, 2).reshape(batch, -1, width)
    return type(last[0])(last_hidden_state=merged[:, :, 0], last_hidden_state_ngram=ngram)


def _check_reformer(module: torch.nn.Module) -> None:
    config = module.config
    if getattr(config, "axial_pos_embds", False):
        rows = int(np.prod(config.axial_pos_shape))
        raise UnsupportedModelError(
            f"{type(module).__name__}.embeddings.position_embeddings (AxialPositionEmbeddings) cannot restart per "
            f"packed sequence: in training mode it ignores position_ids and accepts only rows of exactly "
            f"prod(config.axial_pos_shape) = {rows} tokens, so a shorter sequence has no training step of its own "
            f"for a packed row to equal (and the reversible layers compute gradients in training mode only); "
            f"config.axial_pos_embds=False (learned positions) can be packed"
        )


# ---- installation --------------------------------------------------------------------------------------------------


def _patch(module: torch.nn.Module, state: Any, packed: Callable[..., Any]) -> None:
    patch(module, "_padfree_positions", _Installed(state, packed), _patched_forward)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one instance of :data:`CLASSES` boundary-exact for packed batches of the model ``state`` belongs to;
    returns a one-line description of what its packed forward does. Idempotent."""
    name = type(module).__name__
    if name not in CLASSES:
        raise UnsupportedModelError(f"{name} is not a module padfree's position family knows")
    if name in _TABLES:
        _check_table(module)
        offset = getattr(module, "offset", 0)
        kind = "sinusoidal" if "Sinusoidal" in name else "learned"
        description = f"{kind} position table: the positions of each sequence alone" + (
            f" (offset {offset})" if offset else "")
        _patch(module, state, _packed_table)
        return description
    if name == "XGLMSinusoidalPositionalEmbedding":
        description = "sinusoidal positions: its own table at the positions of each sequence alone"
        _patch(module, state, _packed_indexed)
        return description
    if name == "TrOCRSinusoidalPositionalEmbedding":
        description = "sinusoidal positions counted from each sequence's start (padding tokens skipped)"
        _patch(module, state, _packed_counted)
        return description
    if name in _ATTENTIONS:
        return _install_attention(module, state)
    if name == "OpenAIGPTModel":
        return _install_openai(module, state)
    if name == "ReformerModel":
        _check_reformer(module)
    description = "its own forward per group of equal-length sequences, each sequence a row of its own"
    _patch(module, state, _packed_rows)
    return description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_positions", extra=("_padfree_cap",))
