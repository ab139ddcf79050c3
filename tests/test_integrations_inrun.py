"""The proof a training run carries: its first packed micro-batch against its sequences alone, on the run's own
model and precision (padfree.integrations.inrun), and the trainers that run it before their first optimizer step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import padfree  # noqa: E402
from padfree.errors import InvalidArgumentError, PackingDisabledError  # noqa: E402
from padfree.integrations.inrun import InRunProof, batch_sequences  # noqa: E402
from padfree.model.families import scan_mixers  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.model.sweep import build_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23], [30, 31, 32]]


def _batch(seqs=SEQS, width=24):
    """A packed micro-batch as padfree's collators give it: one row, positions restarting, a padding tail."""
    ids = [t for s in seqs for t in s]
    pos = [i for s in seqs for i in range(len(s))]
    labels = [-100 if i == 0 else t for s in seqs for i, t in enumerate(s)]
    pad = width - len(ids)
    return {"input_ids": torch.tensor([ids + [0] * pad]), "position_ids": torch.tensor([pos + list(range(pad))]),
            "labels": torch.tensor([labels + [-100] * pad])}


def test_the_batch_is_read_into_its_shortest_sequences_padding_left_out():
    assert batch_sequences(_batch()) == [[30, 31, 32], [20, 21, 22, 23], [12, 13, 14, 15, 16, 17],
                                         [5, 6, 7, 8, 9, 10, 11]]
    assert batch_sequences(_batch(), most=2) == [[30, 31, 32], [20, 21, 22, 23]]
    assert batch_sequences(_batch(), budget=5) == []  # fewer than two fit: nothing to compare
    assert batch_sequences({"input_ids": torch.tensor([[5, 6, 7]])}) == []  # no boundaries: one sequence


@pytest.mark.parametrize("option", ["every:0", "sometimes", 3])
def test_the_option_is_checked(option):
    with pytest.raises(InvalidArgumentError, match="padfree_verify must be 'first_step', 'every:N'"):
        InRunProof.from_option(option)


@pytest.mark.parametrize(("model_type", "autocast"), [("llama", False), ("llama", True), ("qwen3_5_text", True)])
def test_a_configured_model_passes_with_a_control_beyond_rounding(model_type, autocast):
    model = build_tiny(model_type)
    padfree.configure_packing(model)
    proof = InRunProof.from_option("first_step")
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        logged = proof.prove(model, _batch(), step=0)
    assert proof.last.ok and proof.last.conclusive, proof.last
    assert logged["padfree/verify_control_ratio"] > 10 and logged["padfree/verify_max_logit_diff"] <= proof.last.atol
    assert not proof.due(1)  # first_step: done


def test_a_family_whose_reset_is_off_stops_the_run_naming_the_module(monkeypatch):
    """The deliberately broken boundary: GatedDeltaNet's convolution computed as if the row were one sequence.
    The proof raises — before any optimizer step — and names the first module whose output diverges."""
    model = build_tiny("qwen3_5_text")
    padfree.configure_packing(model)
    exact = scan_mixers.segment_causal_conv1d

    def leaky(x, weight, bias, activation, lay):
        if isinstance(lay, PackedLayout):
            lay = PackedLayout.from_position_ids(torch.arange(lay.shape[1]).expand(lay.shape))
        return exact(x, weight, bias, activation, lay)

    monkeypatch.setattr(scan_mixers, "segment_causal_conv1d", leaky)
    with pytest.raises(PackingDisabledError, match=r"in-run proof at step 0 failed.*first diverging module: "
                                                   r"model\.layers\.\d+\.linear_attn"):
        InRunProof.from_option("first_step").prove(model, _batch(), step=0)
