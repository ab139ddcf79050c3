"""padfree's trainers under data parallelism: packed rows are dealt to the ranks in balanced steps.

A real 2-process gloo run of ``padfree.Trainer`` on rows from ``pack_for_trainer`` (lengths from 2 to 60 tokens, so
some rows hold one long sequence and others many short ones): every rank runs the same number of steps and trains
exactly the rows of the balanced schedule, every row once per epoch (plus the documented repeats), and the measured
per-step Σ len² imbalance is below that of the Trainer's default sampler on the same rows (``padfree_balance=False``,
run in the same processes). One process: the Trainer's own loader, batch for batch.
"""

from __future__ import annotations

import itertools
import pickle
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


import padfree  # noqa: E402
from multiproc import as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree.integrations.distributed import DistributedPackedBatchSampler  # noqa: E402
from padfree.integrations.trainer_data import PackedRowsCollator, pack_for_trainer  # noqa: E402
from zoo import mistral_tokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 3
MAX_LENGTH = 64
SAMPLES_MBS = 4
RUNS = (("balanced", 1, True), ("balanced", 2, True), ("default", 1, False), ("default", 2, False))


def _samples() -> datasets.Dataset:
    """Unpacked samples of very uneven lengths (2 to 63 tokens)."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(40, 64, 20), rng.integers(2, 7, 200)])
    rng.shuffle(lengths)
    return datasets.Dataset.from_dict({"input_ids": [rng.integers(3, 90, int(n)).tolist() for n in lengths]})


def _rows() -> datasets.Dataset:
    """Packed rows of those samples, with a ``row`` column naming each row."""
    rows = pack_for_trainer(_samples(), MAX_LENGTH)
    return rows.add_column("row", list(range(len(rows))))


class _RecordingCollator(PackedRowsCollator):
    """padfree's collator (so the trainer is in sample-packing mode) that notes the rows of every batch."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __call__(self, samples):
        self.log.append([int(s["row"]) for s in samples])
        return super().__call__([{k: v for k, v in s.items() if k != "row"} for s in samples])


def _args(tmp: str, mbs: int, epochs: int = 2, **overrides) -> transformers.TrainingArguments:
    kwargs = dict(output_dir=tmp, num_train_epochs=epochs, per_device_train_batch_size=mbs, use_cpu=True,
                  report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                  remove_unused_columns=False, seed=SEED)
    return transformers.TrainingArguments(**{**kwargs, **overrides})


def _worker(rank: int, world: int, tmp: str, port: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")
    as_launched_rank(rank, world, port)
    rows = _rows()
    out = {}
    for kind, mbs, balance in RUNS:
        log: list = []
        trainer = padfree.Trainer(model=tiny_model("llama"), args=_args(tmp, mbs), train_dataset=rows,
                                  data_collator=_RecordingCollator(log), padfree_balance=balance)
        trainer.train()
        out[kind, mbs] = {"batches": log, "steps": trainer.state.global_step,
                          "status": str(padfree.packing_status(trainer)),
                          "group": (trainer.args.process_index, trainer.args.world_size)}
    out["resume"] = _stop_and_resume(rank, world, tmp, rows)
    other = rows if rank == 0 else rows.select(range(1, len(rows)))  # rank 1 lost a row: refused, not trained
    trainer = padfree.Trainer(model=tiny_model("llama"), args=_args(tmp, 1), train_dataset=other,
                              data_collator=_RecordingCollator([]))
    try:
        trainer.train()
        out["mismatch"] = None
    except padfree.errors.RankMismatchError as exc:
        out["mismatch"] = (str(exc), trainer.state.global_step)
    samples = _samples().add_column("row", list(range(len(_samples()))))
    for balance in (True, False):  # padding-free batches: unpacked samples, one flattened row per micro-batch
        log = []
        trainer = padfree.Trainer(model=tiny_model("llama"), args=_args(tmp, SAMPLES_MBS), train_dataset=samples,
                                  data_collator=_RecordingCollator(log), padfree_balance=balance)
        trainer.train()
        out["samples", balance] = {"batches": log, "status": str(padfree.packing_status(trainer))}
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


def _stop_and_resume(rank: int, world: int, tmp: str, rows: datasets.Dataset) -> dict:
    """Train 2 epochs saving a checkpoint in the middle of epoch 1; resume from it in fresh trainers."""
    per_epoch = len(DistributedPackedBatchSampler.from_rows(rows["seq_lens"], num_replicas=world, rank=rank,
                                                            micro_batch_size=1, seed=SEED))
    stop = per_epoch + per_epoch // 2  # epoch 1 (not 0): the resumed loader must be told its epoch
    out_dir = f"{tmp}/resume"
    full: list = []
    args = _args(out_dir, 1, save_strategy="steps", save_steps=stop)
    padfree.Trainer(model=tiny_model("llama"), args=args, train_dataset=rows,
                    data_collator=_RecordingCollator(full)).train()
    resumed: list = []
    trainer = padfree.Trainer(model=tiny_model("llama"), args=args, train_dataset=rows,
                              data_collator=_RecordingCollator(resumed))
    trainer.train(resume_from_checkpoint=f"{out_dir}/checkpoint-{stop}")
    return {"full": full, "resumed": resumed, "stop": stop, "per_epoch": per_epoch}




@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("balanced")
    port = free_port()
    tiny_model("llama")  # warm-up inherited by both children
    _RecordingCollator([])([dict(r) for r in _rows().select([0, 1])])
    return run_ranks(_worker, tmp, port)


def _cost_idle(per_rank_batches: list[list[list[int]]], cost: np.ndarray) -> float:
    """``Σ_steps max_rank / Σ_steps mean_rank - 1`` of Σ len², measured on the batches each rank trained."""
    steps = min(len(b) for b in per_rank_batches)
    load = np.array([[cost[b[s]].sum() for b in per_rank_batches] for s in range(steps)], np.float64)
    return float(load.max(axis=1).sum() / load.mean(axis=1).sum() - 1.0)


@pytest.mark.parametrize("mbs", [1, 2])
def test_two_ranks_train_exactly_the_balanced_schedule(two_ranks, mbs):
    rows = _rows()
    seq_lens = rows["seq_lens"]
    runs = [two_ranks[r]["balanced", mbs] for r in (0, 1)]
    assert [r["group"] for r in runs] == [(0, 2), (1, 2)]
    assert runs[0]["steps"] == runs[1]["steps"] > 0
    assert len(runs[0]["batches"]) == len(runs[1]["batches"])
    assert "balanced across 2 ranks" in runs[0]["status"] and "attention-cost idle" in runs[0]["status"]
    for epoch in (0, 1):  # the Trainer calls set_epoch: epoch 1 is the schedule's epoch 1
        per_rank = []
        for rank in (0, 1):
            sampler = DistributedPackedBatchSampler.from_rows(seq_lens, num_replicas=2, rank=rank,
                                                              micro_batch_size=mbs, seed=SEED)
            sampler.set_epoch(epoch)
            expected = list(sampler)
            got = runs[rank]["batches"][epoch * len(expected):(epoch + 1) * len(expected)]
            assert got == expected  # exactly this rank's rows of the balanced schedule
            per_rank.append(got)
        seen = Counter(i for batches in per_rank for b in batches for i in b)
        repeated = Counter(sampler.schedule.repeated_bins.tolist())
        assert seen == Counter(range(len(rows))) + repeated  # every row once, plus the documented repeats
        assert sum(repeated.values()) < 2 * mbs
    assert runs[0]["steps"] == len(runs[0]["batches"])  # one micro-batch per optimizer step


@pytest.mark.parametrize("mbs", [1, 2])
def test_balanced_steps_idle_less_than_the_default_sampler(two_ranks, mbs, capsys):
    rows = _rows()
    cost = np.array([sum(n * n for n in r) for r in rows["seq_lens"]], np.float64)
    balanced = _cost_idle([two_ranks[r]["balanced", mbs]["batches"] for r in (0, 1)], cost)
    default_runs = [two_ranks[r]["default", mbs] for r in (0, 1)]
    default = _cost_idle([r["batches"] for r in default_runs], cost)
    assert "padfree_balance=False" in default_runs[0]["status"]
    # the default sampler shards rows by count: every row, in some order
    for epoch_rows in (0, 1):
        n = len(default_runs[0]["batches"]) // 2
        seen = {i for r in default_runs for b in r["batches"][epoch_rows * n:(epoch_rows + 1) * n] for i in b}
        assert seen == set(range(len(rows)))
    with capsys.disabled():
        print(f"\n[mbs={mbs}] Σ len² idle on the trained batches: balanced {100 * balanced:.2f}%, "
              f"default sampler {100 * default:.2f}%")
    assert balanced < default
    assert balanced < 0.5 * default


def test_resume_mid_epoch_replays_the_remaining_balanced_batches(two_ranks):
    """A run stopped in the middle of epoch 1 and resumed from its checkpoint trains exactly the batches the
    uninterrupted run trained after that point, on every rank (accelerate's skipping loader must still see the
    epoch: epoch 1's balanced schedule differs from epoch 0's)."""
    for rank in (0, 1):
        run = two_ranks[rank]["resume"]
        stop, per_epoch = run["stop"], run["per_epoch"]
        assert len(run["full"]) == 2 * per_epoch and per_epoch < stop < 2 * per_epoch
        assert run["full"][per_epoch:] != run["full"][:per_epoch]  # the epochs differ: the test can tell them apart
        assert run["resumed"] == run["full"][stop:]


def test_ranks_with_different_rows_are_refused_before_the_first_step(two_ranks):
    for rank in (0, 1):
        message, steps = two_ranks[rank]["mismatch"]
        assert steps == 0
        assert "ranks [1] computed another schedule than rank 0" in message


def test_padding_free_steps_are_random_draws_dealt_by_load(two_ranks, capsys):
    """Unpacked samples, padding-free rows: every step trains the samples of the seeded permutation's next
    ``2 x 4`` draws (the semantics of a random sampler), each sample once per epoch, and the ranks' tokens of a
    step are far closer than with the Trainer's sampler on the same samples."""
    lengths = np.array([len(x) for x in _samples()["input_ids"]])
    runs = [two_ranks[r]["samples", True] for r in (0, 1)]
    default = [two_ranks[r]["samples", False] for r in (0, 1)]
    assert "balanced across 2 ranks" in runs[0]["status"] and "samples (random steps" in runs[0]["status"]
    assert "padfree_balance=False" in default[0]["status"] and "shards samples by count" in default[0]["status"]
    for epoch in (0, 1):
        expected = []
        for rank in (0, 1):
            sampler = DistributedPackedBatchSampler.from_samples(lengths, micro_batch_size=SAMPLES_MBS,
                                                                 num_replicas=2, rank=rank, seed=SEED)
            sampler.set_epoch(epoch)
            expected.append(list(sampler))
        n = len(expected[0])
        got = [r["batches"][epoch * n:(epoch + 1) * n] for r in runs]
        assert got == expected
        seen = Counter(i for batches in got for b in batches for i in b)
        assert seen == Counter(range(len(lengths))) + Counter(sampler.schedule.repeated_bins.tolist())
    tokens = [np.array([[lengths[b].sum() for b in pair] for pair in zip(*(r["batches"] for r in rs), strict=True)],
                       np.float64) for rs in (runs, default)]
    idle = [float(t.max(axis=1).sum() / t.mean(axis=1).sum() - 1) for t in tokens]
    # a step holding long samples waits for them whatever the dealing: compare with the best split of each step
    # (4 + 4 of its 8 samples, by brute force)
    unions = [lengths[r0 + r1] for r0, r1 in zip(*(r["batches"] for r in runs), strict=True)]
    best = sum(min(max(u[list(c)].sum(), u.sum() - u[list(c)].sum())
                   for c in itertools.combinations(range(len(u)), SAMPLES_MBS)) for u in unions)
    optimum = best / sum(u.sum() / 2 for u in unions) - 1
    with capsys.disabled():
        print(f"\n[padding-free, mbs={SAMPLES_MBS}] token idle on the trained batches: balanced {100 * idle[0]:.2f}%, "
              f"default sampler {100 * idle[1]:.2f}%, best split of the same steps {100 * optimum:.2f}%")
    assert idle[0] < min(0.75 * idle[1], optimum + 0.05)


def test_one_process_is_unchanged(tmp_path):
    """One process: padfree.Trainer's loader is the Trainer's own, batch for batch."""
    rows = _rows()
    logs = {}
    for name, cls in (("padfree", padfree.Trainer), ("transformers", transformers.Trainer)):
        log: list = []
        trainer = cls(model=tiny_model("llama"), args=_args(str(tmp_path), 2, epochs=1), train_dataset=rows,
                      data_collator=_RecordingCollator(log))
        if name == "padfree":
            assert trainer.args.world_size == 1
            assert padfree.packing_status(trainer).balance is None
            assert "balanced" not in str(padfree.packing_status(trainer))
        # the batches the loader yields (not training: the sampler's draw is what must not change)
        logs[name] = [b["input_ids"].tolist() for b in trainer.get_train_dataloader()]
        logs[name + "_rows"] = list(log)
    assert logs["padfree"] == logs["transformers"]
    assert logs["padfree_rows"] == logs["transformers_rows"]
    assert sorted(i for b in logs["padfree_rows"] for i in b) == list(range(len(rows)))


def test_opt_out_and_skip_reasons_are_reported(tmp_path, monkeypatch):
    """world_size > 1 as the arguments say it: the status tells whether the rows are balanced, and why not."""
    rows = _rows()
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    trainer = padfree.Trainer(model=tiny_model("llama"), args=_args(str(tmp_path), 1), train_dataset=rows,
                              data_collator=PackedRowsCollator(), padfree_balance=False)
    assert "padfree_balance=False" in padfree.packing_status(trainer).balance
    # the Trainer's own sampler: no balanced schedule behind the train loader
    assert not isinstance(trainer.get_train_dataloader().batch_sampler, DistributedPackedBatchSampler)
    # accelerate runs one process here: never a schedule for 2 ranks that only one process would follow
    trainer = padfree.Trainer(model=tiny_model("llama"), args=_args(str(tmp_path), 1), train_dataset=rows,
                              data_collator=PackedRowsCollator())
    assert "accelerate runs 1 processes" in padfree.packing_status(trainer).balance
    with pytest.raises(padfree.InvalidArgumentError, match="padfree_balance must be True or False"):
        padfree.Trainer(model=tiny_model("llama"), args=_args(str(tmp_path), 1), train_dataset=rows,
                        padfree_balance="no")


def test_sft_config_opt_out(tmp_path, monkeypatch):
    """padfree.SFTTrainer(packing=True) takes the option from its SFTConfig and reports the choice."""

    pytest.importorskip("mistral_common")
    pytest.importorskip("trl")
    from padfree.integrations.sft import SFTConfig, SFTTrainer

    tok = mistral_tokenizer(tmp_path)
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    rng = np.random.default_rng(1)
    data = datasets.Dataset.from_dict({"input_ids": [rng.integers(3, 90, int(n)).tolist()
                                                     for n in rng.integers(2, 40, 12)]})
    for balance, expected in ((False, "padfree_balance=False"), (True, "accelerate runs 1 processes")):
        cfg = SFTConfig(str(tmp_path / "out"), packing=True, max_length=MAX_LENGTH, use_cpu=True, report_to=[],
                        padfree_balance=balance)
        trainer = SFTTrainer(model=tiny_model("llama"), args=cfg, train_dataset=data, processing_class=tok)
        status = padfree.packing_status(trainer)
        assert status.mode == "sample packing" and expected in status.balance
