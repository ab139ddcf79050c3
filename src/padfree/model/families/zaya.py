"""ZAYA's compressed convolutional attention projection, run per sequence.

``ZayaCCAProjection`` makes the query, key and value of ZAYA's attention from more than the token itself: two causal
convolutions over the projected queries and keys (a depthwise one, then a grouped one), and a value half taken from
the previous token. In a packed row both reach across the boundary into the previous sequence. For a packed batch
the projection runs its own forward once per group of segments (:func:`padfree.model.packed.per_bucket`), every
segment a row of its own starting from the zero history a sequence alone starts from — transformers' code, dtypes
and autocast behaviour, by construction; slots past a segment's end come after its tokens, and everything here is
causal, so no real token sees them. The attention itself goes through transformers' interface, to padfree's packed
backends.

>>> CLASSES["ZayaCCAProjection"].split(":")[0]
'q/k convolutions and the delayed value half restarted at every sequence start'
"""

from __future__ import annotations

from typing import Any

import torch

from padfree.errors import PackingDisabledError
from padfree.model import guards
from padfree.model.packed import per_bucket
from padfree.model.state import current_layout, hooks_live, patch, unpatch

CLASSES: dict[str, str] = {
    "ZayaCCAProjection": "q/k convolutions and the delayed value half restarted at every sequence start: its own "
                         "forward per bucket of sequences",
}
_PARAMETERS = ("self", "hidden_states", "cache", "conv_mask")


def _packed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, one run per group otherwise."""
    state = self._padfree_zaya
    forward = type(self).forward
    named = guards.bind(forward, (self, *args), kwargs) or {}
    hidden = named.get("hidden_states")
    lay = current_layout(state, hidden, type(self).__name__) if hooks_live(state) and isinstance(
        hidden, torch.Tensor) else None
    if lay is None:
        return forward(self, *args, **kwargs)
    named.pop("self", None)
    cache = guards.find_cache(named, forward)
    if cache is not None:
        raise PackingDisabledError(f"{type(self).__name__} got {cache} with a packed batch; packed training never "
                                   f"uses a cache (pass use_cache=False)")
    if named.get("conv_mask") is not None:
        raise PackingDisabledError(f"{type(self).__name__} got a conv_mask with a packed batch: a padding mask over "
                                   f"the row is not what each sequence alone gets; pass the boundaries alone")
    return _per_sequence(self, hidden, lay)


@torch.compiler.disable  # host-side group sizes: traced, every new set of lengths would recompile
def _per_sequence(module: torch.nn.Module, hidden: torch.Tensor, lay: Any) -> tuple[torch.Tensor, ...]:
    heads: list[int] = []

    def run(length: int, count: int, block: torch.Tensor) -> torch.Tensor:
        q, k, v = type(module).forward(module, block, None)  # (m, L, heads_x, head_dim) each
        heads[:] = [q.shape[2], k.shape[2], v.shape[2]]
        return torch.cat([q, k, v], dim=2)

    merged = per_bucket(run, lay, hidden)
    return tuple(merged.split(heads, dim=2))


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one ``ZayaCCAProjection`` run per sequence for packed batches of the model ``state`` belongs to."""
    described = guards.proven_module(module, "zaya", CLASSES, dict.fromkeys(CLASSES, _PARAMETERS))
    patch(module, "_padfree_zaya", state, _packed_forward)
    return described


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_zaya")
