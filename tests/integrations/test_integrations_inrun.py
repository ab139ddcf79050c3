"""The proof a training run carries: its first packed micro-batch against its sequences alone, on the run's own
model and precision (padfree.integrations.inrun), and the trainers that run it before their first optimizer step."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import padfree  # noqa: E402
from padfree.errors import InvalidArgumentError, PackingDisabledError  # noqa: E402
from padfree.integrations.inrun import InRunProof, batch_sequences  # noqa: E402
from padfree.model.families import scan_mixers  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402

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


def _break_gated_delta_net(monkeypatch):
    """GatedDeltaNet's convolution computed as if every packed row were one sequence (its reset switched off)."""
    exact = scan_mixers.segment_causal_conv1d

    def leaky(x, weight, bias, activation, lay):
        if isinstance(lay, PackedLayout):
            lay = PackedLayout.from_position_ids(torch.arange(lay.shape[1]).expand(lay.shape))
        return exact(x, weight, bias, activation, lay)

    monkeypatch.setattr(scan_mixers, "segment_causal_conv1d", leaky)


def test_the_batch_is_read_into_its_shortest_sequences_padding_left_out():
    assert batch_sequences(_batch()) == [[30, 31, 32], [20, 21, 22, 23], [12, 13, 14, 15, 16, 17],
                                         [5, 6, 7, 8, 9, 10, 11]]
    assert batch_sequences(_batch(), most=2) == [[30, 31, 32], [20, 21, 22, 23]]
    # the two shortest whatever their length, each its first half of the budget (a causal model computes a prefix as
    # it computes the sequence's first tokens: a run of long sequences is proven too), more only within the budget
    assert batch_sequences(_batch(), budget=5) == [[30, 31], [20, 21]]
    assert batch_sequences(_batch(), budget=13) == [[30, 31, 32], [20, 21, 22, 23], [12, 13, 14, 15, 16, 17]]
    assert batch_sequences(_batch([[5, 6, 7, 8], [30, 31, 32]])) == [[30, 31, 32], [5, 6, 7, 8]]
    assert batch_sequences(_batch([[5, 6, 7, 8]])) == []  # one sequence: nothing to compare
    assert batch_sequences({"input_ids": torch.tensor([[5, 6, 7]])}) == []  # no boundaries: one sequence


@pytest.mark.parametrize("option", ["every:0", "sometimes", 3])
def test_the_option_is_checked(option):
    with pytest.raises(InvalidArgumentError, match="padfree_verify must be 'first_step', 'every:N'"):
        InRunProof.from_option(option)


@pytest.mark.parametrize(("model_type", "autocast"), [("llama", False), ("llama", True), ("qwen3_5_text", False),
                                                     ("qwen3_5_text", True)])
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


def test_the_proof_runs_each_sequence_alone_and_three_forwards_more(monkeypatch):
    """What the proof costs the run: the packed row, each sequence alone, the leaking control and one ordinary
    padded batch (the right- and left-padded references together), with logits computed only where they are
    compared — the padding's and the control's first sequence's are not."""
    model = build_tiny("llama")
    padfree.configure_packing(model)
    forwards, projected = [], []
    model.register_forward_pre_hook(lambda m, a, k: forwards.append(
        (tuple(k["input_ids"].shape), k.get("attention_mask") is not None)), with_kwargs=True)
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: projected.append(out.shape[:-1].numel()))
    proof = InRunProof.from_option("first_step")
    proof.prove(model, _batch(), step=0)
    assert proof.last.ok and proof.last.conclusive and proof.last.num_sequences == 4, proof.last
    # packed (7, 6, 4, 3 in one row of 20), alone x4, control, and 7, 6, 4, 3 right- with 6, 4, 3 left-padded
    assert forwards == [((1, 20), False), ((1, 7), False), ((1, 6), False), ((1, 4), False), ((1, 3), False),
                        ((1, 20), False), ((7, 7), True)]
    assert projected == [20, 7, 6, 4, 3, 13, 20 + 13]
    assert proof.seconds > 0 and proof.cpu_seconds > 0  # what it took, by the clock and in CPU time


def test_a_family_whose_reset_is_off_stops_the_run_naming_the_module(monkeypatch):
    """The deliberately broken boundary: GatedDeltaNet's convolution computed as if the row were one sequence.
    The proof raises — before any optimizer step — and names the first module whose output diverges."""
    model = build_tiny("qwen3_5_text")
    padfree.configure_packing(model)
    _break_gated_delta_net(monkeypatch)
    with pytest.raises(PackingDisabledError, match=r"in-run proof at step 0 failed.*first diverging module: "
                                                   r"model\.layers\.\d+\.linear_attn"):
        InRunProof.from_option("first_step").prove(model, _batch(), step=0)


# ---- in the trainers ------------------------------------------------------------------------------------------

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _sft(tok, model, out, **options):
    import padfree.integrations.sft as psft
    from realdata import gsm8k_records

    data = datasets.Dataset.from_list([{"prompt": f"{r['instruction']}\n{r['input']}".rstrip() + "\n",
                                        "completion": r["output"]} for r in gsm8k_records(16)])
    args = psft.SFTConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, report_to="none",
                          save_strategy="no", max_length=128, use_cpu=True, disable_tqdm=True, logging_steps=1,
                          seed=0, padding_free=True, **options)
    return psft.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)


def _tiny_for(tok, model_type):
    return transformers.AutoModelForCausalLM.from_config(
        build_tiny(model_type).config.__class__(**{**build_tiny(model_type).config.to_dict(), "vocab_size": len(tok)}))


@pytest.mark.parametrize("bf16", [False, True])
def test_sft_logs_its_in_run_proof_on_the_first_packed_step(tok, tmp_path, bf16):
    """fp32 and bf16 mixed precision (accelerate's autocast inside the forward): the proof passes within the run's
    own rounding and its control lands beyond it; the numbers reach the training log."""
    trainer = _sft(tok, _tiny_for(tok, "llama"), tmp_path, bf16=bf16)
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "padfree/verify_max_logit_diff" in h)
    assert logged["padfree/verify_control_ratio"] > 10, logged
    report = trainer._padfree_proof.last
    assert report.ok and report.conclusive and report.rounding is not None, report
    assert (report.atol > 1e-4) == bf16, report  # bf16 rounding, far above fp32's 1e-5


def _assert_stops_before_its_first_optimizer_step(trainer, model, monkeypatch):
    """GatedDeltaNet's reset broken: training raises, naming the module, and no optimizer step ran."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _break_gated_delta_net(monkeypatch)
    with pytest.raises(PackingDisabledError, match=r"in-run proof at step 0 failed.*first diverging module: "
                                                   r"model\.layers\.\d+\.linear_attn"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # no optimizer step ran


def test_a_broken_boundary_stops_the_run_before_its_first_optimizer_step(tok, tmp_path, monkeypatch):
    model = _tiny_for(tok, "qwen3_5_text")
    _assert_stops_before_its_first_optimizer_step(_sft(tok, model, tmp_path), model, monkeypatch)


def test_padfree_verify_false_runs_no_proof(tok, tmp_path):
    trainer = _sft(tok, _tiny_for(tok, "llama"), tmp_path, padfree_verify=False)
    trainer.train()
    assert trainer._padfree_proof.last is None
    assert not any("padfree/verify_max_logit_diff" in h for h in trainer.state.log_history)


def test_dpo_proves_its_pairs_sequences(tok, tmp_path):
    """DPO's batches are ordinary padded rows (prompt and chosen, prompt and rejected): the proof packs their real
    tokens itself and runs before the first optimizer step."""
    from padfree.integrations.dpo import DPOConfig, DPOTrainer
    from realdata import gsm8k_records

    records = gsm8k_records(8)
    pairs = datasets.Dataset.from_list([{"prompt": r["instruction"][:80] + "\n", "chosen": " " + r["output"][:60],
                                         "rejected": " " + r["output"][:20]} for r in records])
    policy = _tiny_for(tok, "llama")
    args = DPOConfig(str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=2, max_length=160,
                     max_steps=1, logging_steps=1, save_strategy="no", bf16=False, padding_free=True)
    trainer = DPOTrainer(model=policy, ref_model=copy.deepcopy(policy), args=args, train_dataset=pairs,
                         processing_class=tok)
    trainer.train()
    report = trainer._padfree_proof.last
    assert report is not None and report.ok and report.conclusive and report.num_sequences == 4, report
    assert any("padfree/verify_control_ratio" in h for h in trainer.state.log_history)


def _grpo(tok, model, out, **options):
    """GRPO on real GSM8K prompts; the proof runs on its scoring batch (prompt + generated completion per row),
    before the policy's forward whose gradients the first step applies."""
    import padfree.integrations.grpo as pgrpo
    from realdata import gsm8k_records

    prompts = datasets.Dataset.from_list([{"prompt": r["instruction"][:120]} for r in gsm8k_records(8)])
    args = pgrpo.GRPOConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                            max_completion_length=6, learning_rate=1e-2, optim="sgd", report_to="none",
                            save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0, bf16=False,
                            activation_checkpointing=False, padding_free=True, **options)
    return pgrpo.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                             args=args, train_dataset=prompts, processing_class=tok)


def test_grpo_proves_its_generated_completions(tok, tmp_path):
    trainer = _grpo(tok, _tiny_for(tok, "llama"), tmp_path)
    trainer.train()
    report = trainer._padfree_proof.last
    assert report is not None and report.ok and report.conclusive and report.num_sequences == 4, report
    assert any(h.get("padfree/verify_control_ratio", 0) > 10 for h in trainer.state.log_history)


def test_grpo_with_a_broken_boundary_stops_before_its_first_optimizer_step(tok, tmp_path, monkeypatch):
    model = _tiny_for(tok, "qwen3_5_text")
    _assert_stops_before_its_first_optimizer_step(_grpo(tok, model, tmp_path), model, monkeypatch)


def _reward_model(tok, model_type):
    """A sequence-classification twin of the tiny ``model_type`` with rewards of order 1 (a unit-scale head)."""
    base = build_tiny(model_type).config
    config = base.__class__(**{**base.to_dict(), "vocab_size": len(tok), "num_labels": 1,
                               "pad_token_id": tok.pad_token_id or 0})
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").float()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return model


def _reward(tok, model, out, **options):
    from padfree.integrations.reward import RewardConfig, RewardTrainer
    from realdata import gsm8k_records

    records = gsm8k_records(8)
    pairs = datasets.Dataset.from_list([{"prompt": r["instruction"][:80] + "\n", "chosen": " " + r["output"][:60],
                                         "rejected": " " + records[(i + 1) % 8]["output"][:30]}
                                        for i, r in enumerate(records)])
    args = RewardConfig(output_dir=str(out), per_device_train_batch_size=2, max_steps=1, bf16=False,
                        activation_checkpointing=False, report_to="none", save_strategy="no", use_cpu=True,
                        disable_tqdm=True, logging_steps=1, seed=0, padding_free=True, **options)
    return RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=tok)


def test_reward_proves_its_pairs_scores(tok, tmp_path):
    """A reward model scores sequences: the proof compares the packed row's scores with each sequence scored alone,
    within the run's rounding, and a leaking control (each sequence scored after the ones before it) lands beyond."""
    trainer = _reward(tok, _reward_model(tok, "llama"), tmp_path)
    trainer.train()
    report = trainer._padfree_proof.last
    assert report is not None and report.ok and report.conclusive and report.num_sequences == 4, report
    assert report.control > 100 * report.atol, report
    assert any(h.get("padfree/verify_control_ratio", 0) > 100 for h in trainer.state.log_history)


def test_reward_with_a_broken_boundary_stops_before_its_first_optimizer_step(tok, tmp_path, monkeypatch):
    model = _reward_model(tok, "qwen3_5_text")
    _assert_stops_before_its_first_optimizer_step(_reward(tok, model, tmp_path), model, monkeypatch)
