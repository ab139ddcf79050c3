"""Sequence parallelism through the trainers, on real gloo processes: one setting, the single-process update.

``padfree.SFTTrainer`` with ``padfree_sequence_parallel=2`` on 4 processes is 2 data-parallel groups of 2 ranks:
the ranks of a group load the same packed rows of GSM8K prompt-completion records (the real TRL pipeline, the
Mistral vocabulary, completion-only loss) and each trains its slice of them. One optimizer step (gradient
accumulation 2, SGD with lr 1) must move every parameter by exactly minus the gradient of the single-process step —
the same 4 packed rows run whole through a packing-configured copy, Σ token losses / targets of the step — and a
negative control shows that the data tells that rule from each group's own mean averaged by DDP.

``padfree.Trainer`` with the same setting on 2 processes trains a GatedDeltaNet hybrid (qwen3_5_text) and evaluates
it: its update and its ``eval_loss`` equal the single-process ones.
"""

from __future__ import annotations

import itertools
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")
pytest.importorskip("accelerate")
pytest.importorskip("mistral_common")

import padfree  # noqa: E402
from multiproc import as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree.integrations.sft import SFTConfig, SFTTrainer  # noqa: E402
from padfree.step_loss import count_loss_items, token_losses  # noqa: E402
from realdata import gsm8k_records, gsm8k_shortest_prompt_completions  # noqa: E402
from zoo import grad_diff, grads_of, packed_case, tiny_model, vocab_llama  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

RECORDS = 24
MAX_LENGTH = 256  # rows of two or three records of 70-110 tokens
DEADLINE = 240


def _dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list(gsm8k_shortest_prompt_completions(RECORDS))


def _recording(base):
    class Recording(base):
        """Notes every micro-batch this rank loads (before its slice is cut) and the step counts."""

        seen: list

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen.append({"batch": {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)},
                              "num_items": float(num_items_in_batch)})
            return super().training_step(model, inputs, num_items_in_batch)

    return Recording


_SGD = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=1.0,
            weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0, bf16=False,
            use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)


def _sft_worker(rank: int, world: int, tmp: str, port: int, tok, rule: str = "token", config: dict | None = None
                ) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    as_launched_rank(rank, world, port)
    args = SFTConfig(output_dir=f"{tmp}/out", packing=True, max_length=MAX_LENGTH, padfree_sequence_parallel=2,
                     activation_checkpointing=False, padfree_loss=rule, **_SGD, **(config or {}))
    model = vocab_llama(len(tok))
    trainer = _recording(SFTTrainer)(model=model, args=args, train_dataset=_dataset(), processing_class=tok)
    trainer.seen = []
    status = padfree.packing_status(trainer)
    trainer.train()
    out = {"seen": trainer.seen, "steps": trainer.state.global_step, "status": str(status),
           "sp": status.sequence_parallel, "ddp": type(trainer.model_wrapped).__name__,
           "logged": trainer.state.log_history[0]["loss"],
           "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


@pytest.fixture(scope="module")
def sft_ranks(tmp_path_factory, tok):
    tmp = tmp_path_factory.mktemp("sft_sp")
    vocab_llama(len(tok))  # warm-up that the forked children inherit
    return run_ranks(_sft_worker, tmp, free_port(), tok, world=4, deadline=DEADLINE)


def _step_loss(model, batches: list[dict], rule: str = "token", halves: bool = False) -> torch.Tensor:
    """Over ``batches``, each packed row run whole in this process: Σ token losses / Σ targets (``"token"``), or
    the mean over the sequences of their mean token loss (``"sequence"``, written out sequence by sequence; with
    ``halves``, the targets of a sequence's tokens on either side of the row's 2-rank slice edge are two sequences:
    the control)."""
    total, count = 0.0, 0
    for b in batches:
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        loss, mask = token_losses(logits, b)  # (rows, T - 1): the loss of token t's target at t
        if rule == "token":
            total, count = total + loss.sum(), count + int(mask.sum())
            continue
        cut = -(-b["input_ids"].shape[1] // 2) if halves else None
        for row in range(loss.shape[0]):
            starts = [*torch.nonzero(b["position_ids"][row] == 0).flatten().tolist(), loss.shape[1] + 1]
            for lo, hi in itertools.pairwise(starts):  # tokens [lo, hi): targets at [lo, hi - 1)
                edges = [lo, *([cut] if cut is not None and lo < cut < hi - 1 else []), hi - 1]
                for a, z in itertools.pairwise(edges):
                    if mask[row, a:z].any():
                        total, count = total + loss[row, a:z][mask[row, a:z]].mean(), count + 1
    return total / count


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sft_sequence_parallel_2_by_data_parallel_2_equals_the_single_process_step(sft_ranks, tok):
    ranks = sft_ranks
    for r in ranks:
        assert r["steps"] == 1 and len(r["seen"]) == 2 and r["ddp"] == "DistributedDataParallel"
        assert r["sp"].startswith("2 ranks"), r["status"]
        # the packed rows are dealt to the 2 data-parallel groups in balanced steps
        assert "balanced across 2 data-parallel groups" in r["status"], r["status"]
    # the ranks of a group loaded the same rows; the two groups different ones
    for a, b in ((0, 1), (2, 3)):
        assert all(_same(x["batch"], y["batch"]) for x, y in zip(ranks[a]["seen"], ranks[b]["seen"], strict=True))
    groups = [[m["batch"] for m in ranks[g]["seen"]] for g in (0, 2)]
    rows = [tuple(b["input_ids"][0].tolist()) for g in groups for b in g]
    assert len(set(rows)) == 4
    assert all(int((b["position_ids"][0] == 0).sum()) >= 2 for g in groups for b in g)  # several sequences a row
    total = sum(count_loss_items(b)[0] for g in groups for b in g)
    assert all(m["num_items"] == total for r in ranks for m in r["seen"])  # the whole step's targets, once each

    model = vocab_llama(len(tok))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for r in ranks[1:]:
        assert grad_diff(r["params"], ranks[0]["params"]) == 0.0  # DDP kept the replicas identical
    update = {n: before[n] - ranks[0]["params"][n] for n in before}
    padfree.configure_packing(model)
    loss = _step_loss(model, groups[0] + groups[1])
    true = grads_of(model, loss)
    diff = grad_diff(update, true)
    # negative control: each group's own token mean, averaged over the groups
    naive = grads_of(model, (_step_loss(model, groups[0]) + _step_loss(model, groups[1])) / 2)
    print(f"\n[sft sp2 x dp2] max |update + grad| {diff:.2e}; naive rule off by {grad_diff(naive, true):.2e}; "
          f"loss {float(loss.detach()):.5f}, logged {[r['logged'] for r in ranks]}")
    assert grad_diff(update, {n: torch.zeros_like(v) for n, v in update.items()}) > 1e-3  # it did train
    assert diff <= 1e-5, diff
    assert grad_diff(naive, true) > 100 * max(diff, 1e-7)
    assert all(r["logged"] == pytest.approx(float(loss.detach()), rel=1e-5) for r in ranks)


@pytest.mark.slow
def test_sft_sequence_parallel_with_the_per_sequence_rule_equals_the_single_process_step(tmp_path, tok):
    """``padfree_loss="sequence"`` through TRL's fused head on 2 ranks: every sequence's mean over its targets on
    both slices, as one process computes it; the control counts each slice's part of a sequence as one. (Prompts
    are trained too, so that a sequence with targets crosses every slice edge.)"""
    vocab_llama(len(tok))
    ranks = run_ranks(_sft_worker, tmp_path, free_port(), tok, "sequence", {"completion_only_loss": False}, world=2,
                      deadline=DEADLINE)
    batches = [m["batch"] for m in ranks[0]["seen"]]
    assert len(batches) == 2 and all(_same(x["batch"], y["batch"]) for x, y in zip(ranks[0]["seen"],
                                                                                   ranks[1]["seen"], strict=True))
    model = vocab_llama(len(tok))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    update = {n: before[n] - ranks[0]["params"][n] for n in before}
    padfree.configure_packing(model)
    true = grads_of(model, _step_loss(model, batches, "sequence"))
    diff = grad_diff(update, true)
    control = grads_of(model, _step_loss(model, batches, "sequence", halves=True))
    print(f"\n[sft sp2, sequence rule] max |update + grad| {diff:.2e}; control off by {grad_diff(control, true):.2e}")
    assert grad_diff(ranks[1]["params"], ranks[0]["params"]) == 0.0
    assert diff <= 1e-5, diff
    assert grad_diff(control, true) > 100 * max(diff, 1e-7)


# ---- padfree.Trainer: a hybrid, gradient accumulation, evaluation ------------------------------------------------


def _rows(seed: int, n: int) -> datasets.Dataset:
    """``n`` packed rows of 96 tokens: random tokens in sequences of real lengths (GSM8K answers, in characters / 8)."""
    lengths = [max(2, len(r["output"]) // 8) for r in gsm8k_records(60)][seed * 20:seed * 20 + 20]
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 96, (m,), generator=g).tolist() for m in lengths]
    return padfree.pack_for_trainer({"input_ids": seqs}, 96).select(range(n))


def _hybrid_worker(rank: int, world: int, tmp: str, port: int, rule: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    as_launched_rank(rank, world, port)
    model = tiny_model("qwen3_5_text")
    args = transformers.TrainingArguments(output_dir=f"{tmp}/out", per_device_eval_batch_size=1, **_SGD)
    trainer = _recording(padfree.Trainer)(model=model, args=args, train_dataset=_rows(0, 2), eval_dataset=_rows(1, 3),
                                          data_collator=padfree.PackedRowsCollator(), padfree_sequence_parallel=2,
                                          padfree_loss=rule)
    trainer.seen = []
    trainer.train()
    metrics = trainer.evaluate()
    out = {"seen": trainer.seen, "eval_loss": metrics["eval_loss"], "status": str(padfree.packing_status(trainer)),
           "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["token", "sequence"])
def test_trainer_sequence_parallel_trains_and_evaluates_a_hybrid_as_one_process(tmp_path, rule):
    """Both loss rules; under ``"sequence"`` a sequence's mean is over its targets on both ranks (a sequence of
    these rows crosses the slice edge), which the control — each slice's part of a sequence counted as one —
    misses."""
    tiny_model("qwen3_5_text")  # warm-up that the forked children inherit
    ranks = run_ranks(_hybrid_worker, tmp_path, free_port(), rule, world=2, deadline=DEADLINE)
    assert "sequence parallel over 2 ranks" in ranks[0]["status"]
    assert all(_same(x["batch"], y["batch"]) for x, y in zip(ranks[0]["seen"], ranks[1]["seen"], strict=True))
    batches = [m["batch"] for m in ranks[0]["seen"]]
    assert len(batches) == 2
    model = tiny_model("qwen3_5_text")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    padfree.configure_packing(model)
    true = grads_of(model, _step_loss(model, batches, rule))
    update = {n: before[n] - ranks[0]["params"][n] for n in before}
    assert grad_diff(ranks[1]["params"], ranks[0]["params"]) == 0.0
    diff = grad_diff(update, true)
    if rule == "sequence":  # control: each slice's part of a sequence counted as a sequence of its own
        control = grads_of(model, _step_loss(model, batches, rule, halves=True))
        assert grad_diff(control, true) > 100 * max(diff, 1e-7)
    # the eval set's loss rule over its 3 packed rows, run whole in this process with the trained weights
    model.load_state_dict(ranks[0]["params"])
    collate = padfree.PackedRowsCollator()
    with torch.no_grad():
        evals = [collate([row]) for row in _rows(1, 3)]
        eval_loss = float(_step_loss(model, evals, rule))
    print(f"\n[trainer sp2 hybrid, {rule} rule] max |update + grad| {diff:.2e}; eval_loss "
          f"{ranks[0]['eval_loss']:.6f} vs {eval_loss:.6f}")
    assert diff <= 1e-5, diff
    assert grad_diff(update, {n: torch.zeros_like(v) for n, v in update.items()}) > 1e-3
    assert ranks[0]["eval_loss"] == pytest.approx(eval_loss, rel=1e-5)
    assert ranks[1]["eval_loss"] == ranks[0]["eval_loss"]


def test_sequence_parallel_settings_are_checked_before_training():
    with pytest.raises(padfree.InvalidArgumentError, match="padfree_sequence_parallel must be an integer >= 1, got 0"):
        padfree.Trainer(model=vocab_llama(64), args=transformers.TrainingArguments("unused", use_cpu=True,
                                                                            report_to="none"),
                        padfree_sequence_parallel=0)
    with pytest.raises(padfree.InvalidArgumentError, match=r"needs torch\.distributed initialised"):
        padfree.Trainer(model=vocab_llama(64), args=transformers.TrainingArguments("unused", use_cpu=True,
                                                                            report_to="none"),
                        padfree_sequence_parallel=2)



# ---- FSDP2 over every rank, sequence parallel groups of 2 ------------------------------------------------------


def _fsdp_rows(group: int) -> dict[str, torch.Tensor]:
    ids, pos, _ = packed_case(96, [[30, 3, 40], [5, 50, 9]][group:group + 1] * 2, seed=group, filler=1)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}


def _fsdp_worker(rank: int, world: int, tmp: str, port: int) -> None:
    import warnings

    from torch.distributed.fsdp import fully_shard

    from padfree.integrations.loaders import group_of

    warnings.filterwarnings("ignore")
    as_launched_rank(rank, world, port)
    torch.distributed.init_process_group("gloo")
    model = tiny_model("qwen3_5_text")
    padfree.configure_packing(model, sequence_parallel=2)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # over all 4 ranks: FSDP2 shards the parameters and averages the gradients of every rank
    sp = group_of(model)
    part = padfree.split_for_sequence_parallel(_fsdp_rows(sp.dp_rank), sp)  # group g trains batch g
    loss, mask = token_losses(model(input_ids=part["input_ids"], position_ids=part["position_ids"],
                                    use_cache=False).logits, part)
    count = mask.sum().to(torch.float32)
    torch.distributed.all_reduce(count)  # the step's targets, both groups
    (loss.sum() / count * world).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    params = {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for n, v in model.state_dict().items()}
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump({"params": params, "group": (sp.rank, sp.dp_rank)}, f)


@pytest.mark.slow
def test_fsdp2_over_every_rank_with_sequence_parallel_groups_equals_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    tiny_model("qwen3_5_text")
    ranks = run_ranks(_fsdp_worker, tmp_path, free_port(), world=4, deadline=DEADLINE)
    assert [r["group"] for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    model = tiny_model("qwen3_5_text")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    padfree.configure_packing(model)
    true = grads_of(model, _step_loss(model, [_fsdp_rows(0), _fsdp_rows(1)]))
    update = {n: before[n] - ranks[0]["params"][n] for n in before}
    diff = grad_diff(update, true)
    print(f"\n[fsdp2 x sp2] max |update + grad| {diff:.2e}")
    assert all(grad_diff(r["params"], ranks[0]["params"]) == 0.0 for r in ranks[1:])
    assert diff <= 1e-5, diff
