"""padfree's answer to TRL's fused LM head on a packed row (``LogProbHead``), on tiny models of several head kinds.

The reference is TRL's own fused head (``add_fused_lm_head``) on the padded batch of an unconfigured copy of the
model: every per-token field it returns (log-probs, entropy, ``log Σ p²``, mean logits, top-1 hits, label mask), its
loss, and the gradients of every parameter through a loss that weighs each token's log-prob and entropy differently
(as DPO's per-sequence coefficients do) — fp32, ≤ 1e-5. Where padfree's head cannot compute what TRL's computes (a
LoRA on the head, a MoE router loss) TRL's head answers, with the same numbers.
"""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import padfree  # noqa: E402
from padfree.integrations.fused_head import LogProbHead  # noqa: E402
from padfree.integrations.unpadded import unpadded_forwards  # noqa: E402
from padfree.model.log_probs import OUTPUTS  # noqa: E402
from zoo import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = (*OUTPUTS, "label_mask")
# llama: a plain head; cohere: a logit scale; gemma2: a final soft-cap; qwen3_5_text: a GatedDeltaNet hybrid
MODEL_TYPES = ("llama", "cohere", "gemma2", "qwen3_5_text")


def _batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three right-padded sequences whose first tokens are a prompt (label -100), as TRL's DPO collator lays them."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = (11, 6, 9), (4, 2, 5)
    mask = torch.zeros(3, max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    ids = torch.randint(1, vocab, mask.shape, generator=g) * mask
    labels = ids.masked_fill(mask == 0, -100)
    for r, p in enumerate(prompts):
        labels[r, :p] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _objective(out, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w_lp, w_ent = torch.randn(out.log_probs.shape, generator=g), torch.randn(out.log_probs.shape, generator=g)
    return (out.log_probs * w_lp).sum() + (out.entropy * w_ent).sum() + out.loss


def _run(model, batch, context):
    model.zero_grad()
    with context:
        out = model(**batch, fused_lm_head=True)
    _objective(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(want, got, want_grads, got_grads, tol=1e-5):
    for name in FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(b, a, atol=tol, rtol=tol, msg=name)
    torch.testing.assert_close(got.loss, want.loss, atol=tol, rtol=tol)
    assert want_grads.keys() == got_grads.keys()
    scale = max(float(g.abs().max()) for g in want_grads.values())
    worst = max(float((want_grads[n] - got_grads[n]).abs().max()) for n in want_grads)
    assert worst <= tol * max(scale, 1.0), worst


def _pair(model_type: str):
    """(TRL's reference: an unconfigured copy with TRL's head; the model configured for packing, with TRL's head)."""
    model = tiny_model(model_type).float()
    reference = copy.deepcopy(model)
    add_fused_lm_head(reference, outputs=OUTPUTS)
    padfree.configure_packing(model)
    add_fused_lm_head(model, outputs=OUTPUTS)
    return reference, model


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_packed_row_scored_by_padfree_equals_trls_head_on_the_padded_batch(model_type, caplog):
    reference, model = _pair(model_type)
    batch = _batch(model.config.vocab_size)
    want, want_grads = _run(reference, batch, torch.enable_grad())
    head = LogProbHead(OUTPUTS)
    with caplog.at_level(logging.INFO, logger="padfree"):
        got, got_grads = _run(model, batch, unpadded_forwards(model, heads={model: head}))
    assert head.calls == 1 and "answered by padfree's per-token head" in caplog.text
    _assert_same(want, got, want_grads, got_grads)
    # TRL's own head on the same packed row (padfree_fused_head=False) gives the same numbers
    trl_head, trl_grads = _run(model, batch, unpadded_forwards(model))
    _assert_same(trl_head, got, trl_grads, got_grads)


def _worst(want, got, want_grads, got_grads) -> tuple[float, float]:
    """(max |Δ log-prob|, max |Δ gradient| / max |gradient|) of ``got`` against ``want``."""
    scale = max(float(g.abs().max()) for g in want_grads.values())
    return (float((got.log_probs - want.log_probs).abs().max()),
            max(float((want_grads[n] - got_grads[n]).abs().max()) for n in want_grads) / scale)


def test_grpos_temperature_and_head_precision_equal_trls():
    """GRPO patches TRL's head with the sampling temperature and, optionally, a float32 head outside autocast
    (``cast_lm_head_to_fp32``). Under bf16 autocast: with the float32 head padfree's equals TRL's to fp32 rounding;
    with the head in bf16, both land as far from the float32 head's numbers as bf16 rounding takes them, padfree's
    no farther than TRL's."""
    runs = {}
    for fp32_head in (True, False):
        model = tiny_model("gemma2").float()  # a soft-capped head: temperature divides after the cap
        padfree.configure_packing(model)
        add_fused_lm_head(model, temperature=0.7, cast_lm_head_to_fp32=fp32_head, outputs=OUTPUTS)
        batch = _batch(model.config.vocab_size)
        head = LogProbHead(OUTPUTS, temperature=0.7, fp32_head=fp32_head)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs["padfree", fp32_head] = _run(model, batch, unpadded_forwards(model, heads={model: head}))
            runs["trl", fp32_head] = _run(model, batch, unpadded_forwards(model))
        assert head.calls == 1
    _assert_same(*runs["trl", True][:1], *runs["padfree", True][:1], runs["trl", True][1], runs["padfree", True][1])
    truth = runs["trl", True]
    trl_error = _worst(truth[0], runs["trl", False][0], truth[1], runs["trl", False][1])
    our_error = _worst(truth[0], runs["padfree", False][0], truth[1], runs["padfree", False][1])
    print("bf16 head against the float32 head: trl", trl_error, "padfree", our_error)
    assert trl_error[0] > 1e-4  # bf16 rounding is there to see
    assert our_error[0] <= 1.5 * trl_error[0] and our_error[1] <= 1.5 * trl_error[1], (our_error, trl_error)


def test_a_leaking_row_is_caught_by_the_same_comparison():
    """The negative control: the hybrid left unconfigured carries GatedDeltaNet state from one sequence into the
    next inside the packed row, and the per-token log-probs padfree's head returns are then far from TRL's."""
    reference, _ = _pair("qwen3_5_text")
    leaking = tiny_model("qwen3_5_text").float()  # the same weights (seed 0), not configured for packing
    add_fused_lm_head(leaking, outputs=OUTPUTS)
    batch = _batch(reference.config.vocab_size)
    want, _ = _run(reference, batch, torch.enable_grad())
    head = LogProbHead(OUTPUTS)
    got, _ = _run(leaking, batch, unpadded_forwards(leaking, heads={leaking: head}))
    assert head.calls == 1
    assert float((got.log_probs - want.log_probs).abs().max()) > 1e-3


def test_only_the_requested_fields_are_computed():
    reference, model = _pair("llama")
    batch = _batch(model.config.vocab_size)
    with unpadded_forwards(model, heads={model: LogProbHead()}):
        out = model(**batch, fused_lm_head=True)
    assert out.entropy is None and out.is_top1 is None and out.mean_logits is None
    want = reference(**batch, fused_lm_head=True)
    torch.testing.assert_close(out.log_probs, want.log_probs, atol=1e-5, rtol=1e-5)
    with pytest.raises(padfree.PadfreeError, match=r"outputs must be a tuple of names among"):
        LogProbHead(("log_probs", "logits"))


def test_a_lora_on_the_head_keeps_trls_head_with_the_same_numbers(caplog):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama").float()
    padfree.configure_packing(model)
    add_fused_lm_head(model, outputs=OUTPUTS)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    batch = _batch(model.config.vocab_size)
    head = LogProbHead(OUTPUTS)
    with caplog.at_level(logging.INFO, logger="padfree"):
        got, got_grads = _run(wrapped, batch, unpadded_forwards(wrapped, heads={wrapped: head}))
    assert head.calls == 0 and "keeps TRL's fused LM head" in caplog.text and "nn.Linear" in caplog.text
    want, want_grads = _run(wrapped, batch, unpadded_forwards(wrapped))
    _assert_same(want, got, want_grads, got_grads)
    assert any("lora_B" in n and "q_proj" in n for n in got_grads)


def test_a_moe_router_loss_keeps_trls_head(caplog):
    reference, model = _pair("mixtral")
    for m in (reference, model):
        m.config.output_router_logits = True
    batch = _batch(model.config.vocab_size)
    head = LogProbHead(OUTPUTS)
    with caplog.at_level(logging.INFO, logger="padfree"):
        got, _ = _run(model, batch, unpadded_forwards(model, heads={model: head}))
    assert head.calls == 0 and "router" in caplog.text
    assert got.aux_loss is not None


def test_a_call_without_labels_is_trls_to_answer():
    """TRL's fused head needs labels; a call without them is handed to it untouched (and fails as it fails there)."""
    _, model = _pair("llama")
    batch = {k: v for k, v in _batch(model.config.vocab_size).items() if k != "labels"}
    head = LogProbHead()
    errors = []
    for heads in ({}, {model: head}):
        with unpadded_forwards(model, heads=heads), pytest.raises(TypeError, match="subscriptable") as info:
            model(**batch, fused_lm_head=True)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1] and head.calls == 0
