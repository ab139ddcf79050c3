"""ALiBi attention per sequence: BLOOM, MPT and Falcon (``alibi=True``) add the biases each sequence has alone.

ALiBi adds ``slope_h * position(key)`` to every attention score. These models build the bias for the whole row —
BLOOM from its attention mask's cumulative sum (``arange`` without a mask), MPT from a fixed table sliced to the key
length (``(k - n + 1) * slope``: counted back from the sequence's *last* key), Falcon from a bfloat16 ``arange``
folded into its float mask — and compute attention in their own code (BLOOM's ``baddbmm`` with ``beta`` / ``alpha``
and an fp32 softmax, MPT's fp32 bias added to the scores, Falcon's fp32 upcast, or SDPA with the bias as its mask),
never through transformers' attention interface. In a packed row the positions run on across the boundaries, so
every sequence after the first gets another bias, and the causal mask spans the row.

Each instance is run by :mod:`padfree.model.families.attention_variants`: its own forward once per group of
sequences, with the first ``L`` positions of the row's bias and mask — exactly what a sequence of ``L`` tokens builds
alone, since its positions start at 0 (queries never see the slots repeated after a segment's end). MPT runs per
group of one exact length, because its bias is counted from the last key. Falcon without ALiBi (RoPE) runs the same
way, with the first ``L`` rows of its rotary table.

>>> import torch, transformers
>>> from padfree.model.install import install_packing, unconfigure_packing
>>> cfg = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
>>> model = transformers.BloomForCausalLM(cfg).eval()
>>> print(install_packing(model).mixers["transformer.h.0.self_attention"])
its own forward per bucket of sequences, with each sequence's ALiBi bias (positions from 0)
>>> packed = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]])).logits
>>> alone = model(input_ids=torch.tensor([[8, 9]])).logits
>>> bool(torch.allclose(packed[0, 3:], alone[0], atol=1e-5))
True
>>> unconfigure_packing(model)
True
"""

from __future__ import annotations

from typing import Any

import torch

from padfree.model.families import attention_variants
from padfree.model.families.attention_variants import Replay

_FALCON = Replay("its own forward per bucket of sequences, with each sequence's ALiBi bias or rotary table (positions "
                 "from 0)", heads=("alibi",))
REPLAYS: dict[str, Replay] = {
    "BloomAttention": Replay("its own forward per bucket of sequences, with each sequence's ALiBi bias (positions "
                             "from 0)", tokens=("residual",), heads=("alibi",)),
    "MptAttention": Replay("its own forward per group of sequences of one length, with each sequence's ALiBi bias "
                           "(counted from its last key)", same=("position_bias",), by="length"),
    "FalconAttention": _FALCON,
    "FalconFlashAttention2": _FALCON,
}
#: module class name -> what running it per sequence makes exact
CLASSES: dict[str, str] = {name: spec.description for name, spec in REPLAYS.items()}


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one instance of :data:`CLASSES` run per sequence for packed batches (see the module docstring)."""
    return attention_variants.install(module, state, REPLAYS)


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return attention_variants.uninstall(model)
