"""The proof (padfree.proof.compare.prove) runs what a trainer runs: a packed training step with ``labels=``.

The forward carries ``labels=`` as a trainer's does (a model may hand them down to its attention with its
``**kwargs``, as gemma4 does), the loss compared is the one the model computes itself from them, and its backward
gives the gradients compared; the leaking control (positions that never restart) must exceed the tolerance. A model
whose own loss cannot be the reference (it fails on a sequence alone, or adds a term of its own) still has its
packed step proven, on the token-mean cross-entropy of its logits, and the proof says why.
"""

from __future__ import annotations

import re

import pytest
import torch

from padfree.proof.compare import FP32_TOL, prove
from padfree.proof.tiny import build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _labels_seen(model: torch.nn.Module, kind: str) -> list[bool]:
    """Per call over the proof's packed rows (2 rows of tokens) of every module whose class name ends in ``kind``:
    whether it was handed a ``labels`` tensor."""
    seen: list[bool] = []

    def record(module, args, kwargs):
        tokens = kwargs.get("hidden_states", kwargs.get("input_ids", args[0] if args else None))
        if tokens is not None and tokens.shape[0] == 2:
            seen.append(isinstance(kwargs.get("labels"), torch.Tensor))

    for module in model.modules():
        if type(module).__name__.endswith(kind):
            module.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def test_the_proof_hands_labels_to_the_packed_forward_and_compares_the_models_own_loss():
    model = build_tiny("gemma4")
    seen = _labels_seen(model, "TextAttention")  # gemma4 hands its attention the forward's **kwargs
    proof = prove(model, backends=["sdpa", "eager"], precisions=["fp32"])
    assert proof.ok and not proof.unrunnable, str(proof)
    assert any(seen), "no packed forward handed the attention modules its labels"
    for check in proof.checks:
        assert check.loss <= check.loss_tolerance and check.grads is not None and check.grads <= FP32_TOL, check
        assert check.leak > 1000 * FP32_TOL, check  # the negative control the same comparison catches


def test_a_decoder_whose_loss_takes_pre_shifted_labels_is_proven_on_its_own_loss():
    """BART's decoder (and its kin: XLNet, Marian, Whisper's, ...) does not shift its labels: the proof hands it
    pre-shifted ones (each token's next id in its sequence, -100 at its last), and compares its own loss."""
    model = build_tiny("bart")
    seen = _labels_seen(model, "ForCausalLM")
    proof = prove(model, backends=["sdpa"], precisions=["fp32"])
    assert proof.ok and not proof.unrunnable, str(proof)
    assert any(seen)  # the packed step (the unpacked check and the leaking control run without labels)
    check = proof.checks[0]
    assert check.loss <= check.loss_tolerance and check.grads <= FP32_TOL and check.leak > 1000 * FP32_TOL, check


@pytest.mark.parametrize(("model_type", "variant", "why", "labels"), [
    # GIT's loss skips image tokens it was not given: it fails on a text-only sequence alone, packed or not
    ("git", None, r"transformers' own loss from labels= fails on a sequence alone \(ValueError", False),
    # a router's load-balancing term is added to the cross-entropy: not a token mean over the sequences
    ("mixtral", {"output_router_logits": True},
     r"the model's own loss from labels= on a sequence alone \([\d.]+\) is not the token-mean cross-entropy of its "
     r"logits \([\d.]+\), the labels aligned or pre-shifted", True),
])
def test_a_model_whose_own_loss_is_no_reference_is_proven_on_the_cross_entropy_and_says_why(model_type, variant,
                                                                                            why, labels):
    model = build_tiny(model_type, variant)
    seen = _labels_seen(model, "ForCausalLM")
    proof = prove(model, backends=["sdpa"], precisions=["fp32"])
    assert proof.ok, str(proof)
    assert set(proof.unrunnable) == {"labels"}
    assert re.match(why, proof.unrunnable["labels"]), proof.unrunnable
    assert any(seen) is labels  # labels still reach the packed forward where the model's own code takes them
    check = proof.checks[0]
    assert check.loss <= check.loss_tolerance and check.grads <= FP32_TOL and check.leak > 1000 * FP32_TOL, check
