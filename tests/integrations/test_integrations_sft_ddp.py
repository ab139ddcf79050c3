"""``padfree.SFTTrainer(packing=True)`` under data parallelism, on 2 real gloo processes.

Each process builds the real ``trl.SFTTrainer`` pipeline (through ``padfree.SFTTrainer``) on GSM8K prompt-completion
records tokenized offline with the Mistral vocabulary: TRL tokenizes and masks the prompts (completion-only loss),
padfree packs the whole dataset into rows of ``max_length`` tokens, the Hugging Face Trainer sets up gloo from the
launcher's variables and wraps the tiny llama in DDP, and padfree's ``get_train_dataloader`` deals the packed rows to
the ranks in balanced steps. One optimizer step (gradient accumulation 2, SGD with lr 1) must move every parameter by
exactly minus the gradient of the unpacked step loss — every sequence of every micro-batch of both ranks run alone
through an unconfigured copy of the model, Σ token losses / targets of the whole step — and a negative control shows
that the data tells that rule from the naive one (each rank's own mean, averaged by DDP).
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
mistral_common = pytest.importorskip("mistral_common")

import padfree  # noqa: E402
from multiproc import StepRecorder, as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree.integrations.sft import SFTConfig, SFTTrainer  # noqa: E402
from padfree.step_loss import count_loss_items, token_losses  # noqa: E402
from realdata import gsm8k_shortest_prompt_completions  # noqa: E402
from zoo import grad_diff, grads_of, mistral_tokenizer, vocab_llama  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

RECORDS = 40
# the 40 shortest GSM8K records of the first 300 are 70-110 Mistral tokens: rows of 256 hold two or three of them
# (rows of 128 would hold one), so every trained micro-batch is a row of several packed sequences
MAX_LENGTH = 256
DEADLINE = 120


def _dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list(gsm8k_shortest_prompt_completions(RECORDS))


def _worker(rank: int, world: int, tmp: str, port: int, tok) -> None:
    """One rank: ``padfree.SFTTrainer(packing=True)``, one optimizer step of 2 accumulated micro-batches."""
    import warnings

    warnings.filterwarnings("ignore")
    as_launched_rank(rank, world, port)

    class Recording(StepRecorder, SFTTrainer):
        """Notes every micro-batch this rank trains and the step counts it normalises by."""

    args = SFTConfig(output_dir=f"{tmp}/out", packing=True, max_length=MAX_LENGTH, per_device_train_batch_size=1,
                     gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=1.0, weight_decay=0.0,
                     max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0, bf16=False,
                     activation_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no",
                     logging_steps=1, disable_tqdm=True, seed=0)
    model = vocab_llama(len(tok))
    trainer = Recording(model=model, args=args, train_dataset=_dataset(), processing_class=tok)
    trainer.seen = []
    status = padfree.packing_status(trainer)
    trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"seen": trainer.seen, "steps": trainer.state.global_step, "mode": status.mode, "balance": status.balance,
           "rows": status.rows, "group": (args.process_index, args.world_size),
           "ddp": type(trainer.model_wrapped).__name__, "logged": trainer.state.log_history[0]["loss"],
           "params": params}
    if rank == 0:  # the trained parameters, as a user would save them
        torch.save(params, f"{tmp}/params.pt")
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft_ddp")
    tok = mistral_tokenizer(tmp_path_factory.mktemp("spm"))
    vocab_llama(len(tok))  # warm-up (transformers' Llama modules) that both forked children inherit
    return tmp, tok, run_ranks(_worker, tmp, free_port(), tok, deadline=DEADLINE)


# --------------------------------------------------------------------------------------------------
# The reference, computed by hand in this process
# --------------------------------------------------------------------------------------------------


def _segments(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The sequences of a packed micro-batch: ``[(input_ids, labels)]`` cut where ``position_ids`` restart."""
    assert batch["input_ids"].shape[0] == 1  # padfree collates every micro-batch into one row
    ids, labels, pos = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    starts = [*torch.nonzero(pos == 0).flatten().tolist(), ids.shape[0]]
    return [(ids[a:b], labels[a:b]) for a, b in itertools.pairwise(starts)]


def _step_loss(model, batches: list[dict]) -> torch.Tensor:
    """Σ token losses / Σ targets over every sequence of ``batches``, each sequence run alone."""
    total, count = 0.0, 0
    for batch in batches:
        for ids, labels in _segments(batch):
            loss, mask = token_losses(model(input_ids=ids[None]).logits, {"labels": labels[None]})
            total, count = total + loss.sum(), count + int(mask.sum())
    return total / count


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_both_ranks_pack_balance_and_step_together(two_ranks):
    _, _, ranks = two_ranks
    assert [r["group"] for r in ranks] == [(0, 2), (1, 2)]  # the Trainer's own gloo process group
    for r in ranks:
        assert r["mode"] == "sample packing"
        assert r["balance"].startswith("balanced across 2 ranks"), r["balance"]
        assert r["ddp"] == "DistributedDataParallel"
        assert r["steps"] == 1 and len(r["seen"]) == 2  # one optimizer step of 2 accumulated micro-batches
    assert ranks[0]["rows"] == ranks[1]["rows"] and ranks[0]["balance"] == ranks[1]["balance"]
    batches = [m["batch"] for r in ranks for m in r["seen"]]
    counts = [count_loss_items(b) for b in batches]
    total_targets, total_sequences = map(sum, zip(*counts, strict=True))
    for r in ranks:
        for m in r["seen"]:
            b = m["batch"]
            assert "attention_mask" not in b and b["input_ids"].shape[1] <= MAX_LENGTH
            # every rank normalises by the whole step: both ranks' targets and sequences together
            assert m["step"] == (total_targets, total_sequences) and m["num_items"] == total_targets
            for ids, labels in _segments(b):
                assert labels[0] == -100 and int((labels == -100).sum()) > 10  # the prompt is masked
                kept = labels != -100
                assert torch.equal(labels[kept], ids[kept])  # the completion is trained as is
    # the ranks trained different rows, each of several packed sequences
    rows = [tuple(b["input_ids"][0].tolist()) for b in batches]
    assert len(set(rows)) == 4
    assert all(len(_segments(b)) >= 2 for b in batches)


@pytest.mark.slow
def test_ddp_sft_step_equals_the_unpacked_step(two_ranks):
    """SGD, lr 1, one step: the update is minus the gradient of Σ token losses / targets of the whole step."""
    tmp, tok, ranks = two_ranks
    model = vocab_llama(len(tok))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = torch.load(tmp / "params.pt")
    assert saved.keys() == before.keys()
    assert grad_diff(saved, ranks[1]["params"]) == 0.0  # DDP kept the replicas identical
    update = {n: before[n] - saved[n] for n in saved}
    assert grad_diff(update, {n: torch.zeros_like(v) for n, v in update.items()}) > 1e-3  # it did train

    batches = [[m["batch"] for m in r["seen"]] for r in ranks]
    loss = _step_loss(model, batches[0] + batches[1])
    true = grads_of(model, loss)
    diff = grad_diff(update, true)
    # the logged loss (each rank's share of the step, summed over the ranks) is the step's loss too
    logged = [r["logged"] for r in ranks]
    # negative control: each rank's own token mean over its micro-batches, averaged by DDP
    naive = grads_of(model, (_step_loss(model, batches[0]) + _step_loss(model, batches[1])) / 2)
    control = grad_diff(naive, true)
    targets = [sum(count_loss_items(b)[0] for b in rank) for rank in batches]
    print(f"\n[sft ddp] targets per rank {targets}; max |update + grad| {diff:.2e}; naive rule off by "
          f"{control:.2e}; trained update vs naive {grad_diff(update, naive):.2e}; loss {float(loss.detach()):.5f}, "
          f"logged {logged}")
    assert diff <= 1e-5, diff
    assert all(x == pytest.approx(float(loss.detach()), rel=1e-5) for x in logged), (float(loss.detach()), logged)
    assert targets[0] != targets[1]
    assert control > 1e-4
    assert grad_diff(update, naive) > 1e-4
    assert grad_diff(update, naive) > 100 * max(diff, 1e-7)
