"""padfree.SFTTrainer: the real ``trl.SFTTrainer`` on real GSM8K records, tokenized offline with the Mistral 7B
SentencePiece vocabulary, training tiny random-weight llama / qwen3_5_text models on the CPU.

Covers the automatic choice and every reason to skip it, the opt-outs and explicit settings, global packing with the
first step's loss equal to the unpacked loss, 20 training steps, completion / assistant masks through packing, the
loss rule under gradient accumulation, the telemetry, and the bad inputs.
"""

from __future__ import annotations

import copy
import itertools
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
mistral_common = pytest.importorskip("mistral_common")

import padfree.integrations.sft as psft  # noqa: E402
from padfree.errors import DataLoadError, InvalidArgumentError, UnsupportedModelError  # noqa: E402
from padfree.integrations.enable import enable  # noqa: E402
from padfree.integrations.status import packing_status  # noqa: E402
from padfree.integrations.telemetry import PackingTelemetryCallback  # noqa: E402
from padfree.integrations.trainer_data import PackedRowsCollator  # noqa: E402
from padfree.step_loss import token_losses  # noqa: E402
from realdata import gsm8k_records  # noqa: E402
from zoo import with_unknown_mixer  # noqa: E402

datasets.disable_progress_bars()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (psft.ENV_DISABLE_AUTO, *psft.ENV_RETURN_LOGITS):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def records():
    return gsm8k_records(300)


def prompt_completion(records, n):
    return datasets.Dataset.from_list([{"prompt": f"{r['instruction']}\n{r['input']}".rstrip() + "\n",
                                        "completion": r["output"]} for r in records[:n]])


def llama(tok, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config)


def qwen35(tok, seed=0):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def config(out, **kwargs):
    base = dict(output_dir=str(out), max_steps=1, per_device_train_batch_size=2, bf16=False,
                activation_checkpointing=False, report_to="none", save_strategy="no", max_length=128, use_cpu=True,
                disable_tqdm=True, logging_steps=1, seed=0)
    cls = kwargs.pop("cls", psft.SFTConfig)
    return cls(**{**base, **kwargs})


def segments(batch):
    """The sequences of a padding-free batch: ``[(input_ids, labels)]`` cut where ``position_ids`` restart."""
    ids, labels, pos = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    starts = [*torch.nonzero(pos == 0).flatten().tolist(), ids.shape[0]]
    return [(ids[a:b], labels[a:b]) for a, b in itertools.pairwise(starts)]


def unpacked_loss(model, batches):
    """Σ token losses / Σ targets over every sequence of ``batches``, each sequence run alone."""
    total, count = 0.0, 0
    for batch in batches:
        for ids, labels in segments(batch):
            logits = model(input_ids=ids[None]).logits
            loss, mask = token_losses(logits, {"labels": labels[None]})
            total, count = total + loss.sum(), count + int(mask.sum())
    return total / count, count


# --------------------------------------------------------------------------------------------------
# Automatic padding-free batching
# --------------------------------------------------------------------------------------------------


def test_auto_padding_free_on_llama(tok, records, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="padfree")
    trainer = psft.SFTTrainer(model=llama(tok), args=config(tmp_path, cls=trl.SFTConfig),
                              train_dataset=prompt_completion(records, 32), processing_class=tok)
    status = packing_status(trainer)
    assert status.mode == "padding-free batching" and status.auto and status.enabled
    assert "auto: model type 'llama'" in status.reason
    assert "padfree: padding-free batching (auto: model type 'llama'" in caplog.text
    assert trainer.args.padding_free is True and trainer.args.packing is False
    assert isinstance(trainer.data_collator, PackedRowsCollator)
    assert status.attention == "padfree_sdpa"
    assert any(isinstance(cb, PackingTelemetryCallback) for cb in trainer.callback_handler.callbacks)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    starts = (batch["position_ids"][0] == 0).nonzero().flatten()
    assert starts.numel() == 2 and bool((batch["labels"][0, starts] == -100).all())
    assert str(status).startswith("padfree: padding-free batching")


def test_skip_reasons(tok, records, tmp_path, monkeypatch, caplog):
    """Every reason to skip the automatic choice leaves TRL's standard batching, with its one-line reason."""
    caplog.set_level(logging.INFO, logger="padfree")
    ds = prompt_completion(records, 8)
    # a processor and a vision-language model are no reasons any more: tests/integrations/test_integrations_vlm.py
    cases = {
        "collator": (dict(data_collator=trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=2)),
                     "a custom data_collator (DataCollatorForLanguageModeling) was given"),
        "unsupported": (dict(model=with_unknown_mixer(llama(tok))),
                        "not supported because cannot make LlamaForCausalLM packing-exact: model.layers.0.mlp: "
                        "ToyRecurrentMixer carries state"),
    }
    for name, (kwargs, message) in cases.items():
        kwargs = {"model": llama(tok), "processing_class": tok, **kwargs}
        trainer = psft.SFTTrainer(args=config(tmp_path / name), train_dataset=ds, **kwargs)
        status = packing_status(trainer)
        assert status.mode == "standard batching" and status.auto, name
        assert message in status.reason, (name, status.reason)
        assert f"padfree: standard batching (auto padding-free skipped: {message}" in caplog.text, name
        assert trainer.args.padding_free is False and trainer.args.packing is False
        assert not isinstance(trainer.data_collator, PackedRowsCollator)
        assert not any(isinstance(cb, PackingTelemetryCallback) for cb in trainer.callback_handler.callbacks)
    for env, message in ((psft.ENV_DISABLE_AUTO, "PADFREE_DISABLE_AUTO_PADDING_FREE=1 is set"),
                         ("PADFREE_RETURN_LOGITS", "PADFREE_RETURN_LOGITS=1 asks for logits to be returned")):
        monkeypatch.setenv(env, "1")
        trainer = psft.SFTTrainer(model=llama(tok), args=config(tmp_path / env), train_dataset=ds,
                                  processing_class=tok)
        assert packing_status(trainer).mode == "standard batching"
        assert message in packing_status(trainer).reason
        monkeypatch.delenv(env)


def test_config_opt_out_and_explicit_settings_win(tok, records, tmp_path, monkeypatch):
    ds = prompt_completion(records, 8)

    def build(args):
        return packing_status(psft.SFTTrainer(model=llama(tok), args=args, train_dataset=ds, processing_class=tok))

    assert "auto_padding_free=False" in build(config(tmp_path / "a", auto_padding_free=False)).reason
    plain = config(tmp_path / "b", cls=trl.SFTConfig)
    plain.auto_padding_free = False  # the attribute works on a plain trl.SFTConfig too
    assert build(plain).mode == "standard batching"
    explicit_off = build(config(tmp_path / "c", padding_free=False))
    assert (explicit_off.mode, explicit_off.reason, explicit_off.auto) == ("standard batching", "padding_free=False",
                                                                            False)
    monkeypatch.setenv(psft.ENV_DISABLE_AUTO, "1")
    on = build(config(tmp_path / "d", cls=trl.SFTConfig, padding_free=True))  # TRL would refuse max_length here
    assert (on.mode, on.reason, on.auto) == ("padding-free batching", "padding_free=True", False)
    packed = build(config(tmp_path / "e", packing=True))
    assert packed.mode == "sample packing" and packed.packing and packed.rows >= 4
    monkeypatch.setenv(psft.ENV_DISABLE_AUTO, "maybe")
    with pytest.raises(InvalidArgumentError, match="PADFREE_DISABLE_AUTO_PADDING_FREE='maybe' is not a flag"):
        build(config(tmp_path / "f"))


# --------------------------------------------------------------------------------------------------
# Global packing
# --------------------------------------------------------------------------------------------------


class RecordingSFT(trl.SFTTrainer):
    """A user's own SFTTrainer subclass (made padfree by ``enable``) that keeps the micro-batches it trained on."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = [*getattr(self, "seen", []), {k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)}]
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses = [*getattr(self, "losses", []), float(loss)]
        return loss


def test_packing_first_step_loss_equals_unpacked_and_it_learns(tok, records, tmp_path, caplog):
    """Sample packing through enable(): the first step's loss is its sequences' loss run one by one, and 8 steps
    (4 logs, 2 steps apart; 20 steps before, with the same checks) lower the loss and log the telemetry."""
    caplog.set_level(logging.INFO, logger="padfree")
    ds = prompt_completion(records, 300)
    model = llama(tok)
    reference = copy.deepcopy(model)  # never configured: runs transformers' own code on one sequence at a time
    cls = enable(RecordingSFT)
    assert issubclass(cls, RecordingSFT) and issubclass(cls, psft.SFTMixin)
    trainer = cls(model=model, args=config(tmp_path, packing=True, max_length=256, max_steps=8, logging_steps=2,
                                            per_device_train_batch_size=1, learning_rate=1e-3),
                  train_dataset=ds, processing_class=tok)
    status = packing_status(trainer)
    assert status.mode == "sample packing" and trainer.args.packing and trainer.args.padding_free
    assert status.sequences == 300 and status.efficiency > 0.9
    assert trainer.train_dataset.column_names == ["input_ids", "labels", "position_ids", "seq_lens"]
    assert status.rows == len(trainer.train_dataset) < 300
    assert "sample packing (packing=True: global obfd packing into rows of max_length=256)" in caplog.text

    # completion-only loss survives packing: every packed sequence carries TRL's labels for it
    tokenized = trl.SFTTrainer(model=llama(tok), args=config(tmp_path / "plain", cls=trl.SFTConfig, max_length=256),
                               train_dataset=ds, processing_class=tok).train_dataset
    want = {tuple(r["input_ids"]): r["labels"] for r in tokenized}
    first_rows = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    for ids, labels in segments(first_rows):
        expected = want[tuple(ids.tolist())]
        assert labels.tolist() == [-100, *expected[1:]]
        assert labels.tolist().count(-100) > 10  # the prompt is masked

    trainer.train()
    # the loss of the first step (one micro-batch, initial weights) is the loss of its sequences run one by one
    loss, count = unpacked_loss(reference, trainer.seen[:1])
    assert count == int((trainer.seen[0]["labels"][:, 1:] != -100).sum())
    rel = abs(trainer.losses[0] - loss.item()) / loss.item()
    assert rel <= 1e-5, rel
    assert trainer.state.global_step == 8
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # it learns
    telemetry = [h for h in trainer.state.log_history if "padfree/real_token_fraction" in h]
    assert len(telemetry) == 4 and telemetry[0]["padfree/real_token_fraction"] == 1.0
    assert telemetry[0]["padfree/sequences_per_row"] > 1 and telemetry[0]["padfree/attention"] == "padfree_sdpa"
    assert 0 < telemetry[0]["padfree/attention_flops_saved"] < 1 and telemetry[0]["padfree/tokens_per_second"] > 0


def test_assistant_masks_and_split_strategy_survive_packing(tok, tmp_path):
    """A tokenized dataset with TRL's ``assistant_masks``: TRL folds them into labels, padfree packs them; with
    ``packing_strategy="bfd_split"`` sequences longer than ``max_length`` become pieces instead of being cut."""
    rows = []
    for n in (30, 45, 12, 70, 25, 9):
        ids = [(7 * k + n) % 30000 + 100 for k in range(n)]
        rows.append({"input_ids": ids, "assistant_masks": [0] * (n // 2) + [1] * (n - n // 2)})
    ds = datasets.Dataset.from_list(rows)
    trainer = psft.SFTTrainer(model=llama(tok), args=config(tmp_path, packing=True, max_length=64,
                                                            packing_strategy="bfd_split"),
                              train_dataset=ds, processing_class=tok)
    status = packing_status(trainer)
    assert status.sequences == 7 and status.rows == len(trainer.train_dataset)  # the 70-token row is 2 pieces
    by_first = {r["input_ids"][0]: r for r in rows}
    for row in trainer.train_dataset:
        for ids, labels in segments({k: torch.tensor([v]) for k, v in row.items() if k != "seq_lens"}):
            source = by_first.get(int(ids[0]))
            if source is None:  # the second piece of the split sequence: its own sequence, first label masked
                assert labels[0] == -100 and len(ids) == 70 - 64
                continue
            want = [t if m else -100 for t, m in zip(source["input_ids"], source["assistant_masks"], strict=False)]
            assert labels.tolist() == [-100, *want[1:len(ids)]]


def test_gradient_accumulation_update_equals_unpacked(tok, records, tmp_path):
    """One SGD step (lr 1) over 4 accumulated padding-free micro-batches moves every parameter by exactly minus the
    gradient of the unpacked loss: Σ token losses / Σ targets (or the mean of per-sequence means)."""
    metrics = {}
    for loss_mode, fused, mode in (("token", False, {}), ("sequence", False, {}), ("token", True, {}),
                                   ("token", True, {"packing": True}), ("sequence", True, {"packing": True})):
        model = llama(tok)
        reference = copy.deepcopy(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = config(tmp_path / f"{loss_mode}{fused}{mode}", per_device_train_batch_size=3,
                      gradient_accumulation_steps=4, max_length=96, learning_rate=1.0, lr_scheduler_type="constant",
                      optim="sgd", max_grad_norm=0.0, weight_decay=0.0, padfree_loss=loss_mode,
                      padfree_fused_loss=fused, **mode)
        trainer = psft.SFTTrainer(model=model, args=args, train_dataset=prompt_completion(records, 12),
                                  processing_class=tok)
        assert packing_status(trainer).loss == loss_mode
        trainer.train()
        total, count, per_sequence = 0.0, 0, []
        for batch in trainer.get_train_dataloader():  # the step's sequences, each run alone
            for ids, labels in segments(batch):
                logits = reference(input_ids=ids[None]).logits
                loss, mask = token_losses(logits, {"labels": labels[None]})
                total, count = total + loss.sum(), count + int(mask.sum())
                per_sequence.append(loss.sum() / mask.sum())
        (total / count if loss_mode == "token" else torch.stack(per_sequence).mean()).backward()
        grads = dict(reference.named_parameters())
        diff = max(float((p.detach() - before[n] + grads[n].grad).abs().max()) for n, p in model.named_parameters())
        assert diff <= 1e-5, (loss_mode, fused, mode, diff)
        logged = trainer.state.log_history[0]
        metrics[loss_mode, fused, tuple(mode)] = {k: logged[k] for k in ("loss", "entropy", "mean_token_accuracy")}
    # without logits, the fused pass reports the same entropy and token accuracy as TRL's own head
    for key in ("loss", "entropy", "mean_token_accuracy"):
        assert metrics["token", True, ()][key] == pytest.approx(metrics["token", False, ()][key], rel=1e-4), key
    with pytest.raises(InvalidArgumentError, match="padfree_fused_loss must be True or False"):
        psft.SFTTrainer(model=llama(tok), args=config(tmp_path / "bad", padfree_fused_loss="yes"),
                        train_dataset=prompt_completion(records, 4), processing_class=tok)


def test_qwen3_5_text_hybrid(tok, records, tmp_path, caplog):
    """The hybrid GatedDeltaNet model: auto padding-free on, packing exact (first-step loss = unpacked loss)."""
    caplog.set_level(logging.INFO, logger="padfree")
    ds = prompt_completion(records, 24)
    auto = psft.SFTTrainer(model=qwen35(tok), args=config(tmp_path / "auto"), train_dataset=ds,
                           processing_class=tok)
    status = packing_status(auto)
    assert status.mode == "padding-free batching" and "qwen3_5_text" in status.reason
    assert status.mixers and all("GatedDeltaNet" in impl or "gated" in impl.lower() for impl in status.mixers.values())
    model = qwen35(tok)
    reference = copy.deepcopy(model)
    trainer = enable(RecordingSFT)(model=model, args=config(tmp_path / "pack", packing=True, max_length=192,
                                                             max_steps=3),
                                   train_dataset=ds, processing_class=tok)
    trainer.train()
    loss, _ = unpacked_loss(reference, trainer.seen[:1])
    assert len(segments(trainer.seen[0])) > 1
    rel = abs(trainer.losses[0] - loss.item()) / loss.item()
    assert rel <= 1e-5, rel
    # a micro-batch holding a single sequence runs transformers' own code: no flash kwargs may reach it
    single = trainer.data_collator([{"input_ids": trainer.seen[0]["input_ids"][0, :20].tolist()}])
    assert torch.isfinite(trainer.model(**single).loss)
    logged = [h for h in trainer.state.log_history if "padfree/mixers" in h]
    assert logged and "linear_attn" in logged[0]["padfree/mixers"]


def test_bad_input(tok, records, tmp_path):
    ds = prompt_completion(records, 4)
    collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=2)

    def build(model=None, dataset=ds, **kwargs):
        extra = {k: kwargs.pop(k) for k in ("data_collator", "processing_class") if k in kwargs}
        return psft.SFTTrainer(model=model or llama(tok), args=config(tmp_path, **kwargs), train_dataset=dataset,
                                **{"processing_class": tok, **extra})

    with pytest.raises(InvalidArgumentError, match="packing=True needs padfree's exact collator, but a custom "
                                                   "data_collator"):
        build(packing=True, data_collator=collator)
    with pytest.raises(InvalidArgumentError, match="padding_free=True needs padfree's exact collator"):
        build(padding_free=True, data_collator=collator)
    for bad in (None, 0, -3):
        with pytest.raises(InvalidArgumentError, match=f"packing=True needs max_length.*got max_length={bad}"):
            build(packing=True, max_length=bad)
    with pytest.raises(DataLoadError, match=r"columns \['answer', 'question'\]: no 'input_ids' and no text field "
                                            r"'text'"):
        build(dataset=datasets.Dataset.from_list([{"question": "q", "answer": "a"}]))
    with pytest.raises(UnsupportedModelError, match=r"packing=True: padfree is not supported because .*"
                                                    r"ToyRecurrentMixer carries state"):
        build(model=with_unknown_mixer(llama(tok)), packing=True)
    with pytest.raises(InvalidArgumentError, match=r"packing_strategy='tightest'.*not one padfree packs exactly"):
        build(packing=True, packing_strategy="tightest")
    with pytest.raises(InvalidArgumentError, match="packing=True with padding_free=False"):
        build(packing=True, padding_free=False)
    with pytest.raises(InvalidArgumentError, match="padfree_loss must be one of"):
        build(padfree_loss="mean")
    # padfree's own NLL (the sequence rule, the fused loss) would silently replace another loss: refused
    with pytest.raises(InvalidArgumentError, match=r"padfree_loss='sequence' computes.*loss_type='dft'"):
        build(padfree_loss="sequence", loss_type="dft")
    with pytest.raises(InvalidArgumentError, match=r"padfree_fused_loss=True computes.*loss_type='dft'"):
        build(padfree_fused_loss=True, loss_type="dft")
    with pytest.raises(InvalidArgumentError, match=r"padfree_fused_loss=True computes.*label_smoothing_factor=0.1"):
        build(padfree_fused_loss=True, label_smoothing_factor=0.1)
    with pytest.raises(InvalidArgumentError, match=r"padfree_fused_loss=True computes.*a compute_loss_func"):
        psft.SFTTrainer(model=llama(tok), args=config(tmp_path, padfree_fused_loss=True), train_dataset=ds,
                        processing_class=tok, compute_loss_func=lambda outputs, labels, **kw: outputs.loss)
    with pytest.raises(InvalidArgumentError, match=r"packing=True packs the whole dataset at once.*IterableDataset"):
        build(packing=True, dataset=ds.to_iterable_dataset())
    with pytest.raises(InvalidArgumentError, match="enable takes a trainer class"):
        enable(build())


def test_wrapped_packing_cuts_full_rows_whose_pieces_are_sequences_of_their_own(tmp_path, tok, records):
    """``packing_strategy="wrapped"``: TRL's full rows of the whole token stream in order, but every piece of a cut
    sequence is a sequence of its own, so the configured model computes on each piece what the piece computes
    alone; the same row read as one sequence (what TRL's wrapped rows, which carry no boundaries, are) is not."""
    ds = prompt_completion(records, 40)
    trainer = psft.SFTTrainer(model=llama(tok), args=config(tmp_path, packing=True, packing_strategy="wrapped"),
                              train_dataset=ds, processing_class=tok)
    assert packing_status(trainer).mode == "sample packing"
    rows = trainer.train_dataset
    assert all(len(r["input_ids"]) == 128 for r in rows.select(range(len(rows) - 1)))
    plain = trl.SFTTrainer(model=llama(tok), args=config(tmp_path / "plain", cls=trl.SFTConfig, max_length=None),
                           train_dataset=ds, processing_class=tok).train_dataset
    assert [t for r in rows for t in r["input_ids"]] == [t for r in plain for t in r["input_ids"]]
    model = trainer.model.eval()
    worst, glued = 0.0, 0.0
    for i in range(3):
        batch = trainer.data_collator([rows[i]])
        starts = batch["position_ids"][0] == 0
        cuts = [*torch.nonzero(starts).flatten().tolist(), batch["input_ids"].shape[1]]
        assert (batch["labels"][0][cuts[:-1]] == -100).all()
        with torch.no_grad():
            packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
            whole = model(input_ids=batch["input_ids"]).logits[0]
            for a, b in itertools.pairwise(cuts):
                alone = model(input_ids=batch["input_ids"][:, a:b]).logits[0]
                worst = max(worst, float((packed[a:b] - alone).abs().max()))
                glued = max(glued, float((whole[a:b] - alone).abs().max()))
    assert worst <= 1e-5 and glued > 1e-3
