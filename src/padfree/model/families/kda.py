"""Kimi delta attention (KDA): the gated delta rule with a per-channel decay, after a short causal convolution.

``KimiLinearDeltaAttention`` (kimi_linear) and ``BailingHybridDeltaAttention`` (bailing_hybrid) run a depthwise
causal convolution over q, k and v and then ``chunk_kimi_delta_attention``, a recurrent state carried from chunk to
chunk. In a packed row both would run across the boundary between two sequences. Installed, such a module runs
transformers' own forward for an ordinary batch and, for a packed one, the same forward with

- ``causal_conv1d_fn`` -> :func:`padfree.model.scans.segment_causal_conv1d` (zero history at every segment start);
- ``chunk_kimi_delta_attention`` -> :func:`segment_kimi_delta_attention`: every segment its own row, starting from
  a zero state — transformers' own chunked rule, run on the segments (those of one padded length in one call);
- the one-token cached-decode functions refuse: a packed batch never has a cache.

Projections, the forget gate, the gated norm and every model-specific multiplier stay transformers' code. On CUDA,
flash-linear-attention's ``chunk_kda`` with ``cu_seqlens`` is not wired yet: the exact reference runs.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> q, k, v = torch.randn(3, 1, 5, 2, 4).unbind(0)  # (batch, tokens, heads, head dim)
>>> g, beta = -torch.rand(1, 5, 2, 4), torch.rand(1, 5, 2)
>>> packed = segment_kimi_delta_attention(q, k, v, g, beta, lay, use_qk_l2norm_in_kernel=True)
>>> alone = segment_kimi_delta_attention(q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:], beta[:, 3:],
...                                      PackedLayout.from_position_ids(torch.tensor([[0, 1]])),
...                                      use_qk_l2norm_in_kernel=True)
>>> bool(torch.allclose(packed[:, 3:], alone, atol=1e-6))  # the second sequence sees nothing of the first
True
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import guards, rebind, scans
from padfree.model.families import scan_mixers
from padfree.model.packed import PackedLayout

#: the classes this module makes boundary-exact (read by :func:`padfree.configure_packing`)
CLASSES: dict[str, str] = {
    "KimiLinearDeltaAttention": "Kimi delta attention (kimi_linear): conv taps and KDA state reset at every segment "
                                "start",
    "BailingHybridDeltaAttention": "Kimi delta attention (bailing_hybrid): conv taps and KDA state reset at every "
                                   "segment start",
}

_CHUNK_RULE = "chunk_kimi_delta_attention"
_SIGNATURES = {
    "causal_conv1d_fn": ("hidden_states", "weight", "bias", "activation"),
    _CHUNK_RULE: ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel"),
}
_DESCRIPTION = ("Kimi delta attention: scan: exact torch chunked KDA (transformers' own rule), every segment from a "
                "zero state (flash-linear-attention's chunk_kda is not wired: the reference runs on every device); "
                "conv: exact torch conv, taps reset at segment starts")


def _default_rule() -> Callable:
    from transformers.models.kimi_linear import modeling_kimi_linear

    return modeling_kimi_linear.chunk_kimi_delta_attention


def segment_kimi_delta_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    lay: PackedLayout, *, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False,
    chunk_rule: Callable | None = None,
) -> torch.Tensor:
    """Kimi delta attention with the state restarting from zero at every segment: the exact torch reference.

    Args:
        query, key: ``(B, T, H, Dk)``; value: ``(B, T, H, Dv)``.
        g: ``(B, T, H, Dk)`` per-channel log-decay (``<= 0``); beta: ``(B, T, H)``.
        lay: the batch's :class:`~padfree.model.packed.PackedLayout`.
        chunk_size: the chunk of segments longer than it (64, as transformers); a shorter segment runs as one chunk
            of its length rounded up to :data:`padfree.model.scans.SHORT_STEP` (the chunked rule is exact for any
            chunk, and a short one costs a fraction of a 64-token one).
        use_qk_l2norm_in_kernel: L2-normalise queries and keys first, in fp32, as the models ask.
        chunk_rule: the model's ``chunk_kimi_delta_attention`` (default: kimi_linear's).

    Returns:
        ``(B, T, H, Dv)`` in ``query``'s dtype: every segment gathered into a row of its own (zeros after its end,
        which a causal rule never reads), the segments of one padded length in one call of ``chunk_rule`` with a
        zero initial state — what each sequence gets alone — and scattered back.
    """
    rule = chunk_rule or _default_rule()
    batch, seq_len, heads = value.shape[:3]
    total = batch * seq_len

    def flat(x: torch.Tensor) -> torch.Tensor:  # (B, T, ...) -> (B*T + 1, ...): a zero row for the slots past an end
        x = x.reshape(total, *x.shape[2:])
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    fq, fk, fv, fg, fb = (flat(x) for x in (query, key, value, g, beta))
    pieces, dest = [], []
    for _, chunk, gather, valid, to in scans.gdr_groups(lay, chunk_size):
        out, _ = rule(fq[gather], fk[gather], fv[gather], g=fg[gather], beta=fb[gather], chunk_size=chunk,
                      initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        pieces.append(out.reshape(-1, heads, out.shape[-1])[valid])
        dest.append(to)
    out = torch.cat(pieces)
    result = out.new_empty(total, heads, out.shape[-1]).index_copy(0, torch.cat(dest), out)
    return result.view(batch, seq_len, heads, -1)


@torch.compiler.disable
def _packed_chunk_rule(rule: Callable, query, key, value, g, beta, chunk_size=64, initial_state=None,
                       output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    call = rebind.current_call(_CHUNK_RULE)
    if initial_state is not None or output_final_state:
        raise PackingDisabledError("a packed batch reached a Kimi delta attention with a recurrent state from a "
                                   "cache; packed training never uses a cache (pass use_cache=False)")
    return segment_kimi_delta_attention(query, key, value, g, beta, call.lay, chunk_size=chunk_size,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_rule=rule), None


@functools.cache
def _packed(cls: type) -> tuple[Any, Callable]:
    """``(family, packed forward)`` of KDA class ``cls``: its forward, primitives replaced (the chunked rule by the
    per-segment run of the class's own rule)."""
    module_globals = sys.modules[rebind.unwrap_function(cls.forward).__module__].__dict__
    if _CHUNK_RULE not in module_globals:
        raise UnsupportedModelError(f"{cls.__name__}: its module has no {_CHUNK_RULE} (transformers "
                                    f"{guards.installed()}); refusing rather than guessing")
    replace = {
        "causal_conv1d_fn": scan_mixers.packed_conv1d,
        "causal_conv1d_update": rebind.no_decode,
        _CHUNK_RULE: functools.partial(_packed_chunk_rule, module_globals[_CHUNK_RULE]),
        "recurrent_kimi_delta_attention": rebind.no_decode,
    }
    required = ("causal_conv1d_fn", _CHUNK_RULE)
    family = rebind.Primitives("Kimi delta attention", replace, _SIGNATURES, required)
    return family, rebind.packed_forward(cls, replace, _SIGNATURES, required)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one instance of :data:`CLASSES` boundary-exact for packed batches of the model ``state`` belongs to;
    returns the one-line description of the implementation."""
    name = type(module).__name__
    if name not in CLASSES:
        raise UnsupportedModelError(f"{name} is not a Kimi delta attention padfree knows how to make packing-exact")
    family, packed = _packed(type(module))
    return rebind.install_mixer(module, state, kind="kda", family=family, packed=packed, description=_DESCRIPTION)


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return rebind.uninstall(model)
