"""Attention over a token's own states, across blocks instead of tokens: Inkling2's block attention residuals.

``Inkling2BlockAttentionResidual`` (and Inkling2-Loop's message retrieval) mixes the outputs of a token's earlier
blocks with learned queries, calling transformers' attention interface with the blocks where the tokens would be:
no token ever reads another, so a packed row needs nothing from it. It is claimed here so that it runs as
transformers runs it — outside the packed forward's bookkeeping, whose attention functions would otherwise look for
the row's layout in it. Under sequence parallelism each rank runs it on its own tokens, which is all it reads.

>>> sorted(CLASSES)
['Inkling2BlockAttentionResidual', 'Inkling2LoopBlockAttentionResidual', 'Inkling2LoopMessageAttentionResidual']
"""

from __future__ import annotations

from typing import Any

import torch

from padfree.model import guards
from padfree.model.attention import PACKED_FORWARD
from padfree.model.state import patch, unpatch

_WHAT = "attention over each token's own block outputs (no token reads another): transformers' forward"
_BLOCKS = ("self", "block_states", "partial_block_states")
# class -> the forward's parameters padfree proved
_PARAMETERS: dict[str, tuple[str, ...]] = {
    "Inkling2BlockAttentionResidual": _BLOCKS,
    "Inkling2LoopBlockAttentionResidual": _BLOCKS,
    "Inkling2LoopMessageAttentionResidual": (*_BLOCKS, "loop_layer_idx"),
}
CLASSES: dict[str, str] = dict.fromkeys(_PARAMETERS, _WHAT)
#: per token: a rank's slice is all it reads
SEQUENCE_PARALLEL = frozenset(CLASSES)


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: the class's forward, with the attention functions told this is no packed
    forward (its "sequence" is a token's blocks)."""
    token = PACKED_FORWARD.set(False)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        PACKED_FORWARD.reset(token)


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one block attention residual run as transformers runs it inside a packed forward. Idempotent."""
    described = guards.proven_module(module, "depth", CLASSES, _PARAMETERS)
    patch(module, "_padfree_depth", state, _forward)
    return described


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_depth")
