"""padfree's GRPOTrainer: the completions' per-token log-probs computed over one packed row per micro-batch.

What the padding-free numbers are compared against, and why: the true reference is each prompt + completion run
alone (no padding, positions from 0 — what generation saw). TRL's padded forward of a left-padded prompt runs with
positions ``arange(P + C)``, shifted by the row's padding; RoPE attention depends only on position differences, so it
agrees with the true reference up to rounding, and with per-row ``position_ids`` (``cumsum(mask) - 1``) it is the
same computation. The tests check the packed log-probs against both, fp32, and a control that leaks across
sequences (the packed row without padfree's layout or configuration) to show the comparison catches a leak.

Tiny random-weight fp32 models (``build_tiny``) over a real tokenizer (mistral-common's SentencePiece model) and
real GSM8K text.
"""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
mistral_common = pytest.importorskip("mistral_common")

import padfree  # noqa: E402
from padfree.errors import InvalidArgumentError, UnsupportedModelError  # noqa: E402
from padfree.integrations import grpo as pgrpo  # noqa: E402
from padfree.integrations.decide import ENV_DISABLE_AUTO, ENV_RETURN_LOGITS  # noqa: E402
from padfree.integrations.unpadded import Unpadded  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from realdata import gsm8k_records  # noqa: E402
from zoo import with_unknown_mixer  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")  # every loss TRL 1.16 has


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (ENV_DISABLE_AUTO, *ENV_RETURN_LOGITS):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def records():
    return gsm8k_records(16)


def tiny(model_type, tok, seed=0):
    return build_tiny(model_type, {"vocab_size": len(tok)}, seed=seed)


def prompts(records, n):
    return datasets.Dataset.from_list([{"prompt": r["instruction"][:160]} for r in records[:n]])


def config(out, **kwargs):
    base = dict(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                max_completion_length=6, learning_rate=1e-2, optim="sgd", report_to="none", save_strategy="no",
                use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0, bf16=False, activation_checkpointing=False)
    cls = kwargs.pop("cls", pgrpo.GRPOConfig)
    return cls(**{**base, **kwargs})


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trainer_for(model, tok, out, records, **kwargs):
    extra = {k: kwargs.pop(k) for k in ("processing_class", "train_dataset") if k in kwargs}
    return pgrpo.GRPOTrainer(model=model, reward_funcs=reward_len, args=config(out, **kwargs),
                             **{"processing_class": tok, "train_dataset": prompts(records, 8), **extra})


def scoring_batch(tok, records):
    """TRL's layout: real GSM8K prompts left-padded, real answers (cut to 4 different lengths) right-padded."""
    prompt = [tok(r["instruction"][:n])["input_ids"] for r, n in zip(records[:4], (90, 160, 60, 130), strict=True)]
    completion = [tok(r["output"][:n], add_special_tokens=False)["input_ids"]
                  for r, n in zip(records[:4], (40, 110, 12, 70), strict=True)]
    width_p, width_c = max(map(len, prompt)), max(map(len, completion))
    ids = torch.full((4, width_p + width_c), tok.pad_token_id or 0)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompt, completion, strict=True)):
        ids[i, width_p - len(p):width_p + len(c)] = torch.tensor(p + c)
        mask[i, width_p - len(p):width_p + len(c)] = 1
    assert len(set(map(len, prompt))) == 4 and len(set(map(len, completion))) == 4
    return ids, mask, width_c, prompt, completion


def rel(a, b, mask):
    """max |a - b| over the completion tokens, relative to max |b| there."""
    return float((a - b).abs()[mask].max() / b.abs()[mask].max())


# --------------------------------------------------------------------------------------------------
# 1. The per-token log-probs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_padding_free_logps_equal_padded_and_alone(model_type, tok, records, tmp_path):
    model = tiny(model_type, tok)
    leaky = copy.deepcopy(model)  # the same weights, never configured by padfree
    trainer = trainer_for(model, tok, tmp_path, records)
    assert trainer.padding_free and padfree.packing_status(trainer).mode == "padding-free batching"
    trl.trainer.utils.add_fused_lm_head(leaky, outputs=("log_probs", "entropy"))
    ids, mask, width_c, prompt, completion = scoring_batch(tok, records)
    real = mask[:, -width_c:].bool()

    with torch.no_grad():  # padfree's log-prob head verifies, on its first use, that it reproduces the model's logits
        trainer._get_per_token_logps_and_entropies(trainer.model, ids[:1], mask[:1], width_c, batch_size=1)
    trainer.padfree_forwards = {"rows": 0, "tokens": 0, "padded_positions": 0}
    rows = []
    hook = trainer.model.model.register_forward_pre_hook(
        lambda m, a, kw: rows.append((tuple(kw["input_ids"].shape), kw.get("attention_mask"))), with_kwargs=True)
    with torch.no_grad():
        packed, packed_ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, width_c, batch_size=2, compute_entropy=True)
        trainer.padding_free = False  # TRL's own padded path, same trainer, same weights
        padded, padded_ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, width_c, batch_size=2, compute_entropy=True)
        trainer.padding_free = True
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-width_c] = -100
        positioned = trainer.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                                   labels=labels, fused_lm_head=True).log_probs[:, -width_c:]
        alone = torch.zeros_like(packed)
        for i, (p, c) in enumerate(zip(prompt, completion, strict=True)):
            x = torch.tensor([p + c])
            out = trainer.model(input_ids=x, labels=x.masked_fill(torch.arange(x.shape[1]) < len(p), -100),
                                fused_lm_head=True)
            alone[i, :len(c)] = out.log_probs[0, -len(c):]
        # controls: the packed row without padfree's layout (positions running on across sequences), and without
        # padfree's configuration (restarting positions only)
        layout = Unpadded.from_attention_mask(mask)
        flat = leaky(input_ids=layout.pack(ids), labels=layout.labels(labels), fused_lm_head=True)
        no_layout = layout.unpack_shifted(flat.log_probs)[:, -width_c:]
        flat = leaky(input_ids=layout.pack(ids), position_ids=layout.position_ids, labels=layout.labels(labels),
                     fused_lm_head=True)
        unconfigured = layout.unpack_shifted(flat.log_probs)[:, -width_c:]
    hook.remove()

    # the padding-free calls really ran packed: one row of real tokens per micro-batch of 2, no attention_mask
    packed_rows = [shape for shape, m in rows if m is None and shape[0] == 1]
    assert packed_rows[:2] == [(1, int(mask[:2].sum())), (1, int(mask[2:].sum()))]
    assert trainer.padfree_forwards == {"rows": 2, "tokens": int(mask.sum()), "padded_positions": mask.numel()}
    gaps = {"alone": rel(packed, alone, real), "padded": rel(packed, padded, real),
            "padded, per-row positions": rel(packed, positioned, real),
            "entropy vs padded": rel(packed_ent, padded_ent, real)}
    print(model_type, gaps, "no layout:", rel(no_layout, alone, real), "unconfigured:",
          rel(unconfigured, alone, real))
    assert max(gaps.values()) <= 1e-5, gaps
    assert rel(padded, alone, real) <= 1e-5  # TRL's padded forward is right too: the packed one equals it
    assert bool((packed[~real] == 0).all()) and bool((packed_ent[~real] == 0).all())  # padding as TRL leaves it
    assert rel(no_layout, alone, real) > 1e-3  # the comparison catches attention that crosses sequences
    if model_type == "qwen3_5_text":  # GatedDeltaNet state carried across sequences unless padfree resets it
        assert rel(unconfigured, alone, real) > 1e-4
    # (llama unconfigured is exact here: transformers 5's own mask builder reads restarting position_ids of a
    # one-row batch; padfree does not rely on it — configure_packing makes the attention exact by itself)

    # the gradient of the completions' log-probs: the packed micro-batches against every sequence run alone
    grads = []
    for run in ("packed", "alone"):
        trainer.model.zero_grad()
        if run == "packed":
            logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width_c, batch_size=2)[0]
            logps.sum().backward()
        else:
            for p, c in zip(prompt, completion, strict=True):
                x = torch.tensor([p + c])
                trainer.model(input_ids=x, labels=x.masked_fill(torch.arange(x.shape[1]) < len(p), -100),
                              fused_lm_head=True).log_probs.sum().backward()
        grads.append([param.grad.clone() for param in trainer.model.parameters()])
    worst = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
    scale = max(float(b.abs().max()) for b in grads[1])
    print(model_type, "gradient: max |packed - alone| / max |alone| =", worst / scale)
    assert worst <= 1e-5 * scale


# --------------------------------------------------------------------------------------------------
# 2. Every loss type, and a training step end to end
# --------------------------------------------------------------------------------------------------


def test_every_loss_type_and_its_gradient_unchanged(tok, records, tmp_path):
    trainer = trainer_for(tiny("llama", tok), tok, tmp_path, records)
    trainer.beta = 0.1  # the KL term from given reference log-probs (a model instance has no path to load one from)
    ids, mask, width_c, _, _ = scoring_batch(tok, records)
    prompt_width = ids.shape[1] - width_c
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        base, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width_c)
    inputs = {"prompt_ids": ids[:, :prompt_width], "prompt_mask": mask[:, :prompt_width],
              "completion_ids": ids[:, prompt_width:], "completion_mask": mask[:, prompt_width:],
              "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
              "old_per_token_logps": base + 0.3 * torch.randn(base.shape, generator=gen),
              "ref_per_token_logps": base + 0.2 * torch.randn(base.shape, generator=gen),
              "num_items_in_batch": mask[:, prompt_width:].sum()}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train() for each step
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for loss_type in LOSS_TYPES:
        trainer.loss_type = loss_type
        results = []
        for on in (True, False):
            trainer.padding_free = on
            trainer.model.zero_grad()
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in params]))
        (loss_pf, grads_pf), (loss_pad, grads_pad) = results
        assert torch.isfinite(loss_pf) and float(loss_pad.abs()) > 0, loss_type
        # relative to the loss, absolute where the loss is a near-cancelling sum (grpo's ~0.017)
        assert float(loss_pf) == pytest.approx(float(loss_pad), rel=1e-5, abs=1e-6), (loss_type, loss_pf, loss_pad)
        worst = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
                    for a, b in zip(grads_pf, grads_pad, strict=True))
        print(loss_type, float(loss_pad), abs(float(loss_pf - loss_pad)) / abs(float(loss_pad)), worst)
        assert worst <= 1e-4, (loss_type, worst)
    assert trainer.padfree_forwards["rows"] == 1 + len(LOSS_TYPES)


def test_one_grpo_step_end_to_end(tok, records, tmp_path):
    """A model given by path (so TRL loads the reference model too, beta > 0), generation by TRL, old log-probs
    (num_iterations=2): policy, old policy and reference all scored padding-free, one packed row per micro-batch."""
    tiny("llama", tok).save_pretrained(tmp_path / "model")
    # the in-run proof's own forwards are left out: this test counts the step's (the proof: test_integrations_inrun)
    trainer = trainer_for(str(tmp_path / "model"), tok, tmp_path / "out", records, beta=0.1, num_iterations=2,
                          padfree_verify=False)
    status = padfree.packing_status(trainer)
    assert status.mode == "padding-free batching" and status.auto and status.attention == "padfree_sdpa"
    assert trainer.ref_model is not None and padfree.packing_status(trainer).padding_free
    assert trainer.args.padding_free is True
    seen = {"policy": [], "reference": []}
    hooks = [m.model.register_forward_pre_hook(
        lambda m, a, kw, name=name: seen[name].append(
            (tuple(kw["input_ids"].shape), kw.get("attention_mask") is None,
             None if kw.get("position_ids") is None else kw["position_ids"].clone())), with_kwargs=True)
        for name, m in (("policy", trainer.model), ("reference", trainer.ref_model))]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train()
    for hook in hooks:
        hook.remove()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    # scoring: old policy + reference (no grad) and the policy (grad) each over one packed row of the 4 sequences
    assert trainer.padfree_forwards["rows"] == 3
    for name, count in (("policy", 2), ("reference", 1)):
        packed = [(shape, pos) for shape, no_mask, pos in seen[name] if no_mask and shape[0] == 1 and shape[1] > 8]
        assert len(packed) == count, (name, [s for s, _, _ in seen[name]])
        for shape, pos in packed:
            assert int((pos[0] == 0).sum()) == 4 and shape[1] == trainer.padfree_forwards["tokens"] // 3
    assert any(not no_mask for _, no_mask, _ in seen["policy"])  # generation ran TRL's padded forward, untouched
    logs = trainer.state.log_history[0]
    assert "kl" in logs and torch.isfinite(torch.tensor(logs["kl"])) and logs["grad_norm"] > 0
    # the telemetry counted the policy's packed training row: no padding, the 4 sequences in it
    assert logs["padfree/real_token_fraction"] == 1.0 and logs["padfree/sequences_per_row"] == 4.0

    # the same step with TRL's padded forward: same generations (same seed), same loss, same update
    padded = trainer_for(str(tmp_path / "model"), tok, tmp_path / "out2", records, beta=0.1, num_iterations=2,
                         padding_free=False)
    assert padded.train().training_loss == pytest.approx(result.training_loss, abs=1e-6)
    assert padded.padfree_forwards["rows"] == 0
    with torch.no_grad():  # the two updates, as a fraction of the largest (the parameters' own rounding is ~4e-9)
        moved = [(a - b, c - b) for a, b, c in zip(trainer.model.parameters(), before, padded.model.parameters(),
                                                   strict=True)]
        worst = max(float((x - y).abs().max()) for x, y in moved) / max(float(y.abs().max()) for _, y in moved)
    assert worst <= 1e-4, worst


# --------------------------------------------------------------------------------------------------
# 3. The decision: refusals, skips, opt-outs, status
# --------------------------------------------------------------------------------------------------


def test_refusals_skips_and_status(tok, records, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="padfree")

    def build(model=None, **kwargs):
        return trainer_for(model or tiny("llama", tok), tok, tmp_path, records, **kwargs)

    with pytest.raises(UnsupportedModelError, match=r"padding_free=True: padfree is not supported because .*"
                                                    r"ToyRecurrentMixer carries state"):
        build(with_unknown_mixer(tiny("llama", tok)), padding_free=True)
    with pytest.raises(InvalidArgumentError, match="padding_free=True with processing_class=LlavaProcessor"):
        build(padding_free=True, processing_class=transformers.LlavaProcessor(
            image_processor=transformers.CLIPImageProcessor(), tokenizer=tok))
    with pytest.raises(InvalidArgumentError, match=r"padding_free must be True, False or None.*'yes'"):
        build(padding_free="yes")
    with pytest.raises(InvalidArgumentError, match="args must be a GRPOConfig"):
        pgrpo.GRPOTrainer(model=tiny("llama", tok), reward_funcs=reward_len, args={"padding_free": True})

    skipped = build(with_unknown_mixer(tiny("llama", tok)))  # auto: skipped with the reason, TRL's path
    status = padfree.packing_status(skipped)
    assert (status.mode, status.auto, skipped.padding_free) == ("standard batching", True, False)
    assert "auto padding-free skipped: not supported because" in status.reason
    assert "ToyRecurrentMixer carries state" in caplog.text

    ids, mask, width_c, _, _ = scoring_batch(tok, records)
    on = build()
    assert "padfree: padding-free batching (auto: model type 'llama'" in caplog.text
    with pytest.raises(InvalidArgumentError, match=r"multimodal inputs.*pixel_values"):
        on._get_per_token_logps_and_entropies(on.model, ids, mask, width_c, pixel_values=torch.zeros(4, 3, 8, 8))

    monkeypatch.setenv(ENV_DISABLE_AUTO, "1")
    off = build()
    status = padfree.packing_status(off)
    assert status.mode == "standard batching" and "PADFREE_DISABLE_AUTO_PADDING_FREE=1 is set" in status.reason
    assert off.args.padding_free is False and not status.enabled
    with torch.no_grad():
        off._get_per_token_logps_and_entropies(off.model, ids, mask, width_c)
    assert off.padfree_forwards["rows"] == 0  # TRL's padded forward ran
    explicit = padfree.packing_status(build(padding_free=True))  # an explicit setting wins over the opt-out
    assert (explicit.mode, explicit.reason, explicit.auto) == ("padding-free batching", "padding_free=True", False)
    monkeypatch.delenv(ENV_DISABLE_AUTO)

    plain = trainer_for(tiny("llama", tok), tok, tmp_path, records, cls=trl.GRPOConfig)  # TRL's config: auto
    assert padfree.packing_status(plain).mode == "padding-free batching" and plain.args.padding_free is True
    declined = padfree.packing_status(build(padding_free=False))
    assert (declined.mode, declined.reason, declined.auto) == ("standard batching", "padding_free=False", False)
    assert "auto_padding_free=False" in padfree.packing_status(build(auto_padding_free=False)).reason
    assert str(padfree.packing_status(on)).startswith("padfree: padding-free batching (auto: model type 'llama'")
