"""``padfree.DPOTrainer`` against TRL's padded ``DPOTrainer``, on real preference pairs and tiny models.

The pairs are GSM8K records tokenized offline with the Mistral vocabulary: prompt = the question, chosen = its
answer, rejected = another record's answer cut to a few lengths (so chosen and rejected differ in length several
times over, as real pairs do). The policy is the reference with every weight perturbed (noise of std 0.5), so
log-ratios, rewards and margins are far from zero: near zero, fp32 rounding of log-prob sums of ~-500 (one ulp is
3e-5) would dominate a relative comparison of their differences.

Every comparison is TRL's own padded trainer on the same pairs (fp32): per loss type the micro-batch loss and every
metric TRL logs, the whole ``evaluate()`` (``eval_loss``, rewards, margins, logps, accuracies), the precomputed
reference log-probs, one optimizer step with gradient accumulation 2, pairs packed across the dataset, and 2 gloo
ranks. A leaking forward (the packed row without restarting positions, or a hybrid model left unconfigured) is
caught by the same comparisons.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
pytest.importorskip("mistral_common")

import padfree  # noqa: E402
from multiproc import as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree.errors import InvalidArgumentError, PackingDisabledError  # noqa: E402
from padfree.integrations.dpo import DPOConfig, DPOTrainer, pack_pairs  # noqa: E402
from padfree.integrations.unpadded import Unpadded  # noqa: E402
from padfree.model import row_blocks  # noqa: E402
from realdata import gsm8k_records  # noqa: E402
from zoo import cut_inside_segments, mistral_tokenizer_from  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL_TYPES = ("llama", "qwen3_5_text")
RTOL, ATOL = 1e-5, 1e-7  # fp32; ATOL only for metrics that are ~0 (margins of a barely trained policy)
# every loss type TRL 1.16's DPOTrainer implements, with the settings each needs
LOSS_VARIANTS = [
    *[({"loss_type": [t]}) for t in ("sigmoid", "hinge", "ipo", "nca_pair", "bco_pair", "sppo_hard", "aot",
                                     "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")],
    {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    {"loss_type": ["robust"], "label_smoothing": 0.1},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    {"loss_type": ["sigmoid"], "use_weighting": True},
    {"loss_type": ["sigmoid"], "ld_alpha": 0.5},
    {"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"},
    {"loss_type": ["hinge"], "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
]
_ATTRS = {"loss_type": "loss_types", "loss_weights": "loss_weights", "label_smoothing": "label_smoothing",
          "use_weighting": "use_weighting", "ld_alpha": "ld_alpha", "f_divergence_type": "f_divergence_type",
          "f_alpha_divergence_coef": "f_alpha_divergence_coef"}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b)) + ATOL


def _pairs(n: int, offset: int = 0) -> datasets.Dataset:
    records = gsm8k_records(offset + n + 11)
    cuts = (8, 25, 60, 110)
    rows = []
    for i in range(offset, offset + n):
        other = records[i + 11]["output"]
        rows.append({"prompt": records[i]["instruction"][:100] + "\n", "chosen": " " + records[i]["output"][:120],
                     "rejected": " " + other[: cuts[i % len(cuts)]]})
    return datasets.Dataset.from_list(rows)


def _models(model_type: str, vocab: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny (policy, reference) pair of ``model_type``: the policy is the reference with its weights perturbed."""
    torch.manual_seed(0)
    extra = {"layer_types": ["linear_attention", "full_attention"]} if model_type == "qwen3_5_text" else {}
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512, **extra)
    ref = transformers.AutoModelForCausalLM.from_config(config).float()
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return policy, ref


def _args(cls, out: Path, **kw):
    base = dict(report_to="none", use_cpu=True, per_device_train_batch_size=2, per_device_eval_batch_size=4,
                max_length=160, seed=7, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                warmup_steps=0, logging_steps=1, save_strategy="no", dataloader_drop_last=False, bf16=False)
    base.update(kw)
    return cls(str(out), **base)


def _trainers(model_type, tok, tmp_path, train=None, eval_=None, trl_kw=None, pf_kw=None):
    policy, ref = _models(model_type, len(tok))
    train = _pairs(8) if train is None else train
    padded = trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref),
                            args=_args(trl.DPOConfig, tmp_path / "trl", **(trl_kw or {})), train_dataset=train,
                            eval_dataset=eval_, processing_class=tok)
    ours = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref),
                      args=_args(DPOConfig, tmp_path / "pf", **{"padding_free": True, **(pf_kw or {})}),
                      train_dataset=train, eval_dataset=eval_, processing_class=tok)
    return padded, ours


def _set_variant(trainer, variant: dict) -> None:
    defaults = {"loss_weights": None, "label_smoothing": 0.0, "use_weighting": False, "ld_alpha": None,
                "f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": 1.0}
    for key, value in {**defaults, **variant}.items():
        setattr(trainer, _ATTRS[key], value)
    if trainer.loss_weights is None:
        trainer.loss_weights = [1.0] * len(trainer.loss_types)


def _forward_once(model) -> None:
    """Keep the first output of ``model``'s (TRL fused-head) forward for a given input and give it back after: every
    loss variant below scores the same micro-batch, so the backbone runs once per model, while padfree's packing and
    unpacking of the batch (installed around this forward on first use) still runs on every call."""
    inner, cache = model.forward, {}

    def forward(*args, **kwargs):
        key = tuple((k, v.shape, hash(v.numpy().tobytes())) if isinstance(v, torch.Tensor) else (k, v)
                    for k, v in sorted(kwargs.items()))
        if key not in cache:
            cache[key] = inner(*args, **kwargs)
        return copy.copy(cache[key])

    model.forward = forward


def _loss_and_metrics(trainer, batch):
    trainer.model.eval()
    trainer._metrics["eval"].clear()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    return float(loss), metrics


# --------------------------------------------------------------------------------------------------
# every loss type and metric, on one micro-batch
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_loss_type_and_metric_equals_trl_padded(model_type, tok, tmp_path):
    kw = {"use_weighting": True}  # TRL's fused head then also returns what WPO weighting reads
    padded, ours = _trainers(model_type, tok, tmp_path, trl_kw=kw, pf_kw=kw)
    for model in (padded.model, padded.ref_model, ours.model, ours.ref_model):
        _forward_once(model)
    assert padfree.packing_status(ours).mode == "padding-free batching"
    loader = torch.utils.data.DataLoader(padded.train_dataset.select(range(4)), batch_size=4,
                                         collate_fn=padded.data_collator)
    batch = next(iter(loader))
    assert (batch["attention_mask"] == 0).float().mean() > 0.2  # the padded batch is largely padding
    # the variants need real log-ratio differences: the policy is not the reference
    for variant in LOSS_VARIANTS:
        _set_variant(padded, variant)
        _set_variant(ours, variant)
        want, want_metrics = _loss_and_metrics(padded, batch)
        got, got_metrics = _loss_and_metrics(ours, batch)
        assert math.isfinite(want) and _close(want, got), (variant, want, got)
        assert set(want_metrics) == set(got_metrics)
        for key, value in want_metrics.items():
            assert _close(value, got_metrics[key]), (variant, key, value, got_metrics[key])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_row_log_probs_equal_padded_and_a_leaking_row_is_caught(model_type, tok, tmp_path):
    """The per-sequence log-prob sums of one packed micro-batch equal the padded forward's; the same row with
    positions running on across sequences (no boundary), or a hybrid left unconfigured, is off by far more."""
    policy, _ = _models(model_type, len(tok))
    padded, _ = _trainers(model_type, tok, tmp_path)
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    trl.trainer.utils.add_fused_lm_head(policy)
    with torch.no_grad():
        want = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                      fused_lm_head=True).log_probs.sum(1)
        layout = Unpadded.from_attention_mask(batch["attention_mask"])
        packed = dict(input_ids=layout.pack(batch["input_ids"]), labels=layout.labels(labels), fused_lm_head=True)
        padfree.configure_packing(policy)
        exact = layout.unpack_shifted(policy(**packed, position_ids=layout.position_ids).log_probs).sum(1)
        leak = layout.unpack_shifted(policy(**packed).log_probs).sum(1)  # positions 0..T-1: one long sequence
        padfree.unconfigure_packing(policy)
        unconfigured = layout.unpack_shifted(policy(**packed, position_ids=layout.position_ids).log_probs).sum(1)
    rel = ((exact - want).abs() / want.abs()).max().item()
    assert rel <= RTOL, rel
    assert ((leak - want).abs() / want.abs()).max().item() > 1e-3
    if model_type == "qwen3_5_text":  # stock transformers resets attention at restarting positions, not GatedDeltaNet
        # sums of several hundred nats: the leak is > 300 ulps of them (one is 3e-5), a margin error DPO would feel
        assert (unconfigured - want).abs().max().item() > 1e-2


def test_bf16_autocast_is_as_close_to_fp32_as_trl_padded(tok, tmp_path):
    """TRL's configs train under bf16 autocast by default: there padfree's packed micro-batch must be as close to the
    fp32 values as TRL's padded one (rounding), and the leaking row is not."""
    fp32, _ = _trainers("llama", tok, tmp_path / "fp32")
    padded, ours = _trainers("llama", tok, tmp_path, trl_kw={"bf16": True}, pf_kw={"bf16": True})
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    truth = _loss_and_metrics(fp32, batch)[1]

    def error(trainer) -> float:
        with trainer.accelerator.autocast():  # what training_step runs the loss under
            got = _loss_and_metrics(trainer, batch)[1]
        return max(abs(got[k] - truth[k]) / abs(truth[k]) for k in ("logps/chosen", "logps/rejected"))

    padded_error, our_error = error(padded), error(ours)
    assert 0 < padded_error < 2e-2 and our_error <= 2 * padded_error, (padded_error, our_error)
    layout = Unpadded.from_attention_mask(batch["attention_mask"])
    with torch.no_grad(), ours.accelerator.autocast():
        leak = ours.model(input_ids=layout.pack(batch["input_ids"]), fused_lm_head=True,
                          labels=layout.labels(batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)))
    sums = layout.unpack_shifted(leak.log_probs).sum(1).chunk(2)
    leak_error = max(abs(s.mean().item() - truth[k]) / abs(truth[k])
                     for s, k in zip(sums, ("logps/chosen", "logps/rejected"), strict=True))
    assert leak_error > 5 * max(padded_error, our_error), (leak_error, padded_error, our_error)


def test_enable_gives_the_padfree_dpo_trainer():
    class Mine(trl.DPOTrainer):
        pass

    assert padfree.enable(trl.DPOTrainer) is DPOTrainer and padfree.enable(DPOTrainer) is DPOTrainer
    names = [c.__name__ for c in padfree.enable(Mine).__mro__]
    assert names[:2] == ["PadfreeMine", "DPOMixin"]  # padfree's overrides first, then the user's, then TRL's
    assert names[names.index("Mine"):names.index("Mine") + 2] == ["Mine", "DPOTrainer"]


# --------------------------------------------------------------------------------------------------
# evaluate(), precomputed reference log-probs
# --------------------------------------------------------------------------------------------------


def _eval_metrics(result: dict) -> dict:
    return {k: v for k, v in result.items() if "runtime" not in k and "per_second" not in k and k != "epoch"}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_evaluate_equals_trl_padded(model_type, tok, tmp_path):
    eval_set = _pairs(6, offset=20)
    padded, ours = _trainers(model_type, tok, tmp_path, eval_=eval_set)
    want, got = _eval_metrics(padded.evaluate()), _eval_metrics(ours.evaluate())
    assert set(want) == set(got) and {"eval_loss", "eval_rewards/margins", "eval_logps/chosen"} <= set(want)
    for key in want:
        assert _close(want[key], got[key]), (key, want[key], got[key])


def test_precomputed_reference_log_probs_equal_trl_padded(tok, tmp_path):
    # distinct fingerprints: TRL caches precomputed log-probs by dataset and model, and padfree must compute its own
    train, eval_set = _pairs(6), _pairs(4, offset=20)
    kw = {"precompute_ref_log_probs": True}
    padded, ours = _trainers("qwen3_5_text", tok, tmp_path, train=train, eval_=eval_set, trl_kw=kw,
                             pf_kw={**kw, "seed": 8})
    ours_train = ours.train_dataset
    assert ours_train._fingerprint != padded.train_dataset._fingerprint
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        want = torch.tensor(padded.train_dataset[column])
        got = torch.tensor(ours_train[column])
        assert ((got - want).abs() / want.abs()).max().item() <= RTOL
    want, got = _eval_metrics(padded.evaluate()), _eval_metrics(ours.evaluate())
    for key in want:
        assert _close(want[key], got[key]), (key, want[key], got[key])


# --------------------------------------------------------------------------------------------------
# one optimizer step: gradient accumulation, packing
# --------------------------------------------------------------------------------------------------


def _step(trainer) -> list[torch.Tensor]:
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    return [p.detach() - b for p, b in zip(trainer.model.parameters(), before, strict=True)]


def _same_update(want: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """``|got - want| / |want|`` over all parameters (2-norms). A norm, not a per-entry maximum: an update is a
    difference of fp32 parameters of size ~1, so each entry carries an absolute rounding of ~1e-7 whatever the
    gradient, which is 1e-5 of the largest entry of a small update."""
    scale = torch.sqrt(sum((w.double() ** 2).sum() for w in want)).item()
    assert scale > 0
    diff = sum(((g.double() - w.double()) ** 2).sum() for w, g in zip(want, got, strict=True))
    return torch.sqrt(diff).item() / scale


# the hybrid's fp32 gradients sit ~1.1e-5 (2-norm, relative) from an fp64 per-sequence reference, TRL's padded ones
# as much as padfree's (test_hybrid_gradient_is_as_close_to_the_fp64_reference_as_trl_padded): the two fp32 updates
# can differ by about twice that
STEP_TOL = {"llama": RTOL, "qwen3_5_text": 4e-5}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_one_step_with_gradient_accumulation_equals_trl_padded(model_type, tok, tmp_path):
    kw = {"gradient_accumulation_steps": 2, "max_steps": 1}
    padded, ours = _trainers(model_type, tok, tmp_path, trl_kw=kw, pf_kw=kw)
    assert _same_update(_step(padded), _step(ours)) <= STEP_TOL[model_type]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_on_the_cpu_padfree_scores_the_rows_and_trls_head_gives_the_same_step(model_type, tok, tmp_path, caplog):
    """In a padfree mode on the CPU the packed rows' log-probs come from padfree's per-token head (completion tokens
    only, in chunks; ``padfree_fused_head``), not TRL's; with ``padfree_fused_head=False`` TRL's head scores them.
    One optimizer step equals TRL's padded step either way."""
    kw = {"max_steps": 1}
    padded, ours = _trainers(model_type, tok, tmp_path, trl_kw=kw, pf_kw=kw)
    _, theirs = _trainers(model_type, tok, tmp_path / "trl_head", trl_kw=kw, pf_kw={**kw, "padfree_fused_head": False})
    with caplog.at_level(logging.INFO, logger="padfree"):
        got = _step(ours)
    assert caplog.text.count("answered by padfree's per-token head") == 2  # the policy and the reference model
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="padfree"):
        other = _step(theirs)
    assert "per-token head" not in caplog.text
    want = _step(padded)
    assert _same_update(want, got) <= STEP_TOL[model_type] and _same_update(want, other) <= STEP_TOL[model_type]
    assert _same_update(other, got) <= STEP_TOL[model_type]


def _grads(trainer, batch) -> list[torch.Tensor]:
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    return [p.grad.detach().clone() for p in trainer.model.parameters()]


def test_hybrid_gradient_is_as_close_to_the_fp64_reference_as_trl_padded(tok, tmp_path):
    """The sigmoid-DPO gradient of one micro-batch on qwen3_5_text: TRL's padded fp32 gradient and padfree's packed
    one are each compared with the same loss in fp64, every sequence run alone; padfree's must be as close as TRL's
    (its rounding), and the packed row on an unconfigured model (GatedDeltaNet state crossing sequences) is not."""
    padded, ours = _trainers("qwen3_5_text", tok, tmp_path)
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    want_pad, got = _grads(padded, batch), _grads(ours, batch)
    policy, ref = (m.double() for m in _models("qwen3_5_text", len(tok)))
    real = batch["attention_mask"].sum(1).tolist()

    def logps(model, i):
        ids = batch["input_ids"][i: i + 1, : real[i]]
        scored = batch["completion_mask"][i, 1: real[i]].bool()
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        return logp[scored].sum()

    with torch.no_grad():
        ref_logps = torch.stack([logps(ref, i) for i in range(len(real))])
    ratios = torch.stack([logps(policy, i) for i in range(len(real))]) - ref_logps
    chosen, rejected = ratios.chunk(2)
    (-torch.nn.functional.logsigmoid(ours.beta * (chosen - rejected)).mean()).backward()
    truth = [p.grad for p in policy.parameters()]
    padded_error, our_error = _same_update(truth, want_pad), _same_update(truth, got)
    assert padded_error < 1e-4 and our_error <= 1.5 * padded_error + 1e-6, (padded_error, our_error)
    padfree.unconfigure_packing(ours.model)
    padfree.unconfigure_packing(ours.ref_model)
    assert _same_update(truth, _grads(ours, batch)) > 1e-3


def test_packed_pairs_one_step_equals_trl_padded_step_over_the_same_pairs(tok, tmp_path):
    """Pairs packed across the dataset into micro-batches of varying pair counts: one optimizer step over all of them
    (gradient accumulation = the number of micro-batches) equals TRL's padded step over the same pairs in one
    micro-batch — the step's loss is the mean over its pairs either way."""
    train = _pairs(8)
    probe, _ = pack_pairs(_tokenized(train, tok, tmp_path), capacity=250, max_length=160)
    rows = len(probe)
    assert 2 < rows < 8  # micro-batches of different pair counts
    padded, ours = _trainers("llama", tok, tmp_path, train=train, eval_=_pairs(4, offset=20),
                             trl_kw={"per_device_train_batch_size": 8, "max_steps": 1},
                             pf_kw={"packing": True, "packing_length": 250, "gradient_accumulation_steps": rows,
                                    "max_steps": 1})  # per_device_train_batch_size 2: still one bin a micro-batch
    status = padfree.packing_status(ours)
    assert status.mode == "sample packing" and status.rows == rows
    assert len({len(b) for b in ours.train_dataset["prompt_ids"]}) > 1
    # the eval set is not packed: its pairs run padding-free, batch by batch, as TRL's padded eval batches
    want, got = _eval_metrics(padded.evaluate()), _eval_metrics(ours.evaluate())
    assert set(want) == set(got) and all(_close(want[k], got[k]) for k in want), (want, got)
    assert _same_update(_step(padded), _step(ours)) <= RTOL
    logged = ours.state.log_history[0]  # the telemetry measured the packed rows: no padding, 16 sequences in 5 rows
    assert logged["padfree/real_token_fraction"] == 1.0 and logged["padfree/sequences_per_row"] == 16 / rows
    assert "padfree/real_token_fraction" not in padded.state.log_history[0]


@pytest.mark.parametrize("cut", ["whole_segments", "inside_segments"])
def test_packed_pairs_with_the_gated_delta_net_in_blocks_step_as_trl_padded(cut, tok, tmp_path, monkeypatch):
    """qwen3_5_text, pairs packed across the dataset, every packed row's GatedDeltaNet run in blocks of whole
    segments (:mod:`padfree.model.row_blocks`, its budget made ~24 tokens so that these short rows cut; a real row
    cuts at hundreds): one optimizer step equals TRL's padded step over the same pairs. The leaking control cuts
    the rows every 24 tokens whatever the boundaries: the in-run proof stops the run before its optimizer step,
    naming the GatedDeltaNet, and with the proof off the same comparison sees it."""
    monkeypatch.setattr(row_blocks, "block_tokens", lambda module: 24)
    cuts: list[int] = []
    blocks = cut_inside_segments if cut == "inside_segments" else row_blocks.segment_blocks
    monkeypatch.setattr(row_blocks, "segment_blocks", lambda lay, tokens: cuts.append(tokens) or blocks(lay, tokens))
    train = _pairs(8)
    rows = len(pack_pairs(_tokenized(train, tok, tmp_path), capacity=250, max_length=160)[0])
    pf_kw = {"packing": True, "packing_length": 250, "gradient_accumulation_steps": rows, "max_steps": 1}
    padded, ours = _trainers("qwen3_5_text", tok, tmp_path, train=train,
                             trl_kw={"per_device_train_batch_size": 8, "max_steps": 1},
                             pf_kw=pf_kw)  # one optimizer step over every packed row
    assert padfree.packing_status(ours).rows == rows > 2
    want = _step(padded)
    if cut == "whole_segments":
        update = _same_update(want, _step(ours))
        assert cuts, "the packed rows ran their GatedDeltaNet in blocks"
        assert update <= STEP_TOL["qwen3_5_text"], update
        return
    before = [p.detach().clone() for p in ours.model.parameters()]
    with pytest.raises(PackingDisabledError, match=r"first diverging module: model\.layers\.0\.linear_attn"):
        ours.train()
    assert cuts and all(torch.equal(p, b) for p, b in zip(ours.model.parameters(), before, strict=True))
    _, unchecked = _trainers("qwen3_5_text", tok, tmp_path, train=train, pf_kw={**pf_kw, "padfree_verify": False})
    assert _same_update(want, _step(unchecked)) > 1e-3


def _tokenized(train, tok, tmp_path):
    """The pairs as TRL tokenizes them, to size the packed micro-batches before a trainer is built."""
    policy, ref = _models("llama", len(tok))
    return trl.DPOTrainer(model=policy, ref_model=ref, args=_args(trl.DPOConfig, tmp_path / "probe"),
                          train_dataset=train, processing_class=tok).train_dataset


def test_packing_refuses_batch_coupled_loss_types_and_bad_settings(tok, tmp_path):
    policy, ref = _models("llama", len(tok))
    for loss in (["sft"], ["aot"], ["sigmoid", "aot_unpaired"]):
        with pytest.raises(InvalidArgumentError, match="packing=True with loss_type"):
            DPOTrainer(model=policy, ref_model=ref, args=_args(DPOConfig, tmp_path, packing=True, loss_type=loss),
                       train_dataset=_pairs(4), processing_class=tok)
    with pytest.raises(InvalidArgumentError, match="custom data_collator"):
        DPOTrainer(model=policy, ref_model=ref, args=_args(DPOConfig, tmp_path, padding_free=True),
                   data_collator=lambda x: x, train_dataset=_pairs(4), processing_class=tok)
    with pytest.raises(InvalidArgumentError, match="packing_length"):
        DPOTrainer(model=policy, ref_model=ref, args=_args(DPOConfig, tmp_path, packing=True, packing_length=1),
                   train_dataset=_pairs(4), processing_class=tok)


def test_automatic_mode_and_its_opt_outs(tok, tmp_path, monkeypatch):
    policy, ref = _models("llama", len(tok))
    auto = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=_args(DPOConfig, tmp_path),
                      train_dataset=_pairs(4), processing_class=tok)
    assert padfree.packing_status(auto).mode == "padding-free batching" and auto.args.padding_free is True
    off = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref),
                     args=_args(DPOConfig, tmp_path, padding_free=False), train_dataset=_pairs(4),
                     processing_class=tok)
    assert padfree.packing_status(off).mode == "standard batching"
    monkeypatch.setenv("PADFREE_DISABLE_AUTO_PADDING_FREE", "1")
    env = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=_args(DPOConfig, tmp_path),
                     train_dataset=_pairs(4), processing_class=tok)
    status = padfree.packing_status(env)
    assert status.mode == "standard batching" and "PADFREE_DISABLE_AUTO_PADDING_FREE" in status.reason


# --------------------------------------------------------------------------------------------------
# 2 gloo ranks
# --------------------------------------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, tmp: str, port: int, vocab_dir: str, kw: dict) -> None:
    as_launched_rank(rank, world, port)
    tok = mistral_tokenizer_from(vocab_dir)
    policy, ref = _models("llama", len(tok))
    trainer = DPOTrainer(model=policy, ref_model=ref, args=_args(DPOConfig, Path(tmp) / f"out{rank}", **kw),
                         train_dataset=_pairs(8), processing_class=tok)
    assert trainer.accelerator.num_processes == world
    balance = padfree.packing_status(trainer).balance
    delta = _step(trainer)
    (Path(tmp) / f"rank{rank}.pkl").write_bytes(pickle.dumps(([d.cpu() for d in delta], balance)))


@pytest.mark.parametrize("mode", ["padding_free", "packing"])
def test_two_gloo_ranks_equal_the_padded_step_over_the_same_pairs(mode, tok, tmp_path):
    """2 ranks x 2 micro-batches cover the 8 pairs in one step; TRL's padded step over all 8 in one micro-batch is the
    reference (with packing, each rank's micro-batches hold different numbers of pairs, dealt by the balanced
    sampler)."""
    vocab_dir = tok.name_or_path
    kw = {"padding_free": True, "gradient_accumulation_steps": 2, "max_steps": 1}
    if mode == "packing":
        probe, _ = pack_pairs(_tokenized(_pairs(8), tok, tmp_path), capacity=350, max_length=160)
        assert len(probe) == 4 and len({len(b) for b in probe["prompt_ids"]}) > 1
        kw.update(packing=True, packing_length=350, per_device_train_batch_size=1)
    padded, _ = _trainers("llama", tok, tmp_path, trl_kw={"per_device_train_batch_size": 8, "max_steps": 1})
    want = _step(padded)
    ranks = run_ranks(_ddp_worker, tmp_path, free_port(), vocab_dir, kw, deadline=240)
    for got, balance in ranks:
        assert _same_update(want, got) <= RTOL
        # packed micro-batches are dealt to the ranks by load (tokens and attention cost), not sharded by count
        assert (balance or "").startswith("balanced across 2 ranks") == (mode == "packing"), balance
