"""Boundary-exact attention functions, registered in transformers' attention and mask interfaces.

:func:`padfree.configure_packing` switches a model's ``config._attn_implementation`` to one of the names below.
Each name is a pair registered with transformers (no file of transformers is edited, no global function replaced):

- an **attention function** (``AttentionInterface``): with a :class:`~padfree.model.packed.PackedLayout` in its
  keyword arguments (the configured model's forward hook puts it there for a packed batch) it computes exact
  block-diagonal causal attention from the layout; without one it hands the call, untouched, to the backend it
  wraps — so ordinary padded batches and generation with a cache run exactly transformers' own code;
- a **mask function** (``AttentionMaskInterface``): ``None`` during a packed forward (no ``T x T`` mask is ever
  built for it), the wrapped backend's own mask otherwise.

An attention function called during a packed forward with neither the layout nor a mask refuses
(:class:`~padfree.PackingDisabledError`): a module on the way down dropped the layout (StableLM's decoder layer hands
its attention no keyword arguments), and the wrapped backend would attend across the whole row.

Backends (``BACKENDS``), for a packed batch of ``B`` rows of ``T`` tokens, ``H`` heads, segments of lengths ``n_i``
grouped in buckets of padded length ``L`` (:func:`padfree.model.packed.bucket_length`, ``L < 1.25 n`` above 32):

- ``padfree_sdpa`` — one ``scaled_dot_product_attention`` per bucket (``is_causal``, or an ``L x L`` window mask);
  eager math per bucket where the layer softcaps or has sinks (SDPA cannot express them). Extra memory per layer
  call: the gathered q/k/v (3 x the layer input); scores only on the math path, ``H x sum(L_i^2)`` floats.
- ``padfree_eager`` — transformers' eager formula (scale, softcap, mask, sinks, fp32 softmax, dropout) per bucket:
  ``H x sum(L_i^2)`` floats of scores, never ``H x T^2``.
- ``padfree_flex`` — ``flex_attention`` with a ``BlockMask`` built from the segment ids: ``O(B x (T/128)^2)`` ints.
  CUDA only: ``configure_packing`` refuses it on the CPU (no flex backward there, and torch's compiled CPU kernel
  is wrong for head dims of 8 and 16).
- ``padfree_varlen`` — CUDA only: ``torch.nn.attention.varlen.varlen_attn`` over the flattened stream with
  ``cu_seqlens``; nothing beyond flat views. A layer whose layout has bidirectional blocks runs as ``padfree_sdpa``.

Bidirectional blocks (Gemma images, PaliGemma's prefix: :meth:`PackedLayout.with_token_types`) cost an
``m x L x L`` boolean mask per bucket that holds one, built once per layout and window; a layout without blocks runs
the causal code above unchanged.

A dense block-diagonal mask would cost ``B x T^2`` booleans plus ``B x H x T^2`` scores on the math path; the bucket
form costs ``sum(L_i^2)``, which for 32 sequences in an 8k row is about 1/25 of it.

>>> from padfree.model.attention import BACKENDS
>>> sorted(BACKENDS)
['padfree_eager', 'padfree_flex', 'padfree_sdpa', 'padfree_varlen']
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from padfree.errors import BackendUnavailableError, PackingDisabledError, UnsupportedModelError
from padfree.model.packed import PackedLayout
from padfree.model.sharded import ShardedLayout

__all__ = ["BACKENDS", "LAYOUT_KWARG", "register_backends"]

LAYOUT_KWARG = "padfree_layout"
"""Name of the keyword argument that carries the :class:`PackedLayout` from the model's forward hook to attention."""

# Set by the forward hook of a configured model for the duration of a packed forward: the mask functions then skip
# building a mask nobody reads (transformers would otherwise build a dense B x T x T one from the position_ids).
PACKED_FORWARD: ContextVar[bool] = ContextVar("padfree_packed_forward", default=False)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registered backend: ``name`` (the ``_attn_implementation`` value), ``base`` (the transformers backend
    it wraps for unpacked calls), what it supports, and a one-line description for reports."""

    name: str
    base: str
    softcap: bool
    sinks: bool
    dropout: bool
    device: str | None
    doc: str


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("padfree_sdpa", "sdpa", True, True, True, None,
                "torch SDPA per bucket of equal-length segments (eager math per bucket for softcap / sinks)"),
        Backend("padfree_eager", "eager", True, True, True, None,
                "transformers' eager formula per bucket of equal-length segments"),
        Backend("padfree_flex", "flex_attention", True, True, False, None,
                "flex_attention with a BlockMask built from the segment ids"),
        Backend("padfree_varlen", "sdpa", False, False, False, "cuda",
                "torch.nn.attention.varlen.varlen_attn over the flattened stream (CUDA)"),
    )
}


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(m, Hkv, L, D) -> (m, Hkv * groups, L, D)``; each key/value head serves ``groups`` query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _eager_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *, scaling: float, dropout: float,
    training: bool, softcap: float | None, sinks: torch.Tensor | None, bias: torch.Tensor | None = None,
    token_sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' eager attention on ``(m, H, L, D)`` blocks with a boolean ``(L, L)`` mask; ``(m, H, L, D)`` out.

    Order of operations as in the modeling files: scale, position bias (``(m, H | 1, L, L)``), softcap, additive
    mask, sink logits (one per head, gpt_oss; or one per query, ``token_sinks`` ``(m, H, L, 1)``, Inkling2), fp32
    softmax, drop the sink column, dropout, matmul.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if bias is not None:
        scores = scores + bias
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if token_sinks is not None:  # Inkling2's order: the sink column joined, then the softmax in fp32
        probs = F.softmax(torch.cat([scores, token_sinks.to(scores.dtype)], dim=-1).float(), dim=-1)
        probs = probs[..., :-1].to(q.dtype)
    elif sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=training)
    return torch.matmul(probs, v)


def _bias_block(bias: torch.Tensor, slots: torch.Tensor, seq_len: int, count: int, length: int) -> torch.Tensor:
    """The ``(m, H | 1, L, L)`` blocks of a row's ``(B | 1, H | 1, T, T)`` position bias that a bucket's segments
    attend over: the bias between every two of a segment's own tokens, where the row put it."""
    idx = slots.view(count, length)
    rows = (idx[:, :1] // seq_len) if bias.shape[0] > 1 else torch.zeros_like(idx[:, :1])
    cols = idx % seq_len
    return bias[rows[:, :, None], :, cols[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)  # (m, L, L, H) first


def _bucketed(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lay: PackedLayout, *,
    math: bool, scaling: float, dropout: float, sliding_window: int | None, softcap: float | None,
    sinks: torch.Tensor | None, bias: torch.Tensor | None = None, token_sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of every segment on its own: ``(B, H, T, D)`` q/k/v in, ``(B, T, H, D)`` out; ``bias``:
    the row's additive ``(B | 1, H | 1, T, T)`` position bias, of which each segment reads its own block;
    ``token_sinks``: ``(B, H, T, 1)`` sink logits, one per query."""
    batch, heads, seq_len, _ = query.shape
    plan = lay.buckets()
    flat = [x.transpose(1, 2).reshape(batch * seq_len, x.shape[1], x.shape[3]) for x in (query, key, value)]
    if token_sinks is not None:  # (B, H, T, 1) -> a (B·T, H, 1) tensor gathered with the queries
        flat.append(token_sinks.transpose(1, 2).reshape(batch * seq_len, heads, 1))
    parts = [x.index_select(0, plan.slots).split(plan.sizes) for x in flat]  # one gather per tensor
    slots = plan.slots.split(plan.sizes)
    # bidirectional blocks: an (m, 1, L, L) mask for each bucket that holds one (None: the causal path below)
    joint = lay.bucket_masks(sliding_window) if lay.blocks_apply(sliding_window) else (None,) * len(plan.lengths)
    outs = []
    math = math or softcap is not None or sinks is not None or token_sinks is not None
    for i, (length, count) in enumerate(zip(plan.lengths, plan.counts, strict=True)):
        q, k, v, *rest = (p[i].view(count, length, *p[i].shape[1:]).transpose(1, 2) for p in parts)  # (m, H, L, D)
        block = None if bias is None else _bias_block(bias, slots[i], seq_len, count, length).to(q.dtype)
        if math:
            allowed = lay.local_mask(length, sliding_window) if joint[i] is None else joint[i]
            out = _eager_block(q, k, v, allowed, scaling=scaling, dropout=dropout, training=module.training,
                               softcap=softcap, sinks=sinks, bias=block, token_sinks=rest[0] if rest else None)
        else:
            mask = None if sliding_window is None and block is None else lay.local_mask(length, sliding_window)
            mask = mask if joint[i] is None else joint[i]
            if block is not None:  # SDPA takes one float mask: the bias, and -inf where a key may not be seen
                mask = block.masked_fill(~mask, float("-inf"))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0, is_causal=mask is None,
                scale=scaling, enable_gqa=q.shape[1] != k.shape[1],
            )
        outs.append(out.transpose(1, 2).reshape(count * length, heads, value.shape[3]))
    return torch.cat(outs).index_select(0, plan.inverse).view(batch, seq_len, heads, value.shape[3])


def _flex(module, query, key, value, lay, *, scaling, dropout, sliding_window, softcap, sinks, kwargs):
    from transformers.integrations.flex_attention import flex_attention_forward

    if sinks is not None and query.device.type == "cpu":
        raise BackendUnavailableError(
            f"{type(module).__name__} has attention sinks, which flex_attention cannot apply on the CPU; use "
            f"backend='padfree_sdpa' or 'padfree_eager'"
        )
    return flex_attention_forward(module, query, key, value, lay.block_mask(sliding_window), scaling=scaling,
                                  softcap=softcap, s_aux=sinks, dropout=dropout, **kwargs)[0]


def _varlen(module, query, key, value, lay, *, scaling, dropout, sliding_window, softcap, sinks):
    from torch.nn.attention.varlen import varlen_attn

    if softcap is not None or sinks is not None or dropout:
        raise PackingDisabledError(
            f"{type(module).__name__} needs softcapping, sinks or attention dropout, which varlen_attn does not "
            f"offer; configure the model with backend='padfree_sdpa'"
        )
    if lay.blocks_apply(sliding_window):  # varlen_attn masks by offsets and a window only: SDPA per bucket
        return _bucketed(module, query, key, value, lay, math=False, scaling=scaling, dropout=dropout,
                         sliding_window=sliding_window, softcap=None, sinks=None)
    batch, heads, seq_len, _ = query.shape
    flat = [x.transpose(1, 2).reshape(batch * seq_len, x.shape[1], x.shape[3]) for x in (query, key, value)]
    cu, longest = lay.cu_seqlens, lay.max_seqlen
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, 0)
    out = varlen_attn(*flat, cu, cu, longest, longest, scale=scaling, window_size=window,
                      enable_gqa=heads != key.shape[1])
    return out.view(batch, seq_len, heads, value.shape[3])


@torch.compiler.disable  # host-side bucket sizes: traced, every new set of lengths would recompile (see configure)
def packed_forward(
    backend: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    lay: PackedLayout, *, scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
    softcap: float | None = None, s_aux: torch.Tensor | None = None, position_bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, **kwargs: Any,
) -> torch.Tensor:
    """Exact packed attention under ``backend``: ``(B, H, T, D)`` query and ``(B, Hkv, T, D)`` key/value in,
    ``(B, T, H, D)`` out (the layout transformers' attention functions return).

    Sequence ``i`` of row ``b`` attends causally to itself only; ``sliding_window`` W keeps keys with
    ``q - k < W`` (transformers' convention); ``softcap`` applies ``c * tanh(s / c)`` to the scaled scores;
    ``s_aux`` (``(H,)``, gpt_oss) adds one sink logit per head to every softmax; ``position_bias``
    (``(B | 1, H | 1, T, T)``, Inkling's relative bias; SDPA and eager) is added to the scaled scores, each
    sequence reading the block between its own tokens; ``sinks`` (``(B, H, T, 1)``, Inkling2) adds one sink logit
    per query. GQA/MQA: ``H % Hkv == 0``.

    A layout with bidirectional blocks (:meth:`PackedLayout.with_token_types`) also lets a query see the keys of its
    own block, composed with the window as its :class:`~padfree.model.packed.BlockRule` says, on the layers the
    rule names: an ``(m, 1, L, L)`` mask per bucket that holds a block (SDPA and eager; buckets without one keep
    ``is_causal``), ``mask_mod`` reading the block ids (flex). ``padfree_varlen`` runs such a call as
    ``padfree_sdpa`` (varlen_attn cannot express blocks).
    """
    who = type(module).__name__
    lay.check_tokens(query.transpose(1, 2), f"{who} attention")
    lay.check_tokens(key.transpose(1, 2), f"{who} attention keys")  # cross-attention: refused
    if position_bias is not None:
        _check_bias(position_bias, module, query, lay, backend, softcap=softcap, sinks=s_aux)
    if sinks is not None:
        _check_token_sinks(sinks, module, query, backend, softcap=softcap, s_aux=s_aux)
    why = _not_causal(module, kwargs.get("is_causal"), lay)
    if why is not None:
        raise PackingDisabledError(why)
    extra = _unapplied(kwargs, backend, module)
    if extra is not None:
        raise PackingDisabledError(
            f"{type(module).__name__} hands its attention function {extra}, which padfree's packed attention does not "
            f"apply; refusing rather than computing another attention (this model needs a padfree family for "
            f"{type(module).__name__})")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    opts = dict(scaling=scaling, dropout=dropout, sliding_window=sliding_window, softcap=softcap, sinks=s_aux)
    if backend == "padfree_flex":
        return _flex(module, query, key, value, lay, kwargs=kwargs, **opts)
    if backend == "padfree_varlen":
        return _varlen(module, query, key, value, lay, **opts)
    return _bucketed(module, query, key, value, lay, math=backend == "padfree_eager", bias=position_bias,
                     token_sinks=sinks, **opts)


def _check_token_sinks(sinks: Any, module: torch.nn.Module, query: torch.Tensor, backend: str, *,
                       softcap: float | None, s_aux: torch.Tensor | None) -> None:
    """PackingDisabledError for per-query sink logits the packed path cannot apply (each query reads its own)."""
    who = type(module).__name__
    batch, heads, seq_len = query.shape[0], query.shape[1], query.shape[2]
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (batch, heads, seq_len, 1):
        raise PackingDisabledError(
            f"{who} hands its attention function sinks of shape {tuple(getattr(sinks, 'shape', ()))}; the packed "
            f"path applies one sink logit per query, ({batch}, {heads}, {seq_len}, 1)")
    if backend in ("padfree_flex", "padfree_varlen") or softcap is not None or s_aux is not None:
        raise PackingDisabledError(
            f"{who} hands its attention function a sink logit per query, which padfree applies on the eager path "
            f"alone (not with {backend}, softcapping or per-head sinks); configure the model with "
            f"backend='padfree_eager'")


def _check_bias(bias: Any, module: torch.nn.Module, query: torch.Tensor, lay: PackedLayout, backend: str, *,
                softcap: float | None, sinks: torch.Tensor | None) -> None:
    """PackingDisabledError for a position bias the packed path cannot apply as the module's own attention does.

    Only the block between a sequence's own tokens is read: exact for a bias of the distance between two tokens
    (and of their states), which the proof checks per model. Inkling's global layers also scale their queries and
    this bias by ``log(position / log_scaling_n_floor)`` counted from the row's start: from the floor on, a
    sequence packed late in a row would be scaled as if it began at the row's start, so such rows are refused.
    """
    who = type(module).__name__
    batch, heads, seq_len = query.shape[0], query.shape[1], query.shape[2]
    if (not isinstance(bias, torch.Tensor) or bias.dim() != 4 or tuple(bias.shape[-2:]) != (seq_len, seq_len)
            or bias.shape[0] not in (1, batch) or bias.shape[1] not in (1, heads)):
        raise PackingDisabledError(
            f"{who} hands its attention function a position_bias of shape {tuple(getattr(bias, 'shape', ()))}; the "
            f"packed path applies a (B | 1, H | 1, T, T) bias over the row's {seq_len} tokens only")
    if backend in ("padfree_varlen", "padfree_flex") or softcap is not None or sinks is not None:
        # flex could read the bias in a score_mod, but no proof has run it: refused until one does
        raise PackingDisabledError(
            f"{who} hands its attention function a position_bias, which padfree adds per bucket on padfree_sdpa and "
            f"padfree_eager only (not with {backend}, softcapping or sinks); configure the model with "
            f"backend='padfree_sdpa'")
    floor = getattr(getattr(module, "config", None), "log_scaling_n_floor", None)
    if floor is not None and not getattr(module, "is_sliding", False) and lay.shape[1] > floor:
        raise PackingDisabledError(
            f"{who} scales its queries and position bias by the log of each token's position in the row beyond "
            f"log_scaling_n_floor={floor}: in a packed row of {lay.shape[1]} tokens a sequence would be scaled by "
            f"where it sits in the row, not by its own positions; pack rows of at most {floor} tokens")


@torch.compiler.disable  # the exchanges and the host-side layout stay outside compiled graphs, as packed_forward
def sharded_forward(
    backend: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    lay: ShardedLayout, *, s_aux: torch.Tensor | None = None, **kwargs: Any,
) -> torch.Tensor:
    """:func:`packed_forward` for this rank's slice of a row split across a sequence-parallel group (Ulysses):
    ``(B, H, S, D)`` query and ``(B, Hkv, S, D)`` key/value in, ``(B, S, H, D)`` out.

    The slices are exchanged for heads — each rank gets the whole row for ``H / P`` of the heads — the row's exact
    packed attention runs on them with the row's layout, and the outputs are exchanged back. Key/value heads the
    group size does not divide are repeated per query head first (each query head reads its own group's); sinks
    are per head and go with them. Bidirectional blocks of the row (``lay.full.blocks``) apply as in the unsplit
    call: every rank attends over the whole row.
    """
    who = type(module).__name__
    lay.check_tokens(query.transpose(1, 2), f"{who} attention")
    if kwargs.get("position_bias") is not None:
        raise UnsupportedModelError(
            f"{who} hands its attention function a position_bias it computed over this rank's slice alone; padfree "
            f"has no sequence-parallel path for it (the bias of the whole row is never built); run this model "
            f"without sequence parallelism")
    heads, kv_heads = query.shape[1], key.shape[1]
    lay.heads_of(heads, who, "query heads")
    if kv_heads % lay.sp.size:
        key, value = _repeat_kv(key, heads // kv_heads), _repeat_kv(value, heads // kv_heads)
    q, k, v = (lay.to_heads(x, seq_dim=2, head_dim=1) for x in (query, key, value))
    if s_aux is not None:
        s_aux = lay.head_slice(s_aux)
    out = packed_forward(backend, module, q, k, v, lay.full, s_aux=s_aux, **kwargs)  # (B, T, H/P, D)
    return lay.to_tokens(out, seq_dim=1, head_dim=2)


# keyword arguments that spell the batch's boundaries or positions (which the packed path applies through its layout:
# flash_attention_forward reads them to find sequences) or switch outputs and normalise the loss (transformers'
# TransformersKwargs): a base function that reads one of these does not compute another attention for one sequence
_ROUTING = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
                      "cache_position", "output_attentions", "output_hidden_states", "output_router_logits",
                      "use_cache", "layer_idx", "target_dtype", "num_items_in_batch", "shift_labels"})

# how a function may look a key up in its ``**kwargs`` without handing them on: ``kwargs.get("k")``,
# ``kwargs.pop("k")``, ``kwargs["k"]``, ``"k" in kwargs``
_LOOKUPS = frozenset({"get", "pop"})
_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})


@functools.lru_cache(maxsize=256)
def _reads(function: Callable) -> frozenset[str] | None:
    """The keyword arguments ``function`` can read: its named parameters and every key it looks up by a constant
    in its ``**kwargs``; None when that cannot be told (no Python code of its own, a wrapper, ``**kwargs`` handed on
    to another function or used any other way), and then any name may be read.

    Found from the signature and the bytecode, not from a list of names: whatever a transformers release adds to
    its attention functions is read where it is read.
    """
    code = getattr(function, "__code__", None)
    if code is None or hasattr(function, "__wrapped__"):
        return None
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    names = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    varkw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    if varkw is None:
        return frozenset(names)
    if varkw in code.co_cellvars:  # a nested function reads it: not followed
        return None
    ops = list(dis.get_instructions(code))
    for i, op in enumerate(ops):
        if "FAST" not in op.opname or varkw not in (op.argval if isinstance(op.argval, tuple) else (op.argval,)):
            continue
        if op.opname not in _LOADS or op.argval != varkw:
            return None  # stored to, deleted, or one of two locals a 3.13+ instruction loads at once: not followed
        prev, nxt, after = (ops[j] if 0 <= j < len(ops) else None for j in (i - 1, i + 1, i + 2))
        key = None
        if nxt is not None and nxt.opname in ("LOAD_METHOD", "LOAD_ATTR") and nxt.argval in _LOOKUPS:
            key = after.argval if after is not None and after.opname == "LOAD_CONST" else None
        elif nxt is not None and nxt.opname == "LOAD_CONST" and after is not None and (
                after.opname == "BINARY_SUBSCR" or (after.opname == "BINARY_OP" and after.argrepr == "[]")):
            key = nxt.argval
        elif nxt is not None and nxt.opname == "CONTAINS_OP" and prev is not None and prev.opname == "LOAD_CONST":
            key = prev.argval
        if not isinstance(key, str):
            return None  # handed on, iterated, copied, or a key not known before the call
        names.add(key)
    return frozenset(names)


def _base_reads(backend: str, module: torch.nn.Module) -> frozenset[str] | None:
    """What the function transformers would run for ``backend``'s base on ``module`` reads (see :func:`_reads`)."""
    spec = BACKENDS.get(backend)
    try:
        function = _base_attention(spec, module) if spec is not None else None
    except (AttributeError, KeyError):  # no eager function in the modeling file, no such registered backend
        return None
    return None if function is None else _reads(function)


def _unapplied(kwargs: dict[str, Any], backend: str, module: torch.nn.Module) -> str | None:
    """A keyword argument that would change the attention and that the packed path does not apply, described;
    None when there is none.

    The packed path is causal (``is_causal`` is decided with the layout, :func:`_not_causal`) and applies its own
    named parameters and the boundaries. A tensor among the rest is refused when the function transformers runs for the
    backend's base (``sdpa_attention_forward``, the modeling file's ``eager_attention_forward``,
    ``flex_attention_forward``) reads it — or when what that function reads cannot be told. A tensor it ignores
    (``labels``, ``logits_to_keep``: a model's forward hands its ``**kwargs`` down through its layers) cannot change
    the attention that function computes, so it is no reason to refuse.
    """
    reads: frozenset[str] | None = None
    looked = False
    for name, value in kwargs.items():
        if value is None or name in _ROUTING:
            continue
        if name == "is_causal":  # decided with the layout (_not_causal)
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if not looked:
            reads, looked = _base_reads(backend, module), True
        if reads is None or name in reads:
            return f"{name}= (a tensor of shape {tuple(value.shape)})"
    return None


# the block rules whose blocks are the whole of a model's departure from causal attention although its attention
# modules are built with is_causal=False: PaliGemma (a prefix-LM; its text config's use_bidirectional_attention)
# makes its attention causal only through the mask it builds from token_type_ids (causal, or both in the sample's
# prefix), which the layout's blocks lay out per sample. Not Gemma 3's rule: with use_bidirectional_attention its
# mask is bidirectional everywhere, whatever its image blocks.
_PREFIX_RULES = frozenset({"paligemma"})


def _not_causal(module: torch.nn.Module, is_causal: Any, lay: PackedLayout) -> str | None:
    """Why a packed call of ``module`` would not compute the attention the model defines, where that attention is not
    causal (``is_causal`` handed to the call, else the module's own, False); None when the packed path's causal
    attention plus the layout's blocks is that attention.

    transformers' SDPA function reads ``module.is_causal`` when it is handed no mask: a module built bidirectional
    then attends both ways over everything it sees, and only a mask the model builds makes it causal. In a packed
    forward padfree's mask functions build none, so such a module is exact only where the layout carries the blocks
    of the mask its model would build (:data:`_PREFIX_RULES`, laid out from the model's token types by the
    multimodal hook); anywhere else it is refused. PaliGemma without ``token_type_ids`` is such a case: transformers
    itself computes a different attention per backend for a sequence alone (SDPA: the mask dropped, both ways over
    the whole sequence; eager: causal)."""
    if is_causal is None:
        # the module's own flag counts where its config declares the attention bidirectional: a decoder built with
        # is_causal=False whose model always builds a causal mask (BigBird-Pegasus) is causal, as the sweep proves
        config = getattr(module, "config", None)
        bidirectional = getattr(module, "is_causal", True) is False and \
            getattr(config, "use_bidirectional_attention", None) is True
    else:
        bidirectional = is_causal is False
    if not bidirectional or (lay.block_rule is not None and lay.block_rule.name in _PREFIX_RULES):
        return None
    who = type(module).__name__
    return (f"{who} runs with is_causal=False (bidirectional attention) — its config's use_bidirectional_attention "
            f"or the call's is_causal — and its model laid out no mask that makes it causal in this packed forward "
            f"(padfree builds none): transformers' attention for one "
            f"sequence alone depends on the mask the model builds (PaliGemma: from token_type_ids — 0 the "
            f"bidirectional prefix of image and prompt, 1 the causal suffix —; without them SDPA attends both ways "
            f"over the whole sequence, eager causally); pass token_type_ids as the processor returns them, or pass "
            f"these batches unpacked")


def _base_attention(backend: Backend, module: torch.nn.Module) -> Callable:
    """The function transformers would have called for ``backend.base`` (eager lives in each modeling file)."""
    if backend.base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[backend.base]


SHARDED_CALLS = "_padfree_sharded_calls"
"""Attribute counting an attention module's calls of padfree's split attention: under sequence parallelism, a
module whose forward ends without one computed attention over its slice alone (see
:func:`padfree.model.install.install_packing`)."""

OWNER_ATTR = "_padfree_owner"
"""Attribute ``configure_packing`` sets on every attention module: the :class:`~padfree.model.state.PackingState` of
its model, from which the layout of the forward in flight is read when a decoder layer does not hand its keyword
arguments on (Nemotron's, ...)."""


def _owner_layout(module: torch.nn.Module, query: torch.Tensor) -> PackedLayout | None:
    """The layout of the owning model's forward this call belongs to (None for an ordinary one), for attention a
    decoder layer called without padfree's keyword argument; an activation-checkpointing recompute reads its own
    forward's (:mod:`padfree.model.flight`)."""
    from padfree.model.state import current_layout, hooks_live

    state = module.__dict__.get(OWNER_ATTR)
    if state is None or not hooks_live(state):
        return None
    return current_layout(state, query.transpose(1, 2), f"{type(module).__name__} attention")


def _attention_function(backend: Backend) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        lay = kwargs.pop(LAYOUT_KWARG, None)
        if lay is None and attention_mask is None:
            lay = _owner_layout(module, query)
        if attention_mask is not None and (lay is not None or PACKED_FORWARD.get()):
            # padfree's mask functions build no mask in a packed forward, so this one was built by the model
            # itself (a bias, a window, a causal mask over the whole row): the packed path would drop it, the
            # base backend would apply it across the row's sequences
            raise PackingDisabledError(
                f"{type(module).__name__} was handed an attention mask its model built itself "
                f"({_what_mask(attention_mask)}) in a packed forward; padfree's packed attention applies the row's "
                f"boundaries, not a mask, and would drop what this one adds; this model needs a padfree family for "
                f"{type(module).__name__}"
            )
        if lay is None:
            if PACKED_FORWARD.get():
                # the layout got lost on the way down (a decoder layer that does not pass its keyword arguments
                # on): the base backend would attend causally across the whole packed row
                raise PackingDisabledError(
                    f"{type(module).__name__} was called in a packed forward without padfree's layout (a module "
                    f"between the model and this attention does not hand its keyword arguments on), so it would "
                    f"attend across every sequence of the row; this model needs a padfree family for "
                    f"{type(module).__name__}"
                )
            return _base_attention(backend, module)(module, query, key, value, attention_mask, **kwargs)
        if isinstance(lay, ShardedLayout):
            module.__dict__[SHARDED_CALLS] = module.__dict__.get(SHARDED_CALLS, 0) + 1
            return sharded_forward(backend.name, module, query, key, value, lay, **kwargs), None
        return packed_forward(backend.name, module, query, key, value, lay, **kwargs), None

    attention.__name__ = attention.__qualname__ = f"{backend.name}_attention"
    attention.__doc__ = f"padfree attention '{backend.name}': {backend.doc}; unpacked calls go to '{backend.base}'."
    return attention


def _what_mask(mask: Any) -> str:
    """A mask described for a refusal: a tensor by its dtype and shape, anything else (a BlockMask) by its type."""
    if isinstance(mask, torch.Tensor):
        return f"a {str(mask.dtype).removeprefix('torch.')} tensor of shape {tuple(mask.shape)}"
    return f"a {type(mask).__name__}"


def _mask_function(backend: Backend) -> Callable:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = ALL_MASK_ATTENTION_FUNCTIONS[backend.base]

    def mask(*args, **kwargs):
        return None if PACKED_FORWARD.get() else base(*args, **kwargs)

    mask.__name__ = mask.__qualname__ = f"{backend.name}_mask"
    return mask


_registered = False


def register_backends() -> None:
    """Register every padfree backend with transformers (idempotent). Only models configured to use one of these
    names are affected."""
    global _registered
    if _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for backend in BACKENDS.values():
        AttentionInterface.register(backend.name, _attention_function(backend))
        AttentionMaskInterface.register(backend.name, _mask_function(backend))
    _registered = True
