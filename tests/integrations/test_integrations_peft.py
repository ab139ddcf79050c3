"""Training PEFT adapters padding-free: LoRA, DoRA and ``modules_to_save`` on a dense (llama) and a hybrid
(qwen3_5_text) model, and DPO with a LoRA policy and no reference model (the policy with its adapter off is the
reference).

Why adapters on the layers are exact: LoRA and DoRA add to a Linear projection a function of that token's own input
(DoRA rescales the projection's weight columns, the same for every token), and ``modules_to_save`` trains a copy of
a module that runs as the original did — for a token mixer (attention, GatedDeltaNet) under padfree's boundary
handling, its own config copy included. None of them carries anything from one token to the next, so the packed row
computes what each sequence alone computes. Measured here, not assumed: one packed forward + backward of the
PeftModel against every sequence alone (logits, loss, every trainable parameter's gradient; fp32, 1e-5), with
controls that the same comparison catches (positions running on across sequences; the attention copy of
``modules_to_save`` left on plain SDPA).

DPO is compared with TRL's own padded DPOTrainer on the same pairs (loss and every metric it logs, and the
adapter's gradients), in the tolerances of ``test_integrations_dpo``.
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
pytest.importorskip("mistral_common")

import padfree  # noqa: E402
from padfree.integrations.dpo import DPOConfig, DPOTrainer  # noqa: E402
from padfree.integrations.unpadded import Unpadded  # noqa: E402
from realdata import gsm8k_records  # noqa: E402
from zoo import loss_of, max_diff, packed_rows, run_packed, run_separately, tiny_model  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL_TYPES = ("llama", "qwen3_5_text")
TOL = 1e-5
ROWS = [[9, 6, 3], [7, 5, 4]]
MIXER = {"llama": "self_attn", "qwen3_5_text": "linear_attn"}


def _adapter(kind: str, model_type: str) -> peft.LoraConfig:
    """Random (not zero) initial adapters, so that every adapter parameter has a gradient and the adapted model is
    not the base model."""
    if kind == "lora":
        return peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    if kind == "dora":
        return peft.LoraConfig(r=4, target_modules="all-linear", use_dora=True, init_lora_weights=False)
    # a trained copy of the embedding, the head and a token mixer (attention or GatedDeltaNet), LoRA on the MLPs
    return peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"], init_lora_weights=False,
                           modules_to_save=["embed_tokens", "lm_head", MIXER[model_type]])


TRAINED = {"lora": ("lora_A", "lora_B"), "dora": ("lora_A", "lora_B", "lora_magnitude_vector"),
           "modules_to_save": ("lora_A", "lora_B", "modules_to_save")}


def _step_of(model, ids, pos, seqs):
    """``(per-sequence logits, loss, gradients)`` of one packed forward + backward."""
    logits, grads = run_packed(model, ids, pos, seqs)
    return logits, float(loss_of(logits, seqs, sum(len(s) - 1 for _, _, s in seqs))), grads


@pytest.mark.parametrize("kind", TRAINED)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_adapter_training_packed_equals_each_sequence_alone(model_type, kind):
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model(model_type), _adapter(kind, model_type))
    model.train()
    report = padfree.configure_packing(model)
    assert report.supported and report.attention_modules
    ids, pos, seqs = packed_rows(ROWS)
    packed, loss, grads = _step_of(model, ids, pos, seqs)
    alone, alone_grads = run_separately(model, seqs)
    alone_loss = float(loss_of(alone, seqs, sum(len(s) - 1 for _, _, s in seqs)))

    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(alone_grads) == trained  # every adapter parameter, and nothing else, is trained
    assert all(any(part in n for n in trained) for part in TRAINED[kind])
    logit_diff, grad_diff = max_diff(packed, alone), max(float((grads[n] - alone_grads[n]).abs().max())
                                                         for n in trained)
    assert logit_diff <= TOL and abs(loss - alone_loss) <= TOL and grad_diff <= TOL, (logit_diff, grad_diff)

    # control: the same rows with positions running on (no boundary) are caught by the same comparison
    running = torch.arange(ids.shape[1]).expand_as(ids)
    leak, leak_loss, leak_grads = _step_of(model, ids, running, seqs)
    assert max_diff(leak, alone) > 1e-3 and abs(leak_loss - alone_loss) > 1e-4
    assert max(float((leak_grads[n] - alone_grads[n]).abs().max()) for n in trained) > 1e-4


def test_a_modules_to_save_copy_of_attention_runs_padfree_attention():
    """PEFT's ``modules_to_save`` deep-copies the attention layer, its config with it: the copy kept plain SDPA over
    the whole packed row until configure_packing switched copies too. Control: the copy switched back."""
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model("llama"), _adapter("modules_to_save", "llama"))
    padfree.configure_packing(model)
    copies = [m for n, m in model.named_modules() if n.endswith("self_attn.modules_to_save.default")]
    assert len(copies) == 2 and all(m.config is not model.get_base_model().config for m in copies)
    assert {m.config._attn_implementation for m in copies} == {"padfree_sdpa"}
    ids, pos, seqs = packed_rows(ROWS)
    alone, _ = run_separately(model, seqs)
    packed, _ = run_packed(model, ids, pos, seqs, grad=False)
    assert max_diff(packed, alone) <= TOL
    for m in copies:
        m.config._attn_implementation = "sdpa"
    stale, _ = run_packed(model, ids, pos, seqs, grad=False)
    assert max_diff(stale, alone) > 1e-2
    for m in copies:
        m.config._attn_implementation = "padfree_sdpa"
    assert padfree.unconfigure_packing(model)
    assert {m.config._attn_implementation for m in copies} == {"sdpa"}


# ---- DPO: a LoRA policy, no reference model --------------------------------------------------------------------------

RTOL, ATOL = 1e-5, 1e-7  # test_integrations_dpo's: relative, ATOL only for metrics that are ~0
GRAD_TOL = {"llama": RTOL, "qwen3_5_text": 4e-5}  # test_integrations_dpo's STEP_TOL: 2-norm, relative


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b)) + ATOL


def _pairs(n: int) -> datasets.Dataset:
    """GSM8K questions as prompts, their answers as chosen, other records' answers cut to various lengths as
    rejected: chosen and rejected of different lengths, as real pairs are."""
    records = gsm8k_records(n + 11)
    cuts = (8, 25, 60, 110)
    return datasets.Dataset.from_list([
        {"prompt": records[i]["instruction"][:100] + "\n", "chosen": " " + records[i]["output"][:120],
         "rejected": " " + records[i + 11]["output"][: cuts[i % len(cuts)]]} for i in range(n)])


def _base(model_type: str, vocab: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    extra = {"layer_types": ["linear_attention", "full_attention"]} if model_type == "qwen3_5_text" else {}
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _args(cls, out, **kw):
    return cls(str(out), report_to="none", use_cpu=True, per_device_train_batch_size=4, max_length=160, seed=7,
               optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
               save_strategy="no", bf16=False, **kw)


DPO_ADAPTERS = {
    "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    # TRL wraps the model after padfree configured it: the GatedDeltaNet copies must be configured too
    "modules_to_save": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj"],
                                               modules_to_save=["linear_attn"], init_lora_weights=False),
}


def _trainer(cls, config_cls, base, tok, out, pairs, adapter, **kw):
    """A DPO trainer over a copy of ``base`` with a PEFT adapter of random initial weights (the same in every
    trainer: the RNG is seeded just before TRL builds it) and no reference model."""
    torch.manual_seed(1)
    return cls(model=copy.deepcopy(base), ref_model=None, args=_args(config_cls, out, **kw), train_dataset=pairs,
               processing_class=tok, peft_config=DPO_ADAPTERS[adapter]())


def _loss_metrics_grads(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}, grads


def _relative(want: dict, got: dict) -> float:
    """``|got - want| / |want|`` over every gradient (2-norms): see test_integrations_dpo._same_update."""
    assert want.keys() == got.keys()
    scale = math.sqrt(sum(float((w.double() ** 2).sum()) for w in want.values()))
    assert scale > 0
    return math.sqrt(sum(float(((got[k].double() - w.double()) ** 2).sum()) for k, w in want.items())) / scale


@pytest.mark.parametrize(("model_type", "adapter"), [("llama", "lora"), ("qwen3_5_text", "lora"),
                                                      ("qwen3_5_text", "modules_to_save")])
def test_dpo_with_a_lora_policy_and_no_reference_model_equals_trl_padded(model_type, adapter, tok, tmp_path):
    base, pairs = _base(model_type, len(tok)), _pairs(4)
    padded = _trainer(trl.DPOTrainer, trl.DPOConfig, base, tok, tmp_path / "trl", pairs, adapter)
    ours = _trainer(DPOTrainer, DPOConfig, base, tok, tmp_path / "pf", pairs, adapter, padding_free=True)
    assert isinstance(ours.model, peft.PeftModel) and ours.ref_model is None
    status = padfree.packing_status(ours)
    assert status.mode == "padding-free batching" and status.attention == "padfree_sdpa"
    start = dict(padded.model.named_parameters())
    assert all(torch.equal(p, start[n]) for n, p in ours.model.named_parameters())  # the same adapter to start

    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    assert (batch["attention_mask"] == 0).float().mean() > 0.2  # TRL's batch is largely padding
    want_loss, want_metrics, want_grads = _loss_metrics_grads(padded, batch)
    got_loss, got_metrics, got_grads = _loss_metrics_grads(ours, batch)
    # the reference (adapter off) differs from the policy: log-ratios, hence the loss, are not at their start value
    assert abs(want_loss - math.log(2)) > 1e-3 and abs(want_metrics["rewards/margins"]) > 1e-3
    assert _close(want_loss, got_loss), (want_loss, got_loss)
    assert set(want_metrics) == set(got_metrics)
    # a reward is β·(policy - reference log-prob sum), a difference of two sums of several hundred nats each rounded to
    # ~1e-6 of itself in fp32: TRL's head and padfree's add the same terms in other orders, which moves a reward near
    # zero (a LoRA barely off its reference) by up to β · 2e-6 · |logps|, far beyond 1e-5 of the reward itself
    logps = max(abs(want_metrics["logps/chosen"]), abs(want_metrics["logps/rejected"]))
    for key, value in want_metrics.items():
        if key.startswith("rewards/") and key != "rewards/accuracies":
            assert abs(value - got_metrics[key]) <= ours.beta * 2e-6 * logps, (key, value, got_metrics[key])
        else:
            assert _close(value, got_metrics[key]), (key, value, got_metrics[key])
    assert want_grads and all(".default." in n for n in want_grads)  # only the adapter (and its copies) trains
    assert _relative(want_grads, got_grads) <= GRAD_TOL[model_type], _relative(want_grads, got_grads)

    # control: the same packed row with positions running on across the sequences, through the same policy
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    layout = Unpadded.from_attention_mask(batch["attention_mask"])
    packed = dict(input_ids=layout.pack(batch["input_ids"]), labels=layout.labels(labels), fused_lm_head=True)
    with torch.no_grad():
        want = ours.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                          fused_lm_head=True).log_probs.sum(1)
        exact = layout.unpack_shifted(ours.model(**packed, position_ids=layout.position_ids).log_probs).sum(1)
        leak = layout.unpack_shifted(ours.model(**packed).log_probs).sum(1)
    assert ((exact - want).abs() / want.abs()).max().item() <= RTOL
    # sums of several hundred nats, one ulp 3e-5: the leak is hundreds of ulps, ten times the tolerance and more
    assert (leak - want).abs().max().item() > 1e-2 and ((leak - want).abs() / want.abs()).max().item() > 10 * RTOL
    # the trainer configured the model inside the PeftModel; undone through the PeftModel too
    assert padfree.unconfigure_packing(ours.model) and not padfree.unconfigure_packing(ours.model)
    assert ours.model.get_base_model().config._attn_implementation == "sdpa"
