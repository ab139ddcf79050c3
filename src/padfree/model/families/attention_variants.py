"""Attention that padfree's attention backends cannot reach, run per sequence with the inputs each sequence has alone.

padfree makes attention exact by handing its packed layout to the attention function transformers' interface calls
(:mod:`padfree.model.attention`). Some attention modules never get there, or compute more than the attention
function sees:

- they write their own attention instead of calling the interface (GPT-NeoX-Japanese; BLOOM, MPT and Falcon, the
  ALiBi models of :mod:`padfree.model.families.alibi`);
- their decoder layer does not hand its keyword arguments on, so the layout never arrives (StableLM);
- they compute from the row's positions inside the module: Llama-4 scales its queries on NoPE layers by a temperature
  of ``arange`` over the row, and its chunked layers count chunks from the row's start;
- they derive the attention from the tokens of the whole row: Doge's dynamic mask attention keeps the top-k keys of
  every row, and its CDMoE router reshapes the flattened batch so that one token's experts depend on others.

:func:`padfree.configure_packing` routes every instance of :data:`CLASSES` to :func:`install`, which patches the
instance so that a packed batch runs **the module's own forward** once per group of sequences
(:func:`padfree.model.packed.per_bucket`), each sequence a row of its own, with what that sequence has alone: the
same code, dtypes and autocast behaviour as transformers' lone-sequence path, by construction. An ordinary batch
runs transformers' own forward, untouched.

>>> import torch, transformers
>>> from padfree.model.install import install_packing, unconfigure_packing
>>> cfg = transformers.StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                   num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.StableLmForCausalLM(cfg).eval()
>>> print(install_packing(model).mixers["model.layers.0.self_attn"])
its own forward per bucket of sequences (the layout never reaches it: its decoder layer drops keyword arguments)
>>> packed = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]])).logits
>>> alone = model(input_ids=torch.tensor([[8, 9]])).logits
>>> bool(torch.allclose(packed[0, 3:], alone[0], atol=1e-5))
True
>>> unconfigure_packing(model)
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import UnsupportedModelError
from padfree.model.families import replay
from padfree.model.packed import PackedLayout
from padfree.model.state import unpatch

__all__ = ["Replay", "install", "uninstall"]


@dataclasses.dataclass(frozen=True)
class Replay:
    """How the instances of one module class run per group of packed sequences.

    Run by :mod:`padfree.model.families.replay` (:class:`~padfree.model.families.replay.Plan` says what it cuts):
    the first parameter of the forward is the ``(B, T, ...)`` hidden state, gathered per group. Arguments named
    ``attention_mask`` (``(B | 1, ..., T, T)``), ``position_ids`` (``(B | 1, T)``) and ``position_embeddings`` (a
    ``(B | 1, T, ...)`` table, or a tuple / dict of them) are cut to their first ``L`` positions; ``None``, bools and
    numbers pass unchanged; any other tensor is refused at the call (padfree does not guess what it means).

    Attributes:
        description: one line for the configured model's report.
        tokens: further ``(B, T, ...)`` per-token arguments, gathered like the hidden state.
        heads: ``(B·H, 1, T)`` or ``(B, H, 1, T)`` per-key biases (ALiBi): each group gets the first ``L`` keys
            of the first row's.
        same: position-free tensors, handed over unchanged.
        by: the grouping (:meth:`~padfree.model.packed.PackedLayout.buckets`): ``"bucket"``; ``"length"`` where the
            forward depends on a sequence's exact length; ``"sequence"`` where it mixes the rows of a batch.
        extras: combines the per-group values of the output's other entries (index -> function of the list); by
            default an entry every group returns as one object (a bias parameter) is kept and anything else
            (per-group attention weights) is None.
    """

    description: str
    tokens: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    same: tuple[str, ...] = ()
    by: str = "bucket"
    extras: Mapping[int, Callable[[list[Any]], Any]] = dataclasses.field(default_factory=dict)


def _router_logits(per_group: list[torch.Tensor]) -> torch.Tensor:
    # Doge's (2, tokens, keys) router logits of every sequence, sequence after sequence: the load-balancing loss
    # averages over tokens, so their order does not matter
    return torch.cat(per_group, dim=1)


_BUCKET = "its own forward per bucket of sequences"
REPLAYS: dict[str, Replay] = {
    "GPTNeoXJapaneseAttention": Replay(f"{_BUCKET} (hand-written attention outside transformers' interface)"),
    "StableLmAttention": Replay(f"{_BUCKET} (the layout never reaches it: its decoder layer drops keyword arguments)"),
    "Llama4TextAttention": Replay(f"{_BUCKET} (chunks and NoPE query temperature counted from each sequence's start)"),
    "DogeAttention": Replay("its own forward per group of sequences of one length (dynamic mask: top-k keys of each "
                            "sequence alone)", by="length"),
    "DogeCDMoE": Replay("its own forward per sequence (its router reshapes the whole flattened batch)",
                        by="sequence", extras={1: _router_logits}),
}
#: module class name -> what running it per sequence makes exact
CLASSES: dict[str, str] = {name: spec.description for name, spec in REPLAYS.items()}


def _patched_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, one run per group otherwise
    (:func:`padfree.model.families.replay.run`)."""
    return replay.run(self, self._padfree_replay, args, kwargs)


def _of_list(extra: Callable[[list[Any]], Any]) -> Callable[[list[Any], PackedLayout, str], Any]:
    # a Replay's extras combine the per-group values alone; the engine also hands a stitch the layout and grouping
    return lambda values, lay, by: extra(values)


# ---- installation ------------------------------------------------------------------------------------------------


def install(module: torch.nn.Module, state: Any, replays: Mapping[str, Replay] = REPLAYS) -> str:
    """Make one instance of a class of ``replays`` run per sequence for packed batches of the model ``state``
    belongs to; returns the one-line description of its packed forward. Idempotent."""
    name = type(module).__name__
    spec = replays.get(name)
    if spec is None:
        raise UnsupportedModelError(f"{name} is not an attention module padfree knows how to run per sequence")
    hidden = replay.check(module, state, (*spec.tokens, *spec.heads, *spec.same),
                          reads="the inputs its model builds for a row without boundaries",
                          receives="restarting positions")
    plan = replay.Plan(state, hidden, spec.by, tokens=spec.tokens, heads=spec.heads, same=spec.same,
                       stitch={i: _of_list(extra) for i, extra in spec.extras.items()})
    replay.record(module, "_padfree_replay", plan, _patched_forward)
    return spec.description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_replay")
