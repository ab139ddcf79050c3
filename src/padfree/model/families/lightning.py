"""Lightning attention (MiniMax): decayed linear attention in blocks, its carried state reset at every segment start.

``MiniMaxLightningAttention`` computes ``out[t] = sum_{s <= t} exp(-slope * (t - s)) (q[t] . k[s]) v[s]`` per head in
blocks: pairs inside a block directly (with a decay table), pairs across blocks through a ``K^T V`` state carried
from block to block. In a packed row both run across the boundary between two sequences. Installed, the module runs
transformers' own forward for an ordinary batch and, for a packed one, the same projections, gate and norm around
:func:`segment_lightning_attention`, which

- masks every intra-block pair of two different segments;
- lets a token read the carried state only when it continues the segment the state belongs to;
- hands on, at the end of a block, only its last segment's keys, dropping the old state when that segment started
  inside the block.

So each token sees exactly the terms its sequence alone gives it, with transformers' operations and decay tables
(autocast and bf16 weights act on them as they do on a lone sequence). A packed batch never has a cache.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)  # (batch, heads, tokens, head dim)
>>> slope = torch.tensor([0.5, 0.25]).view(2, 1, 1)
>>> packed = segment_lightning_attention(q, k, v, slope, 2, lay)  # blocks of 2: the boundary falls inside one
>>> alone = segment_lightning_attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], slope, 2,
...                                     PackedLayout.from_position_ids(torch.tensor([[0, 1]])))
>>> bool(torch.allclose(packed[:, :, 3:], alone, atol=1e-6))  # the second sequence sees nothing of the first
True
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch
import torch.nn.functional as F

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import guards, rebind
from padfree.model.packed import PackedLayout
from padfree.model.state import current_layout, hooks_live, patch, unpatch

#: the classes this module makes boundary-exact (read by :func:`padfree.configure_packing`)
CLASSES: dict[str, str] = {
    "MiniMaxLightningAttention": "lightning attention (MiniMax): carried state reset and cross-segment pairs masked "
                                 "at every segment start",
}

# Every name MiniMaxLightningAttention.forward reads (attributes and globals) in the transformers versions proven:
# the packed forward below re-states that forward around the segment primitive, so a forward that reads anything
# else, or no longer reads one of them, has changed shape and is refused until it is proven again.
_PROVEN_NAMES = frozenset({
    "shape", "block_size", "act_fn", "qkv_proj", "apply_mask_to_padding_states", "reshape", "num_attention_heads",
    "head_dim", "torch", "split", "transpose", "get_linear_cache", "layer_idx", "zeros", "device", "dtype", "range",
    "min", "query_decay", "key_decay", "diagonal_decay", "exp", "slope_rate", "matmul", "append", "cat", "norm", "F",
    "sigmoid", "output_gate", "out_proj", "set_linear_cache",
})
_DESCRIPTION = ("lightning attention: exact torch blocked linear attention, carried state reset and cross-segment "
                "pairs masked at every segment start")


def decay_tables(slope_rate: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query, key, diagonal)`` decay tables of one block, as MiniMaxLightningAttention builds its buffers."""
    steps = torch.arange(block_size, device=slope_rate.device) + 1
    query = torch.exp(-slope_rate * steps[:, None])
    key = torch.exp(-slope_rate * (block_size - steps[:, None]))
    diff = slope_rate * (steps[:, None] - steps[None, :])[None, None]
    return query, key, torch.exp(torch.where(diff >= 0, -diff, float("-inf")))


def segment_lightning_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slope_rate: torch.Tensor, block_size: int,
    lay: PackedLayout, *, decays: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Lightning attention with its carried state restarting at every segment: the exact torch reference.

    Args:
        query, key: ``(B, H, T, Dk)``; value: ``(B, H, T, Dv)``.
        slope_rate: ``(H, 1, 1)`` per-head decay rate; block_size: tokens per block.
        lay: the batch's :class:`~padfree.model.packed.PackedLayout`.
        decays: the module's ``(query_decay (H, block, 1), key_decay (H, block, 1), diagonal_decay
            (1, H, block, block))`` buffers (default: built from ``slope_rate`` the same way).

    Returns:
        ``(B, H, T, Dv)``: transformers' blocked computation (one step per block, as transformers loops) over the
        packed rows, with the intra-block pairs of two segments masked, the carried state read only by the tokens
        of the segment it belongs to, and the state handed on holding only the block's last segment.
    """
    query_decay, key_decay, diagonal_decay = decays if decays is not None else decay_tables(slope_rate, block_size)
    batch, heads, seq_len, dim = key.shape
    seg = lay.seq_idx
    state = torch.zeros(batch, heads, dim, value.shape[-1], device=value.device, dtype=value.dtype)
    outs = []
    for start in range(0, seq_len, block_size):
        end = min(start + block_size, seq_len)
        n = end - start
        q, k, v, s = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], seg[:, start:end]
        other = (s[:, :, None] != s[:, None, :]).unsqueeze(1)  # (B, 1, n, n): pairs of two segments
        scores = torch.matmul(q, k.transpose(-1, -2))
        intra = torch.matmul((scores * diagonal_decay[:, :, :n, :n]).masked_fill(other, 0), v)
        inter = torch.matmul(q * query_decay[:, :n], state)
        carried = seg[:, start - 1] if start else torch.full_like(s[:, 0], -1)  # the segment the state belongs to
        inter = inter.masked_fill((s != carried[:, None])[:, None, :, None], 0)
        outs.append(inter + intra)
        last = s[:, -1]  # the segment whose state the next block reads
        keys = (k * key_decay[:, -n:]).masked_fill((s != last[:, None])[:, None, :, None], 0)
        kept = (state * torch.exp(-slope_rate * n)).masked_fill((carried != last)[:, None, None, None], 0)
        state = kept + torch.matmul(keys.transpose(-1, -2), v)
    return torch.cat(outs, dim=-2)


@functools.cache
def _check_forward(cls: type) -> None:
    """Refuse a forward that reads other names than the proven one (transformers changed its shape)."""
    names = set(rebind.unwrap_function(cls.forward).__code__.co_names)
    extra, missing = sorted(names - _PROVEN_NAMES), sorted(_PROVEN_NAMES - names)
    if extra or missing:
        raise UnsupportedModelError(
            f"{cls.__name__}.forward (transformers {guards.installed()}) is not the lightning attention padfree "
            f"proved exact (it reads {extra} in addition, and no longer reads {missing}); it cannot be made "
            f"packing-exact until it is proven again")


def _packed_forward(self: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                    lay: PackedLayout) -> tuple[torch.Tensor, None]:
    """The module's own projections, gate and norm around :func:`segment_lightning_attention`."""
    batch, seq_len, _ = hidden_states.shape
    module_globals = sys.modules[rebind.unwrap_function(type(self).forward).__module__].__dict__
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    qkv = module_globals["apply_mask_to_padding_states"](qkv, attention_mask)
    qkv = qkv.reshape(batch, seq_len, self.num_attention_heads, 3 * self.head_dim)
    query, key, value = (x.transpose(1, 2) for x in torch.split(qkv, self.head_dim, dim=3))
    out = _segment_call(query, key, value, self, lay)
    out = out.transpose(1, 2).reshape(batch, seq_len, self.num_attention_heads * self.head_dim)
    out = self.norm(out)
    out = F.sigmoid(self.output_gate(hidden_states)) * out
    return self.out_proj(out), None


@torch.compiler.disable
def _segment_call(query, key, value, module, lay):
    # outside torch.compile's graphs: the boundaries are read on the host, and traced, every new set of lengths would
    # be a recompile (the projections around it still compile)
    return segment_lightning_attention(query, key, value, module.slope_rate, module.block_size, lay,
                                       decays=(module.query_decay, module.key_decay, module.diagonal_decay))


@dataclasses.dataclass(eq=False)
class _Lightning:
    state: Any


@torch.compiler.disable
def _layout_of(info: _Lightning, hidden: Any, who: str) -> PackedLayout | None:
    if hooks_live(info.state) and isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
        return current_layout(info.state, hidden, who)
    return None


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, the packed one otherwise."""
    info: _Lightning = self._padfree_lightning
    hidden = args[0] if args else kwargs.get("hidden_states")
    lay = _layout_of(info, hidden, type(self).__name__)
    if lay is None:
        return type(self).forward(self, *args, **kwargs)
    named = guards.bind(type(self).forward, (self, *args), kwargs) or {}
    cache = guards.find_cache({k: v for k, v in named.items() if v is not self}, type(self).forward)
    if cache is not None:
        raise PackingDisabledError(f"{type(self).__name__} got {cache} with a packed batch; packed training never "
                                   f"uses a cache (pass use_cache=False)")
    return _packed_forward(self, hidden, named.get("attention_mask"), lay)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one lightning-attention instance boundary-exact for packed batches of the model ``state`` belongs to;
    returns the one-line description of the implementation. Idempotent: installing again rebinds the state."""
    name = type(module).__name__
    if name not in CLASSES:
        raise UnsupportedModelError(f"{name} is not a lightning attention padfree knows how to make packing-exact")
    _check_forward(type(module))
    patch(module, "_padfree_lightning", _Lightning(state), _forward)
    return _DESCRIPTION


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_lightning")
