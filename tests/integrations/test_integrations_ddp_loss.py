"""The loss rule across data-parallel ranks, on 2 real gloo processes: one optimizer step of ``padfree.Trainer``
(DDP set up by the Hugging Face Trainer itself, gradient accumulation 2, packed rows, SGD with lr 1) moves every
parameter by exactly minus the gradient of the unpacked step loss — every sequence of both ranks' micro-batches run
alone through an unconfigured copy of the model — although the ranks hold different numbers of targets and
sequences. A negative control shows that the data tells the right rule from the naive one (each rank's own mean,
averaged by DDP)."""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("accelerate")


from multiproc import StepRecorder, as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree.integrations.trainer import Trainer  # noqa: E402
from padfree.integrations.trainer_data import PackedRowsCollator  # noqa: E402
from padfree.step_loss import count_loss_items, token_losses  # noqa: E402

datasets.disable_progress_bars()
VOCAB = 96
MODES = ("token", "sequence")

# (length, prompt tokens) of the sequences of every packed row, one row per micro-batch. With a sequential sampler
# and accelerate's sharding of batches (process p takes batches p, p + 2, ...), rank 0 trains rows 0 and 2 and
# rank 1 rows 1 and 3. Targets per micro-batch: 16, 5, 15, 14 (all different); per rank 31 in 3 sequences against
# 19 in 6 — a 1-token sequence has no target and counts for nothing; prompt tokens are masked.
ROWS = [
    [(14, 0), (1, 0), (6, 3)],
    [(4, 0), (3, 0)],
    [(25, 10)],
    [(2, 0), (5, 0), (9, 2), (3, 0)],
]
RANK_OF_ROW = [0, 1, 0, 1]


def _sequences() -> list[list[dict]]:
    """Per row, its sequences as ``{"input_ids", "labels"}`` (HF aligned: the model shifts; prompt labels -100)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for row in ROWS:
        seqs = []
        for n, prompt in row:
            ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            seqs.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
        out.append(seqs)
    return out


def _packed_rows() -> list[dict]:
    """Every row packed by hand: ids and labels concatenated, the first label of every sequence -100, positions
    restarting at every sequence (what :func:`padfree.pack_for_trainer` writes)."""
    rows = []
    for seqs in _sequences():
        ids, labels, pos = [], [], []
        for s in seqs:
            ids += s["input_ids"]
            labels += [-100, *s["labels"][1:]]
            pos += list(range(len(s["input_ids"])))
        rows.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return rows


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _worker(rank: int, world: int, tmp: str, port: int) -> None:
    """One rank: ``padfree.Trainer`` over the 4 packed rows for each loss mode; the Trainer (accelerate) builds the
    gloo process group from the launcher's variables and wraps the model in DDP."""
    import warnings

    warnings.filterwarnings("ignore")
    as_launched_rank(rank, world, port)

    class Recording(StepRecorder, Trainer):
        """Notes every micro-batch this rank trains and the step counts it normalises by."""

    out = {}
    for mode in (*MODES, "fused"):  # "fused": the token rule through padfree_fused_loss (no logits)
        args = transformers.TrainingArguments(
            output_dir=f"{tmp}/{mode}", per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1,
            learning_rate=1.0, lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0, weight_decay=0.0,
            train_sampling_strategy="sequential", report_to="none", use_cpu=True, save_strategy="no",
            logging_steps=1, disable_tqdm=True, seed=0)
        model = _llama()
        trainer = Recording(model=model, args=args, train_dataset=datasets.Dataset.from_list(_packed_rows()),
                            data_collator=PackedRowsCollator(), padfree_loss="token" if mode == "fused" else mode,
                            padfree_fused_loss=mode == "fused")
        trainer.seen = []
        trainer.train()
        out[mode] = {"seen": trainer.seen, "steps": trainer.state.global_step,
                     "logged": trainer.state.log_history[0]["loss"],
                     "group": (args.process_index, args.world_size),
                     "ddp": type(trainer.model_wrapped).__name__,
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        if rank == 0:  # the trained parameters, as a user would save them
            torch.save(out[mode]["params"], f"{tmp}/{mode}.pt")
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)




pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_loss")
    port = free_port()
    _llama()  # warm-up (transformers' Llama modules) that both forked children inherit
    return tmp, run_ranks(_worker, tmp, port, deadline=120)


# --------------------------------------------------------------------------------------------------
# The reference, computed by hand in this process
# --------------------------------------------------------------------------------------------------


def _seq_losses(model, seqs):
    """``[(Σ token losses, targets)]`` of every sequence run alone (no packing, no configure_packing)."""
    out = []
    for s in seqs:
        loss, mask = token_losses(model(input_ids=torch.tensor([s["input_ids"]])).logits,
                                  {"labels": torch.tensor([s["labels"]])})
        out.append((loss.sum(), int(mask.sum())))
    return out


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _step_loss(losses, mode):
    """The loss rule over one group of sequences: Σ losses / Σ targets, or the mean of the per-sequence means
    (sequences without a target do not count)."""
    if mode == "token":
        return sum(x for x, _ in losses) / sum(n for _, n in losses)
    return torch.stack([x / n for x, n in losses if n > 0]).mean()


def reference_grads(model, mode):
    """``(loss, gradients)`` of the true step: the loss rule over every sequence of both ranks' micro-batches."""
    loss = _step_loss(_seq_losses(model, [s for row in _sequences() for s in row]), mode)
    return float(loss.detach()), _grads(model, loss)


def naive_ddp_grads(model, mode):
    """What a rank-local rule gives: each rank's own step mean over its 2 micro-batches, then DDP's average."""
    rows = _sequences()
    per_rank = [_step_loss(_seq_losses(model, [s for r, row in enumerate(rows) if RANK_OF_ROW[r] == rank
                                               for s in row]), mode) for rank in (0, 1)]
    return _grads(model, (per_rank[0] + per_rank[1]) / 2)


def _max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def test_ranks_train_different_amounts_in_one_step(two_ranks):
    _, ranks = two_ranks
    rows = _packed_rows()
    for mode in MODES:
        assert [r[mode]["group"] for r in ranks] == [(0, 2), (1, 2)]  # the Trainer's own process group
        assert all(r[mode]["ddp"] == "DistributedDataParallel" and r[mode]["steps"] == 1 for r in ranks)
        counts = []
        for rank, result in enumerate(ranks):
            seen = result[mode]["seen"]
            assert len(seen) == 2  # gradient accumulation 2
            for micro, row in zip(seen, [r for i, r in enumerate(rows) if RANK_OF_ROW[i] == rank], strict=True):
                b = micro["batch"]
                assert b["input_ids"].tolist() == [row["input_ids"]]  # the rows this rank was meant to get ...
                assert b["labels"].tolist() == [row["labels"]]
                assert b["position_ids"].tolist() == [row["position_ids"]]  # ... with their boundaries
                assert "attention_mask" not in b
                counts.append(count_loss_items(b))
                # every rank normalises by the whole step: 50 targets in 9 sequences, both ranks together
                assert micro["step"] == (50.0, 9.0) and micro["num_items"] == 50.0
        assert counts == [(16, 2), (15, 1), (5, 2), (14, 4)]  # rank 0's micro-batches, then rank 1's
        assert len({t for t, _ in counts}) == 4


@pytest.mark.parametrize("run", [*MODES, "fused"])
def test_ddp_step_equals_the_unpacked_step(two_ranks, run):
    """SGD, lr 1, one step: the update is minus the gradient, which must be the loss rule's over the whole step —
    also with the fused loss, whose head weight gets its gradient outside DDP's forward."""
    tmp, ranks = two_ranks
    mode = "token" if run == "fused" else run
    model = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = torch.load(tmp / f"{run}.pt")
    assert saved.keys() == before.keys()
    assert _max_diff(saved, ranks[1][run]["params"]) == 0.0  # DDP kept the replicas identical
    update = {n: before[n] - saved[n] for n in saved}
    loss, true = reference_grads(copy.deepcopy(model), mode)
    diff = _max_diff(update, true)
    assert diff <= 1e-5, diff
    # the logged loss (each rank's sum over its micro-batches, averaged over the ranks) is the step's loss too
    assert all(r[run]["logged"] == pytest.approx(loss, rel=1e-5) for r in ranks), (loss, ranks[0][run]["logged"])
    # negative control: on this data a rank-local mean averaged by DDP is a measurably different gradient, and
    # the trained update is far from it
    naive = naive_ddp_grads(copy.deepcopy(model), mode)
    assert _max_diff(naive, true) > 1e-4
    assert _max_diff(update, naive) > 1e-4
    assert _max_diff(update, naive) > 100 * max(diff, 1e-7)
