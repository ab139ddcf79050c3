"""Sparse attention that selects keys from the whole row (DSA indexers, DeepSeek-V4 compressors, QSA), run per sequence.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2, dots3) lets a lightning indexer score every key
of the row and keep the top ``k`` per query, folded into the attention mask; GLM and HY-V4 hand the selection on to
the next layer. DeepSeek-V4 compresses windows of tokens counted from the row's first token and picks the top ``k``
compressed windows; Qwen4-Exp's QSA pools blocks of visible keys and scores them. In a packed row every one of these
reads across the boundaries — keys of other sequences compete in the top ``k``, windows straddle two sequences, the
selection is built over a ``T x T`` mask padfree's attention never sees — and Qwen4-Exp's per-layer n-gram
embeddings hash the tokens before a sequence's first one.

:func:`padfree.configure_packing` routes every instance of :data:`CLASSES` to :func:`install`, which patches the
instance so that a packed batch runs **the module's own forward** once per group of sequences, each sequence a row of
its own with the inputs it has alone: the row's rotary tables and causal mask cut to its length (the model builds
them for positions ``0 .. T-1``), its own tokens. The selection therefore equals what the sequence alone selects —
keys of other sequences never enter the scores, a sequence shorter than ``k`` keeps all of its keys, and ties break
as they do alone, because a module that selects runs on groups of one exact length (the same ``topk`` on the same
row). Modules that select nothing (dots3's sliding layers, DeepSeek-V4's sliding-only layers, GLM / HY-V4 layers
reusing the previous selection, the n-gram embeddings) run per bucket of similar lengths: their padded slots come
after every real key. A selection handed from layer to layer travels as a ``(B, T, k)`` tensor of in-sequence
indices. An ordinary batch runs transformers' own forward, untouched.

>>> import torch, transformers
>>> from padfree.model.install import install_packing, unconfigure_packing
>>> cfg = transformers.DeepseekV32Config(
...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
...     num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
...     v_head_dim=8, index_topk=2, index_n_heads=2, index_head_dim=16, mlp_layer_types=["dense"])
>>> model = transformers.DeepseekV32ForCausalLM(cfg).eval()
>>> print(install_packing(model).mixers["model.layers.0.self_attn"])
DSA: the lightning indexer's top-k per sequence alone (own forward per group of equal-length sequences)
>>> packed = model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
>>> alone = model(input_ids=torch.tensor([[8, 9, 10]]))
>>> bool(torch.allclose(packed.logits[0, 3:], alone.logits[0], atol=1e-5))
True
>>> unconfigure_packing(model)
True
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import InvalidLayoutError, PackingDisabledError, UnsupportedModelError
from padfree.model import guards, mixers
from padfree.model.packed import PackedLayout, per_bucket
from padfree.model.state import current_layout, hooks_live

__all__ = ["CLASSES", "SPECS", "Spec", "install", "merge_selection", "uninstall"]


def _always(module: torch.nn.Module) -> bool:
    return True


def _never(module: torch.nn.Module) -> bool:
    return False


def _has_indexer(module: torch.nn.Module) -> bool:
    return getattr(module, "indexer", None) is not None


def _has_compressor(module: torch.nn.Module) -> bool:
    return getattr(module, "compressor", None) is not None


@dataclasses.dataclass(frozen=True)
class Spec:
    """How the instances of one module class run per group of packed sequences.

    The forward's first parameter is the ``(B, T, ...)`` hidden state, gathered per group. ``attention_mask``
    (``(B | 1, ..., T, T)``), ``position_ids`` (``(B | 1, T)``) and ``position_embeddings`` (a ``(B | 1, T, ...)``
    table, or a tuple / dict of them) are cut to the group's first ``L`` positions; ``None``, bools and numbers pass
    unchanged; any other tensor is refused at the call.

    Attributes:
        description: one line for the configured model's report.
        selects: whether an instance picks keys by rank (a top-k); such an instance runs on groups of one exact
            length, so its ``topk`` sees exactly the row the sequence has alone.
        tokens: further per-token arguments, ``(B, T, ...)`` or None, gathered like the hidden state.
        selection: ``(argument, output index)`` of a ``(B, T, k)`` selection of in-sequence key indices handed from
            layer to layer (the argument may be None: the first layer computes its own).
    """

    description: str
    selects: Callable[[torch.nn.Module], bool] = _always
    tokens: tuple[str, ...] = ()
    selection: tuple[str, int] | None = None


_DSA = Spec("DSA: the lightning indexer's top-k per sequence alone (own forward per group of equal-length sequences)")
_DSA_SHARED = Spec("DSA: the lightning indexer's top-k per sequence alone, handed on to the layers that reuse it (own "
                   "forward per group of equal-length sequences; per bucket on reusing layers)",
                   selects=_has_indexer, selection=("prev_topk_indices", 2))
SPECS: dict[str, Spec] = {
    "DeepseekV32Attention": _DSA,
    "AXK2Attention": _DSA,
    "GlmMoeDsaAttention": _DSA_SHARED,
    "HYV4Attention": _DSA_SHARED,
    "Dots3NoteTextAttention": Spec(
        "MLA with a DSA indexer on indexed layers: top-k per sequence alone (own forward per group of equal-length "
        "sequences; per bucket on full and sliding layers)", selects=_has_indexer),
    "DeepseekV4Attention": Spec(
        "compressed windows counted from each sequence's start and the indexer's top-k per sequence alone (own "
        "forward per group of equal-length sequences; per bucket on sliding-only layers)", selects=_has_compressor),
    "Qwen4ExpTextAttention": Spec(
        "QSA: blocks of each sequence's own keys pooled and ranked per sequence alone (own forward per group of "
        "equal-length sequences)"),
    "Qwen4ExpTextPLELayer": Spec(
        "per-layer n-gram embeddings and dilated convolution from each sequence's own tokens (own forward per bucket "
        "of sequences)", selects=_never, tokens=("input_ids", "conv_mask")),
}

# GatedDeltaNets of the same hybrids, on the primitives mixers.py makes boundary-exact
_GDN_CLASSES: dict[str, str] = {"Qwen4ExpTextGatedDeltaNet": "gated-delta-net"}

#: module class name -> what this family makes exact (read by :func:`padfree.configure_packing`)
CLASSES: dict[str, str] = {
    **{name: spec.description for name, spec in SPECS.items()},
    "Qwen4ExpTextGatedDeltaNet": "GatedDeltaNet (Qwen3.5's): conv taps and delta-rule state reset at every segment "
                                 "start",
}


@dataclasses.dataclass(eq=False)
class _Installed:
    """What a patched instance carries: the configured model's state, its spec and grouping."""

    state: Any
    spec: Spec
    by: str  # "length" for an instance that selects, "bucket" otherwise
    hidden: str  # the name of the forward's first parameter


def _patched_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, one run per group otherwise."""
    info: _Installed = self._padfree_indexed
    hidden = args[0] if args else kwargs.get(info.hidden)
    lay = None
    if hooks_live(info.state) and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
        lay = current_layout(info.state, hidden, type(self).__name__)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    return _replay(self, info, lay, args, kwargs)


# ---- what one group of sequences gets: the row's tables cut to its length -----------------------------------------


def _cut_rows(value: torch.Tensor, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], torch.Tensor]:
    """A ``(B | 1, T, ...)`` per-position table -> its first ``L`` positions for ``m`` sequences."""
    batch, seq_len = lay.shape
    if value.dim() < 2 or value.shape[1] != seq_len or value.shape[0] not in (1, batch):
        raise PackingDisabledError(f"{who} got {name} of shape {tuple(value.shape)} with a packed batch of {batch} x "
                                   f"{seq_len}; padfree expected one entry per position of a row")
    return lambda n, m: value[:1, :n].expand(m, n, *value.shape[2:])


def _cut_table(value: Any, lay: PackedLayout, name: str, who: str) -> Callable[[int, int], Any]:
    """Rotary tables: a tensor, a tuple ``(cos, sin)`` or a dict of those per rope type, cut alike."""
    if isinstance(value, torch.Tensor):
        return _cut_rows(value, lay, name, who)
    if isinstance(value, Mapping):
        cuts = {key: _cut_table(item, lay, f"{name}[{key!r}]", who) for key, item in value.items()}
        return lambda n, m: {key: cut(n, m) for key, cut in cuts.items()}
    if isinstance(value, (tuple, list)):
        cuts = [_cut_table(item, lay, name, who) for item in value]
        return lambda n, m: type(value)(cut(n, m) for cut in cuts)
    raise PackingDisabledError(f"{who} got {name} ({type(value).__name__}) with a packed batch; padfree expected "
                               f"rotary tables (tensors, tuples or dicts of them)")


def _cut_mask(value: torch.Tensor, lay: PackedLayout, who: str) -> Callable[[int, int], torch.Tensor]:
    """The row's ``(B | 1, ..., T, T)`` causal mask -> its top-left ``L x L`` block: the mask of ``L`` tokens alone
    (causal and sliding-window masks depend on positions only, and every row's positions run ``0 .. T-1``)."""
    batch, seq_len = lay.shape
    if value.dim() < 3 or tuple(value.shape[-2:]) != (seq_len, seq_len) or value.shape[0] not in (1, batch):
        raise PackingDisabledError(f"{who} got an attention_mask of shape {tuple(value.shape)} with a packed batch of "
                                   f"{batch} x {seq_len}; padfree expected the (B, ..., T, T) mask of a row")
    return lambda n, m: value[:1, ..., :n, :n].expand(m, *value.shape[1:-2], n, n)


def _rope_limit(module: torch.nn.Module) -> tuple[str, int] | None:
    """``(rope type, longest row)`` when the model's rotary rescales by the longest position of a call (``dynamic``,
    ``longrope``): the row's table would then not be the table a shorter sequence builds alone."""
    params = getattr(getattr(module, "config", None), "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    for entry in (params, *(v for v in params.values() if isinstance(v, dict))):
        if entry.get("rope_type") in ("dynamic", "longrope"):
            limit = entry.get("original_max_position_embeddings") or getattr(module.config, "max_position_embeddings",
                                                                             0)
            return entry["rope_type"], int(limit)
    return None


def merge_selection(per_group: list[torch.Tensor], lay: PackedLayout, by: str) -> torch.Tensor:
    """Per-group selections ``(m, L, k_i)`` (in-sequence key indices, in the order of ``lay.buckets(by)``) -> one
    ``(B, T, max k_i)`` tensor; a narrower group repeats its first pick, which selects nothing new (the consumers
    scatter the indices into a mask).

    >>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    >>> groups = [torch.tensor([[[0, 0], [0, 1], [2, 1]]]), torch.tensor([[[0], [1]]])]  # lengths 3, then 2
    >>> merge_selection(groups, lay, "length")[0].tolist()
    [[0, 0], [0, 1], [2, 1], [0, 0], [1, 1]]
    """
    plan = lay.buckets(by)
    width = max(part.shape[-1] for part in per_group)
    flat = []
    for part, length, count in zip(per_group, plan.lengths, plan.counts, strict=True):
        if part.shape[:2] != (count, length):
            raise InvalidLayoutError(f"a selection of shape {tuple(part.shape)} came back from a group of {count} "
                                     f"sequences of {length} tokens")
        pad = part[..., :1].expand(count, length, width - part.shape[-1])
        flat.append(torch.cat([part, pad], dim=-1).reshape(count * length, width))
    batch, seq_len = lay.shape
    return torch.cat(flat).index_select(0, plan.inverse).view(batch, seq_len, width)


@torch.compiler.disable  # host-side group sizes: traced, every new set of lengths would recompile
def _replay(module: torch.nn.Module, info: _Installed, lay: PackedLayout, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The module's own forward once per group of sequences, with the inputs each sequence has alone."""
    who, spec, forward = type(module).__name__, info.spec, type(module).forward
    named = guards.bind(forward, (module, *args), kwargs)
    if named is None:  # a call that does not fit: transformers raises its own error
        return forward(module, *args, **kwargs)
    named.pop(next(iter(guards.parameters(forward))), None)
    cache = guards.find_cache(named, forward)
    if cache is not None:
        raise PackingDisabledError(f"{who} got {cache} with a packed batch; packed training never uses a cache "
                                   f"(pass use_cache=False)")
    rope = _rope_limit(module)
    if rope is not None and lay.shape[1] > rope[1]:
        raise PackingDisabledError(
            f"{who} reads {rope[0]} RoPE tables, which rescale by the longest position of a call: a packed row of "
            f"{lay.shape[1]} tokens would rescale the sequences shorter than {rope[1]} alone; pack rows of at most "
            f"{rope[1]} tokens")
    if named.get("output_attentions"):
        named["output_attentions"] = False  # per-group weights have no (B, H, T, T) form
    token_names = [info.hidden, *spec.tokens, *([spec.selection[0]] if spec.selection else [])]
    tokens: dict[str, torch.Tensor] = {}
    for name in token_names:
        value = named.pop(name, None)
        if value is None and name != info.hidden:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != lay.shape:
            raise InvalidLayoutError(f"{who} got {name} of shape {tuple(getattr(value, 'shape', ()))} but the packed "
                                     f"layout of this forward is {lay.shape}")
        tokens[name] = value
    cuts: dict[str, Callable[[int, int], Any]] = {}
    for name, value in list(named.items()):
        if value is None or isinstance(value, (bool, int, float, str)):
            continue
        if name == "attention_mask" and isinstance(value, torch.Tensor):
            cuts[name] = _cut_mask(value, lay, who)
        elif name == "position_ids" and isinstance(value, torch.Tensor):
            cuts[name] = _cut_rows(value, lay, name, who)
        elif name == "position_embeddings":
            cuts[name] = _cut_table(value, lay, name, who)
        else:
            raise PackingDisabledError(
                f"{who} got {name} ({type(value).__name__}) with a packed batch; padfree runs {who} once per group of "
                f"sequences and does not know what a sequence alone gets for {name}")
        del named[name]
    outputs: list[Any] = []
    names = list(tokens)

    def run(length: int, count: int, *blocks: torch.Tensor) -> torch.Tensor:
        call = {**named, **{name: cut(length, count) for name, cut in cuts.items()},
                **dict(zip(names[1:], blocks[1:], strict=True))}
        out = forward(module, blocks[0], **call)
        outputs.append(out)
        return out[0] if isinstance(out, tuple) else out

    merged = per_bucket(run, lay, *tokens.values(), by=info.by)
    if not isinstance(outputs[0], tuple):
        return merged
    rest = []
    for i in range(1, len(outputs[0])):
        values = [out[i] for out in outputs]
        if spec.selection is not None and i == spec.selection[1] and all(isinstance(v, torch.Tensor) for v in values):
            rest.append(merge_selection(values, lay, info.by))
        else:  # per-group attention weights have no row form; a shared object (None) passes
            rest.append(values[0] if all(v is values[0] for v in values) else None)
    return (merged, *rest)


# ---- installation ------------------------------------------------------------------------------------------------


@functools.cache
def _gdn_forward(cls: type) -> Callable:
    from padfree.model.families import linear

    family = mixers.FAMILIES[_GDN_CLASSES[cls.__name__]]
    return linear.packed_forward(cls, family.replace, family.signatures, family.required)


def _install_gdn(module: torch.nn.Module, state: Any) -> str:
    from padfree.model.families import linear

    key = _GDN_CLASSES[type(module).__name__]
    on_cuda = any(p.is_cuda for p in module.parameters())
    conv_on, scan_on, description = mixers.describe_mixer(key, "auto", on_cuda)
    return linear.install_mixer(module, state, kind=key, family=mixers.FAMILIES[key],
                                packed=_gdn_forward(type(module)), description=description, conv_kernel=conv_on,
                                scan_kernel=scan_on)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one instance of :data:`CLASSES` boundary-exact for packed batches of the model ``state`` belongs to;
    returns the one-line description of its packed forward. Idempotent."""
    name = type(module).__name__
    if name in _GDN_CLASSES:
        return _install_gdn(module, state)
    spec = SPECS.get(name)
    if spec is None:
        raise UnsupportedModelError(f"{name} is not a sparse-attention module padfree knows how to run per sequence")
    if state.backend != "none":
        # the model's hook then sits on the decoder and hands restarting positions and no mask down: the row's
        # tables would no longer be those of positions 0 .. T-1, which the groups are cut from
        raise UnsupportedModelError(
            f"{name} runs per sequence on the rotary tables and causal mask its model builds for a whole row, but this "
            f"model also has attention layers on padfree's {state.backend} backend, which receive restarting "
            f"positions and no mask; padfree proved {name} only in models whose attention it runs per sequence "
            f"throughout")
    params = guards.parameters(type(module).forward)
    needed = [*spec.tokens, *([spec.selection[0]] if spec.selection else [])]
    missing = [arg for arg in needed if arg not in params]
    if len(params) < 2 or missing:
        raise UnsupportedModelError(f"{name}.forward takes {params}, not the arguments padfree proved ({missing} "
                                    f"missing); refusing rather than guessing")
    module._padfree_indexed = _Installed(state, spec, "length" if spec.selects(module) else "bucket", params[1])
    module.forward = types.MethodType(_patched_forward, module)
    return spec.description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    done = False
    for sub in model.modules():
        if "_padfree_indexed" in sub.__dict__:
            del sub._padfree_indexed
            sub.__dict__.pop("forward", None)
            done = True
        elif type(sub).__name__ in _GDN_CLASSES and "_padfree_mixer" in sub.__dict__:
            done |= mixers.uninstall(sub)
    return done
