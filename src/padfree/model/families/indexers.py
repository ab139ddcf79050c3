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
from collections.abc import Callable
from typing import Any

import torch

from padfree.errors import InvalidLayoutError, UnsupportedModelError
from padfree.model.families import replay
from padfree.model.packed import PackedLayout
from padfree.model.state import unpatch


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

    Run by :mod:`padfree.model.families.replay`: the forward's first parameter is the ``(B, T, ...)`` hidden state,
    gathered per group. ``attention_mask`` (``(B | 1, ..., T, T)``), ``position_ids`` (``(B | 1, T)``) and
    ``position_embeddings`` (a ``(B | 1, T, ...)`` table, or a tuple / dict of them) are cut to the group's first
    ``L`` positions; ``None``, bools and numbers pass unchanged; any other tensor is refused at the call.

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

#: module class name -> what this family makes exact (read by :func:`padfree.configure_packing`)
CLASSES: dict[str, str] = {name: spec.description for name, spec in SPECS.items()}


def _patched_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, one run per group otherwise
    (:func:`padfree.model.families.replay.run`)."""
    return replay.run(self, self._padfree_indexed, args, kwargs)


# the row's (B | 1, ..., T, T) causal mask -> the mask of L tokens alone (its top-left L x L block)
_cut_mask = replay.cut_mask


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


def _stitch_selection(per_group: list[Any], lay: PackedLayout, by: str) -> Any:
    # a selection every group returned (not the None of a layer that hands none on) becomes the row's
    if all(isinstance(v, torch.Tensor) for v in per_group):
        return merge_selection(per_group, lay, by)
    return replay.shared(per_group, lay, by)


# ---- installation ------------------------------------------------------------------------------------------------


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one instance of :data:`CLASSES` boundary-exact for packed batches of the model ``state`` belongs to;
    returns the one-line description of its packed forward. Idempotent."""
    name = type(module).__name__
    spec = SPECS.get(name)
    if spec is None:
        raise UnsupportedModelError(f"{name} is not a sparse-attention module padfree knows how to run per sequence")
    selection = (spec.selection[0],) if spec.selection else ()
    hidden = replay.check(module, state, (*spec.tokens, *selection),
                          reads="the rotary tables and causal mask its model builds for a whole row",
                          receives="restarting positions and no mask")
    plan = replay.Plan(state, hidden, "length" if spec.selects(module) else "bucket",
                       optional=(*spec.tokens, *selection),
                       stitch={spec.selection[1]: _stitch_selection} if spec.selection else {})
    replay.record(module, "_padfree_indexed", plan, _patched_forward)
    return spec.description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_indexed")
