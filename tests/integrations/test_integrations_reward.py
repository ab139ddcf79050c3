"""padfree's RewardTrainer against TRL's padded ``trl.RewardTrainer``, on preference pairs built from real GSM8K records
(the prompt, its own answer as chosen, another record's answer cut short as rejected), tokenized offline with the
Mistral 7B SentencePiece vocabulary, scored by tiny random-weight llama and qwen3_5_text (GatedDeltaNet hybrid)
sequence-classification models on the CPU.

Covers: eval loss and every eval metric equal to the padded trainer's (and negative controls: the same packed row
without padfree's configuration, or pooled at the wrong token, differs), one optimizer step with gradient
accumulation equal to the padded step, the same on 2 gloo ranks, and the decision (refusals, the automatic choice,
its opt-out, ``packing_status``).
"""

from __future__ import annotations

import logging
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
mistral_common = pytest.importorskip("mistral_common")

from multiproc import as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree.errors import InvalidArgumentError, UnsupportedModelError  # noqa: E402
from padfree.integrations.decide import ENV_DISABLE_AUTO, ENV_RETURN_LOGITS  # noqa: E402
from padfree.integrations.reward import (  # noqa: E402
    RewardConfig,
    RewardTrainer,
    score_head_reason,
    unpadded_scores,
)
from padfree.integrations.status import packing_status  # noqa: E402
from padfree.integrations.unpadded import Unpadded  # noqa: E402
from realdata import gsm8k_records  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = 12
METRICS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (ENV_DISABLE_AUTO, *ENV_RETURN_LOGITS):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def pairs():
    """Preference pairs from the shortest GSM8K records of the first 300 (about 60-130 tokens each): the rejected
    answer is another record's, cut to a quarter, half, three quarters or all of it; with TRL's optional ``margin``
    (which TRL's loss subtracts, and which TRL also hands the model as a keyword argument)."""
    records = gsm8k_records(300)
    keep = sorted(range(len(records)), key=lambda i: len(records[i]["instruction"] + records[i]["output"]))
    chosen = [records[i] for i in sorted(keep[:PAIRS])]
    others = [records[i]["output"] for i in sorted(keep[PAIRS:2 * PAIRS])]
    return datasets.Dataset.from_list([
        {"prompt": f"{r['instruction']}\n{r['input']}".rstrip() + "\n", "chosen": r["output"],
         "rejected": other[: max(8, len(other) * (i % 4 + 1) // 4)], "margin": 0.5 * (i % 3)}
        for i, (r, other) in enumerate(zip(chosen, others, strict=True))])


@pytest.fixture(scope="module")
def tokenized(tok, pairs, tmp_path_factory):
    """The pairs tokenized by TRL itself (``chosen_ids`` / ``rejected_ids``, EOS appended), for the trainers that
    do not need to tokenize again."""
    trainer = trl.RewardTrainer(model=llama(len(tok)), args=config(tmp_path_factory.mktemp("tok"), trl.RewardConfig),
                                train_dataset=pairs, processing_class=tok)
    return trainer.train_dataset


def llama(vocab, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   num_labels=1)
    return _scaled(transformers.LlamaForSequenceClassification(cfg))


def qwen35(vocab, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"], num_hidden_layers=2, num_labels=1)
    return _scaled(transformers.AutoModelForSequenceClassification.from_config(cfg, attn_implementation="sdpa").float())


def _scaled(model):
    """Rewards of order 1 (the default head's 0.02 scale makes every reward about 0 and every loss about log 2)."""
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return model


MODELS = {"llama": llama, "qwen3_5_text": qwen35}


def config(out, cls=RewardConfig, **kwargs):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=4, max_steps=1,
                bf16=False, activation_checkpointing=False, report_to="none", save_strategy="no", use_cpu=True,
                disable_tqdm=True, logging_steps=1, seed=0, center_rewards_coefficient=0.01)
    return cls(**{**base, **kwargs})


class PackedCalls:
    """What reaches a backbone: per call, the ``input_ids`` shape and whether an ``attention_mask`` came with it."""

    def __init__(self, backbone):
        self.calls = []
        self.handle = backbone.register_forward_pre_hook(self.note, with_kwargs=True)

    def note(self, module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        self.calls.append((tuple(ids.shape), kwargs.get("attention_mask") is not None))


class GradTap(transformers.TrainerCallback):
    """The gradient of every parameter just before the optimizer step (after accumulation and DDP's average)."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def worst_rel(got, want):
    """The largest difference of any tensor, relative to that tensor's largest magnitude."""
    return max(float((got[n] - want[n]).abs().max()) / float(want[n].abs().max()) for n in want
               if float(want[n].abs().max()) > 0)


def norm_rel(got, want):
    """The norm of the difference of every tensor together, relative to the norm of ``want``."""
    diff = sum(float((got[n] - want[n]).double().square().sum()) for n in want)
    return (diff / sum(float(want[n].double().square().sum()) for n in want)) ** 0.5


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def unconfigured_packed_logits(model, batch):
    """The head's logits with the backbone fed the very packed row padfree builds (``Unpadded``: real tokens back to
    back, positions restarting) — but by hooks of this test, so nothing made the backbone packing-exact unless
    something else did."""
    layout = Unpadded.from_attention_mask(batch["attention_mask"])

    def before(module, args, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}
        return (), {**kwargs, "input_ids": layout.pack(args[0]), "position_ids": layout.position_ids}

    def after(module, args, kwargs, out):
        out["last_hidden_state"] = layout.unpack(out["last_hidden_state"])
        return out

    handles = [model.model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
               model.model.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------------
# Exactness against TRL's padded trainer
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_eval_equals_padded_trainer(kind, tok, pairs, tmp_path):
    build = MODELS[kind]
    padded = trl.RewardTrainer(model=build(len(tok)), args=config(tmp_path / "a", trl.RewardConfig),
                               train_dataset=pairs, eval_dataset=pairs, processing_class=tok)
    model = build(len(tok))
    trainer = RewardTrainer(model=model, args=config(tmp_path / "b", padding_free=True), train_dataset=pairs,
                            eval_dataset=pairs, processing_class=tok)
    status = packing_status(trainer)
    assert status.mode == "padding-free batching" and not status.auto and status.attention == "padfree_sdpa"
    if kind == "qwen3_5_text":
        assert any("GatedDeltaNet" in impl for impl in status.mixers.values())
    seen = PackedCalls(model.model)
    want, got = padded.evaluate(), trainer.evaluate()
    seen.handle.remove()
    # every eval batch (4 pairs = 8 sequences) reached the backbone as one unpadded row
    assert len(seen.calls) == PAIRS // 4 and all(shape[0] == 1 and not mask for shape, mask in seen.calls)
    diffs = {key: rel(got[f"eval_{key}"], want[f"eval_{key}"]) for key in METRICS}
    assert max(diffs.values()) <= 1e-5, diffs
    assert 0.0 < want["eval_accuracy"] < 1.0 and want["eval_max_reward"] - want["eval_min_reward"] > 0.1

    # negative controls on the first eval batch: the exact packed row scores like the padded batch, the same row
    # through an unconfigured backbone does not, nor does pooling each sequence's last real token (its EOS: TRL
    # pads with EOS, so the head pools the token before it)
    batch = {k: v for k, v in next(iter(trainer.get_eval_dataloader())).items() if k in ("input_ids",
                                                                                        "attention_mask")}
    reference = build(len(tok)).eval()
    reference.config.pad_token_id = tok.eos_token_id
    with torch.no_grad():
        want_scores = reference(**batch).logits
        per_token = reference.score(reference.model(**batch).last_hidden_state)
        last_real = per_token[torch.arange(len(per_token)), batch["attention_mask"].sum(1) - 1]
        with unpadded_scores(model):
            exact = model.eval()(**batch).logits
    leaky = unconfigured_packed_logits(reference, batch)
    assert float((exact - want_scores).abs().max()) <= 1e-5
    gap_leak = float((leaky - want_scores).abs().max())
    gap_pool = float((last_real - want_scores).abs().max())
    print(f"{kind}: max relative difference of the eval metrics {max(diffs.values()):.2e} ({diffs}); "
          f"unconfigured packed row off by {gap_leak:.3g}, last-token pooling off by {gap_pool:.3g}")
    assert gap_pool > 1e-3
    if kind == "qwen3_5_text":  # the GatedDeltaNet state runs on across sequences without padfree
        assert gap_leak > 1e-3


def test_unconfigured_llama_leaks_without_padfree(tok, tokenized):
    """llama's attention, unconfigured, attends across the packed row's sequences: the negative control for llama."""
    model = llama(len(tok)).eval()
    model.config.pad_token_id = tok.eos_token_id
    collate = trl.trainer.reward_trainer.DataCollatorForPreference(pad_token_id=tok.eos_token_id)
    batch = collate([tokenized[i] for i in range(4)])
    with torch.no_grad():
        want = model(**batch).logits
    gap = float((unconfigured_packed_logits(model, batch) - want).abs().max())
    assert gap > 1e-3, gap


STEP = dict(gradient_accumulation_steps=2, optim="sgd", learning_rate=1.0, weight_decay=0.0, max_grad_norm=0.0,
            lr_scheduler_type="constant")


def one_step(cls, cfg_cls, model, out, data, tok, **options):
    """One optimizer step (SGD, lr 1, 2 accumulated micro-batches of 2 pairs): the trainer, the gradient it stepped
    with and the parameters after it."""
    tap = GradTap()
    trainer = cls(model=model, args=config(out, cfg_cls, **STEP, **options), train_dataset=data, processing_class=tok,
                  callbacks=[tap])
    trainer.train()
    return trainer, tap.grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_one_step_with_accumulation_equals_padded(kind, tok, tokenized, tmp_path):
    """The step's gradient, the parameters after it and the logged loss equal TRL's padded step's."""
    build = MODELS[kind]
    padded, want_grads, want = one_step(trl.RewardTrainer, trl.RewardConfig, build(len(tok)), tmp_path / "a",
                                        tokenized, tok)
    model = build(len(tok))
    seen = PackedCalls(model.model)
    # the in-run proof's own forwards are left out: this test counts the step's (the proof: test_integrations_inrun)
    trainer, grads, got = one_step(RewardTrainer, RewardConfig, model, tmp_path / "b", tokenized, tok,
                                   padfree_verify=False)
    seen.handle.remove()
    status = packing_status(trainer)
    assert status.mode == "padding-free batching" and status.auto  # RewardConfig() lets padfree decide
    # two micro-batches, each 4 sequences in one unpadded row
    assert len(seen.calls) == 2 and all(shape[0] == 1 and not mask for shape, mask in seen.calls)
    assert trainer.state.global_step == 1 and set(grads) == set(want_grads)
    grad_gap, grad_norm_gap, param_gap = worst_rel(grads, want_grads), norm_rel(grads, want_grads), worst_rel(got, want)
    print(f"{kind}: one step, relative difference of the parameters {param_gap:.2e}, of the gradient "
          f"{grad_norm_gap:.2e} (norm), {grad_gap:.2e} (worst tensor)")
    assert param_gap <= 1e-5 and grad_norm_gap <= 1e-5
    # GatedDeltaNet's dt_bias / A_log gradients (~3e-3) are sums of much larger per-token terms that cancel: the
    # summation order alone moves them by ~1e-7 absolute, ~3e-5 relative; every other tensor agrees within 1e-6
    assert grad_gap <= 1e-4
    assert float(want_grads["score.weight"].abs().max()) > 1e-3  # the step moves the head
    assert rel(trainer.state.log_history[0]["loss"], padded.state.log_history[0]["loss"]) <= 1e-5
    # the telemetry counted the packed rows the backbone ran: no padding, 4 sequences a row
    assert trainer.state.log_history[0]["padfree/real_token_fraction"] == 1.0
    assert trainer.state.log_history[0]["padfree/sequences_per_row"] == 4.0
    assert "padfree/real_token_fraction" not in padded.state.log_history[0]


# --------------------------------------------------------------------------------------------------
# Data parallel: 2 gloo ranks
# --------------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, tmp: str, port: int, tok, data) -> None:
    """One rank: one optimizer step (2 accumulated micro-batches of 2 pairs) of TRL's padded trainer, then of
    padfree's, each on its own copy of the same model."""
    import warnings

    warnings.filterwarnings("ignore")
    as_launched_rank(rank, world, port)
    out = {}
    for name, cls, cfg_cls in (("padded", trl.RewardTrainer, trl.RewardConfig),
                               ("padfree", RewardTrainer, RewardConfig)):
        trainer, grads, params = one_step(cls, cfg_cls, llama(len(tok)), f"{tmp}/{name}", data, tok)
        out[name] = {"grads": grads, "params": params, "mode": packing_status(trainer).mode,
                     "group": (trainer.args.process_index, trainer.args.world_size),
                     "ddp": type(trainer.model_wrapped).__name__, "loss": trainer.state.log_history[0]["loss"]}
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


@pytest.mark.slow
def test_two_gloo_ranks_step_equals_padded(tok, tokenized, tmp_path):
    llama(len(tok))  # warm-up that both forked children inherit
    ranks = run_ranks(_worker, tmp_path, free_port(), tok, tokenized, deadline=150)
    for rank, r in enumerate(ranks):
        assert r["padfree"]["group"] == (rank, 2) and r["padfree"]["ddp"] == "DistributedDataParallel"
        assert r["padfree"]["mode"] == "padding-free batching" and r["padded"]["mode"] == "standard batching"
        grad_gap = worst_rel(r["padfree"]["grads"], r["padded"]["grads"])
        param_gap = worst_rel(r["padfree"]["params"], r["padded"]["params"])
        print(f"rank {rank}: max relative difference of the parameters {param_gap:.2e}, of the gradients "
              f"{grad_gap:.2e} (worst tensor)")
        assert grad_gap <= 1e-5 and param_gap <= 1e-5
        assert rel(r["padfree"]["loss"], r["padded"]["loss"]) <= 1e-5
    # DDP averaged the two ranks' gradients (each rank saw its own pairs): both ranks took the same step
    a, b = ranks[0]["padfree"]["params"], ranks[1]["padfree"]["params"]
    assert max(float((a[n] - b[n]).abs().max()) for n in a) == 0.0
    assert worst_rel(ranks[0]["padfree"]["grads"], ranks[1]["padfree"]["grads"]) == 0.0


# --------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------


def test_padding_free_with_custom_collator_is_refused(tok, tokenized, tmp_path):
    collator = trl.trainer.reward_trainer.DataCollatorForPreference(pad_token_id=tok.eos_token_id)
    with pytest.raises(InvalidArgumentError, match=r"padding_free=True needs padfree's exact collator.*"
                                                   r"DataCollatorForPreference"):
        RewardTrainer(model=llama(len(tok)), args=config(tmp_path, padding_free=True), data_collator=collator,
                      train_dataset=tokenized, processing_class=tok)
    # the automatic choice skips instead, and says why
    trainer = RewardTrainer(model=llama(len(tok)), args=config(tmp_path), data_collator=collator,
                            train_dataset=tokenized, processing_class=tok)
    status = packing_status(trainer)
    assert status.mode == "standard batching" and status.auto and "custom data_collator" in status.reason


def test_env_opt_out_runs_standard(tok, pairs, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="padfree")
    monkeypatch.setenv(ENV_DISABLE_AUTO, "1")
    model = llama(len(tok))
    trainer = RewardTrainer(model=model, args=config(tmp_path), train_dataset=pairs,
                            eval_dataset=pairs.select(range(4)), processing_class=tok)
    status = packing_status(trainer)
    assert status.mode == "standard batching" and status.auto and not status.enabled
    assert f"{ENV_DISABLE_AUTO}=1 is set" in status.reason and trainer.args.padding_free is False
    assert f"padfree: standard batching (auto padding-free skipped: {ENV_DISABLE_AUTO}=1" in caplog.text
    seen = PackedCalls(model.model)
    metrics = trainer.evaluate()
    seen.handle.remove()
    assert seen.calls == [((8, seen.calls[0][0][1]), True)]  # TRL's padded batch, with its mask
    assert metrics["eval_loss"] > 0
    # an explicit padding_free=True wins over the environment's opt-out
    explicit = RewardTrainer(model=llama(len(tok)), args=config(tmp_path / "x", padding_free=True),
                             train_dataset=pairs, processing_class=tok)
    assert packing_status(explicit).mode == "padding-free batching" and not packing_status(explicit).auto


def test_status_reports_each_mode(tok, tokenized, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="padfree")
    auto = RewardTrainer(model=llama(len(tok)), args=config(tmp_path / "auto", trl.RewardConfig),
                         train_dataset=tokenized, processing_class=tok)
    status = packing_status(auto)
    assert status.mode == "padding-free batching" and status.auto and status.model_type == "llama"
    assert "auto: model type 'llama' is packing-exact" in status.reason and auto.args.padding_free is True
    assert str(status).startswith("padfree: padding-free batching (auto: model type 'llama'")
    assert "padfree: padding-free batching" in caplog.text
    off = RewardTrainer(model=llama(len(tok)), args=config(tmp_path / "off", padding_free=False),
                        train_dataset=tokenized, processing_class=tok)
    assert packing_status(off).mode == "standard batching" and packing_status(off).reason == "padding_free=False"
    assert not packing_status(off).auto and off.args.padding_free is False
    with pytest.raises(InvalidArgumentError, match="padding_free must be True, False or None"):
        RewardTrainer(model=llama(len(tok)), args=config(tmp_path / "bad", padding_free="yes"),
                      train_dataset=tokenized, processing_class=tok)


def test_heads_padfree_cannot_feed_are_named(tok, tokenized, tmp_path, caplog):
    gpt2 = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=1024, num_labels=1))
    assert "GPT2ForSequenceClassification" in score_head_reason(gpt2)
    with pytest.raises(UnsupportedModelError, match="padding_free=True: GPT2ForSequenceClassification is not a "
                                                    "sequence-classification model of transformers' generic kind"):
        RewardTrainer(model=gpt2, args=config(tmp_path, padding_free=True), train_dataset=tokenized,
                      processing_class=tok)
    caplog.set_level(logging.WARNING, logger="padfree")
    trainer = RewardTrainer(model=gpt2, args=config(tmp_path), train_dataset=tokenized, processing_class=tok)
    status = packing_status(trainer)
    assert status.mode == "standard batching" and "GPT2ForSequenceClassification" in status.reason
    assert "GPT2ForSequenceClassification" in caplog.text
    causal = transformers.LlamaForCausalLM(llama(len(tok)).config)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM is not a sequence-classification model"), \
            unpadded_scores(causal):
        pass


def test_a_row_pooled_at_padding_is_refused(tok):
    """A collator that pads with another id than the model's pad token makes the head pool padding, which a packed
    row has no hidden state for: refused, not scored differently."""
    model = llama(len(tok)).eval()
    model.config.pad_token_id = tok.eos_token_id
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    with unpadded_scores(model), torch.no_grad():
        with pytest.raises(InvalidArgumentError, match=r"row 1 of the batch would be scored at padding position 3"):
            model(input_ids=ids, attention_mask=(ids != 0).long())
        ids[1, 2:] = tok.eos_token_id  # padded with the pad token: fine
        assert model(input_ids=ids, attention_mask=(ids != 0).long() * (ids != 2).long()).logits.shape == (2, 1)
