"""DistributedPackedBatchSampler: two real gloo processes (equal steps, disjoint and complete coverage, reruns
identical, a DDP step on a tiny Llama), coverage over random lengths and world sizes, accelerate's re-sharding,
PackingDataset rows, one clear error per bad argument."""

from __future__ import annotations

import datetime
import logging
import pickle
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import padfree  # noqa: E402
from multiproc import as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree import InvalidArgumentError, InvalidLengthsError, Packer, pack_sequences  # noqa: E402
from padfree.data.batch import packed_collate_fn  # noqa: E402
from padfree.data.datasets import PackingDataset  # noqa: E402
from padfree.integrations.distributed import DistributedPackedBatchSampler  # noqa: E402
from realdata import gsm8k_records  # noqa: E402
from zoo import tiny_model  # noqa: E402

CAPACITY = 2048
SEED = 7


def _gsm8k_lengths() -> np.ndarray:
    """Characters of every GSM8K record (instruction + input + output): 7,473 real, long-tailed lengths."""
    records = gsm8k_records()
    return np.array([len(r["instruction"]) + len(r["input"]) + len(r["output"]) for r in records], np.int64)


def _samplers(lengths, capacity, world, **kwargs):
    return [DistributedPackedBatchSampler(lengths, capacity, num_replicas=world, rank=r, **kwargs)
            for r in range(world)]


def _idle(per_step_rank: np.ndarray) -> float:
    """``Σ_steps max_rank / Σ_steps mean_rank - 1`` over a ``(steps, ranks)`` load matrix."""
    return float(per_step_rank.max(axis=1).sum() / per_step_rank.mean(axis=1).sum() - 1.0)


# --------------------------------------------------------------------------------------------------
# Two real processes on the gloo backend
# --------------------------------------------------------------------------------------------------


def _ddp_samples(n: int = 40) -> list[dict]:
    """Real text as byte-level token ids (the tiny model's vocabulary is 96): GSM8K records cut to <= 120 tokens."""
    records = gsm8k_records(n)
    out = []
    for r in records:
        raw = np.frombuffer((r["instruction"] + "\n" + r["output"]).encode(), np.uint8)
        out.append({"input_ids": torch.from_numpy(3 + raw[: max(8, min(120, raw.size // 4))] % 93).long()})
    return out


def _train(samples: list[dict], sampler: DistributedPackedBatchSampler) -> tuple[list[float], list[int], float]:
    """One epoch of DDP over gloo: ``(losses, real tokens per step on this rank, parameter checksum)``."""


    model = tiny_model("llama", seed=0)
    padfree.configure_packing(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    # micro_batch_size=2: next fit keeps every micro-batch within 2 rows; the ranks' batches differ in shape
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=packed_collate_fn(128, strategy="nf"))
    losses, tokens = [], []
    for batch in loader:
        loss = ddp(**batch.model_inputs()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        tokens.append(batch.num_tokens)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return losses, tokens, checksum


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    try:
        lengths = np.load(f"{tmp}/lengths.npy")
        out: dict = {}
        for remainder, mbs in (("repeat", 1), ("drop", 2)):
            sampler = DistributedPackedBatchSampler(lengths, CAPACITY, micro_batch_size=mbs, remainder=remainder,
                                                    seed=SEED)  # rank and world size from the process group
            out[remainder, "group"] = (sampler.rank, sampler.num_replicas)
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                out[remainder, epoch] = list(sampler)
                out[remainder, epoch, "len"] = len(sampler)
                out[remainder, epoch, "special"] = (sampler.dropped_samples, sampler.repeated_samples)
            again = DistributedPackedBatchSampler(lengths, CAPACITY, micro_batch_size=mbs, remainder=remainder,
                                                  seed=SEED)
            again.set_epoch(1)
            out[remainder, "rerun"] = list(again)
        DistributedPackedBatchSampler(lengths, CAPACITY, seed=SEED).check_ranks()  # the same schedule: passes
        for name, data, seed in (("data", lengths[rank:], SEED), ("seed", lengths, SEED + rank)):
            try:
                DistributedPackedBatchSampler(data, CAPACITY, seed=seed).check_ranks()
                out["mismatch", name] = None
            except padfree.errors.RankMismatchError as exc:
                out["mismatch", name] = str(exc)
        samples = _ddp_samples()
        runs = []
        for _ in range(2):  # the whole epoch twice: a rerun gives the same losses, bit for bit
            sampler = DistributedPackedBatchSampler([len(s["input_ids"]) for s in samples], 128, micro_batch_size=2,
                                                    seed=SEED)
            runs.append(_train(samples, sampler))
        checksums = [None] * world
        dist.all_gather_object(checksums, runs[0][2])
        out["train"] = runs
        out["checksums"] = checksums
        with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()




@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """:func:`_worker` on 2 processes over gloo."""
    tmp = tmp_path_factory.mktemp("gloo")
    np.save(tmp / "lengths.npy", _gsm8k_lengths())
    # warm up here what both children need (transformers' Llama modules, the packing and row kernels): forked
    # children inherit it instead of each paying for it
    tiny_model("llama")
    packed_collate_fn(128, strategy="nf")(_ddp_samples(4))
    return run_ranks(_worker, tmp)


@pytest.mark.slow
@pytest.mark.parametrize("remainder", ["repeat", "drop"])
def test_two_gloo_ranks_cover_the_data_once_in_equal_steps(two_ranks, remainder):
    lengths = _gsm8k_lengths()
    assert [r[remainder, "group"] for r in two_ranks] == [(0, 2), (1, 2)]
    for epoch in (0, 1):
        got = [r[remainder, epoch] for r in two_ranks]
        assert len(got[0]) == len(got[1]) == two_ranks[0][remainder, epoch, "len"] > 400
        dropped, repeated = two_ranks[0][remainder, epoch, "special"]
        seen = Counter(i for rank in got for batch in rank for i in batch)
        if remainder == "drop":
            assert repeated.size == 0 and dropped.size > 0
            assert sorted(seen) == sorted(set(range(lengths.size)) - set(dropped.tolist()))
            assert set(seen.values()) == {1}  # disjoint across ranks and batches
        else:
            assert dropped.size == 0 and repeated.size > 0
            assert sorted(seen) == list(range(lengths.size))
            assert seen == Counter(range(lengths.size)) + Counter(repeated.tolist())  # exactly the listed repeats
        # what each process computed from the process group is what explicit arguments give in this process
        mbs = 1 if remainder == "repeat" else 2
        for rank, sampler in enumerate(_samplers(lengths, CAPACITY, 2, micro_batch_size=mbs, remainder=remainder,
                                                 seed=SEED)):
            sampler.set_epoch(epoch)
            assert list(sampler) == got[rank]
    for r in two_ranks:
        assert r[remainder, "rerun"] == r[remainder, 1]  # a fresh sampler, same seed and epoch: same batches
        assert r[remainder, 0] != r[remainder, 1]  # another epoch, another order
    # token balance of the steps as the processes yielded them: every rank of a step does nearly the same work
    load = np.array([[lengths[b].sum() for b in rank] for rank in (r[remainder, 0] for r in two_ranks)]).T
    assert _idle(load) < 0.01


@pytest.mark.slow
def test_ranks_that_scheduled_different_data_are_refused(two_ranks):
    """check_ranks: one rank missing a sample, or seeded differently, is an error on every rank (not a hang)."""
    n = len(_gsm8k_lengths())
    for rank in (0, 1):
        assert "ranks [1] computed another schedule than rank 0" in two_ranks[rank]["mismatch", "data"]
        assert f"rank 0: {n} samples" in two_ranks[rank]["mismatch", "data"]
        assert f"rank 1: {n - 1} samples" in two_ranks[rank]["mismatch", "data"]
        assert "seed=" in two_ranks[rank]["mismatch", "seed"]


@pytest.mark.slow
def test_ddp_step_on_a_tiny_llama_runs_without_a_hang(two_ranks):
    (losses0, tokens0, _), (losses0b, _, _) = two_ranks[0]["train"]
    (losses1, tokens1, _), _ = two_ranks[1]["train"]
    assert len(losses0) == len(losses1) > 3  # every rank made the same number of optimizer steps
    assert tokens0 != tokens1  # ... on different amounts of data
    assert all(np.isfinite(losses0 + losses1))
    assert losses0 == losses0b  # rerun: identical to the bit
    c0, c1 = two_ranks[0]["checksums"]
    assert c0 == c1  # DDP kept the replicas identical


class _RecordingCollator:
    """``packed_collate_fn`` that first notes which samples (their ``idx``) each batch holds."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.collate = packed_collate_fn(128, strategy="nf", return_dict=True)

    def __call__(self, samples: list[dict]) -> dict:
        self.log.append([s["idx"] for s in samples])
        return self.collate([{"input_ids": s["input_ids"]} for s in samples])


def _trainer_worker(rank: int, world: int, tmp: str, port: int) -> None:
    """The Hugging Face Trainer sets up the process group itself (accelerate, from the launcher's variables)."""
    import warnings

    import transformers

    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")
    as_launched_rank(rank, world, port)
    samples = [dict(s, idx=i) for i, s in enumerate(_ddp_samples())]
    lengths = [len(s["input_ids"]) for s in samples]
    log: list = []

    class PackedTrainer(transformers.Trainer):  # the recipe of the class docstring
        def get_train_dataloader(self):
            sampler = DistributedPackedBatchSampler(lengths, 128, num_replicas=self.accelerator.num_processes,
                                                    all_ranks=True, micro_batch_size=2, seed=SEED)
            loader = DataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=_RecordingCollator(log))
            return self.accelerator.prepare(loader)

    args = transformers.TrainingArguments(output_dir=tmp, num_train_epochs=2, use_cpu=True, report_to=[],
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True)
    model = tiny_model("llama")
    padfree.configure_packing(model)
    trainer = PackedTrainer(model=model, args=args, train_dataset=samples)
    trainer.train()
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump({"batches": log, "steps": trainer.state.global_step, "group": (args.process_index,
                                                                                  args.world_size)}, f)


@pytest.mark.slow
def test_hf_trainer_on_two_ranks_trains_exactly_the_schedule(tmp_path):
    port = free_port()
    tiny_model("llama")  # warm-up inherited by both children
    results = run_ranks(_trainer_worker, tmp_path, port)
    lengths = [len(s["input_ids"]) for s in _ddp_samples()]
    assert [r["group"] for r in results] == [(0, 2), (1, 2)]  # the Trainer's own process group
    for rank, result in enumerate(results):
        expected = []
        for epoch in (0, 1):  # the Trainer called set_epoch: epoch 1 is the sampler's epoch 1
            sampler = DistributedPackedBatchSampler(lengths, 128, num_replicas=2, rank=rank, micro_batch_size=2,
                                                    seed=SEED)
            sampler.set_epoch(epoch)
            expected += list(sampler)
        assert result["batches"] == expected  # accelerate's re-sharding handed each rank exactly its micro-batches
        assert result["steps"] == len(expected)


# --------------------------------------------------------------------------------------------------
# One process, explicit ranks
# --------------------------------------------------------------------------------------------------


@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=150),
    world=st.integers(1, 5),
    mbs=st.integers(1, 3),
    remainder=st.sampled_from(["repeat", "drop"]),
    strategy=st.sampled_from(["obfd", "ffs", "nf"]),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
@settings(max_examples=60, deadline=None)
def test_every_sample_once_per_epoch_on_some_rank(lengths, world, mbs, remainder, strategy, shuffle, epoch):
    capacity = 512
    ranks = _samplers(lengths, capacity, world, micro_batch_size=mbs, remainder=remainder, strategy=strategy,
                      shuffle=shuffle, seed=3)
    for s in ranks:
        s.set_epoch(epoch)
    batches = [list(s) for s in ranks]
    assert len({len(b) for b in batches}) == 1 and len(batches[0]) == len(ranks[0])
    seen = Counter(i for rank in batches for batch in rank for i in batch)
    everything = Counter(range(len(lengths)))
    dropped, repeated = ranks[0].dropped_samples.tolist(), ranks[0].repeated_samples.tolist()
    if remainder == "drop":
        assert repeated == [] and seen == everything - Counter(dropped)
    else:
        assert dropped == [] and seen == everything + Counter(repeated)
    # with all_ranks the stream interleaves the ranks step by step
    merged = DistributedPackedBatchSampler(lengths, capacity, num_replicas=world, all_ranks=True, micro_batch_size=mbs,
                                           remainder=remainder, strategy=strategy, shuffle=shuffle, seed=3)
    merged.set_epoch(epoch)
    assert list(merged) == [b for step in zip(*batches, strict=True) for b in step]
    # every micro-batch fits its rows: next fit over the samples as yielded never needs more than mbs rows
    arr = np.asarray(lengths, np.int64)
    for rank in batches:
        for batch in rank:
            assert Packer(capacity, "nf").pack(arr[batch]).num_bins <= mbs


def test_balance_on_real_lengths_beats_sharding_rows_by_count():
    """Idle time from imbalance on GSM8K (2 ranks, rows of 2048 characters) against DistributedSampler-like
    round-robin dealing of the shuffled rows."""
    lengths = _gsm8k_lengths()
    sampler = DistributedPackedBatchSampler(lengths, CAPACITY, num_replicas=2, rank=0, seed=SEED)
    sched = sampler.schedule
    assert sched.token_imbalance < 0.005 and sched.cost_imbalance < 0.005
    plan = sampler.plan
    cost = np.add.reduceat(plan.placed_lengths ** 2, plan.bin_offsets[:-1])
    naive = np.random.default_rng(0).permutation(plan.num_bins)[: plan.num_bins // 2 * 2].reshape(-1, 2)
    assert _idle(cost[naive]) > 20 * sched.cost_imbalance
    assert "idle from imbalance" in sampler.summary()


def test_shuffle_false_and_epochs():
    lengths = _gsm8k_lengths()[:500]
    fixed = DistributedPackedBatchSampler(lengths, CAPACITY, num_replicas=2, rank=1, shuffle=False)
    first = list(fixed)
    fixed.set_epoch(5)
    assert list(fixed) == first  # no shuffle: the epoch changes nothing
    ffs = DistributedPackedBatchSampler(lengths, CAPACITY, num_replicas=2, rank=1, strategy="ffs", seed=1)
    rows0 = {tuple(sorted(b)) for b in ffs}
    ffs.set_epoch(1)
    assert {tuple(sorted(b)) for b in ffs} != rows0  # a randomized strategy repacks every epoch


def test_packing_dataset_rows():
    records = gsm8k_records(300)
    samples = [list((r["instruction"] + "\n" + r["output"]).encode()) for r in records]
    ds = PackingDataset(samples, max_length=256, overlong="split", seed=4)
    ranks = [DistributedPackedBatchSampler(ds, num_replicas=3, rank=r, remainder="drop", seed=2) for r in range(3)]
    collate = packed_collate_fn(256)
    for epoch in (0, 1):
        for s in ranks:
            s.set_epoch(epoch)
        assert ds.epoch == epoch  # forwarded
        got = [list(s) for s in ranks]
        rows = Counter(i for rank in got for batch in rank for i in batch)
        dropped_rows = ranks[0].schedule.dropped_bins.size
        assert set(rows.values()) == {1} and len(rows) == len(ds) - dropped_rows
        # row index i of the dataset is bin order[i] of the plan: the sampler's bins are the rows it yields
        bins = ranks[0].schedule.steps[:, 0, 0]
        assert [ds.order[b[0]] for b in got[0]] == bins.tolist()
        # a collator keeps the row's sequence boundaries: the row comes back as one packed row
        batch = next(iter(DataLoader(ds, batch_sampler=ranks[1], collate_fn=collate)))
        row = ds[got[1][0][0]]
        assert batch.input_ids.shape[0] == 1
        assert batch.input_ids[0, : row["input_ids"].numel()].tolist() == row["input_ids"].tolist()
        assert batch.seq_lens.tolist() == row["seq_lens"].tolist()
    with pytest.raises(InvalidArgumentError, match="strategy apply only"):
        DistributedPackedBatchSampler(ds, num_replicas=1, strategy="ffs")
    with pytest.raises(InvalidArgumentError, match="capacity=100 differs"):
        DistributedPackedBatchSampler(ds, 100, num_replicas=1)
    ds.load_state_dict(ds.state_dict(2))
    with pytest.raises(InvalidArgumentError, match="resumed with load_state_dict"):
        list(DistributedPackedBatchSampler(ds, num_replicas=1))


def test_accelerate_reshards_batch_samplers():
    """accelerate's prepare wraps any batch sampler in BatchSamplerShard (process p keeps batches p, p + W, ...):
    the all_ranks stream comes out as each rank's own micro-batches; a rank-aware sampler would lose half of them."""
    from accelerate.data_loader import prepare_data_loader

    lengths = _gsm8k_lengths()[:400]
    for even_batches in (True, False):
        for p in (0, 1):
            stream = DistributedPackedBatchSampler(lengths, CAPACITY, num_replicas=2, all_ranks=True, seed=SEED)
            loader = DataLoader(list(range(lengths.size)), batch_sampler=stream, collate_fn=list)
            prepared = prepare_data_loader(loader, num_processes=2, process_index=p, put_on_device=False,
                                           even_batches=even_batches)
            expected = DistributedPackedBatchSampler(lengths, CAPACITY, num_replicas=2, rank=p, seed=SEED)
            assert len(prepared) == len(expected)
            assert list(prepared) == list(expected)
            prepared.set_epoch(3)  # what the Trainer calls: reaches the sampler through BatchSamplerShard
            assert stream.epoch == 3
            expected.set_epoch(3)
            assert list(prepared) == list(expected)
    own = DistributedPackedBatchSampler(lengths, CAPACITY, num_replicas=2, rank=0, seed=SEED)
    loader = DataLoader(list(range(lengths.size)), batch_sampler=own, collate_fn=list)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=0, put_on_device=False)
    assert list(prepared) == list(own)[::2]  # the pitfall all_ranks avoids: re-sharded, half the data lost


def test_remainder_is_logged_never_silent(caplog):
    lengths = [300, 300, 300, 300, 300]  # 5 rows of 512 for 2 ranks
    with caplog.at_level(logging.INFO, logger="padfree"):
        drop = DistributedPackedBatchSampler(lengths, 512, num_replicas=2, rank=0, remainder="drop")
        assert len(drop) == 2 and drop.dropped_samples.size == 1
        repeat = DistributedPackedBatchSampler(lengths, 512, num_replicas=2, rank=0, remainder="repeat")
        assert len(repeat) == 3 and repeat.repeated_samples.size == 1
        DistributedPackedBatchSampler(lengths, 512, num_replicas=2, rank=1, remainder="drop").schedule  # noqa: B018
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.WARNING, "DistributedPackedBatchSampler: remainder='drop' left out 1 of 5 rows (1 samples, 300 "
            "tokens) in epoch 0 so that all 2 ranks get 2 steps of 1 rows") in messages
    assert any(level == logging.INFO and "scheduled a second time" in m for level, m in messages)
    assert len(messages) == 2  # rank 1 computes the same and stays quiet


def test_overlong_samples_are_counted_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="padfree"):
        s = DistributedPackedBatchSampler([10, 900, 20], 512, num_replicas=1, overlong="drop")
    assert s.plan.dropped.tolist() == [1] and sorted(i for b in s for i in b) == [0, 2]
    assert "dropped 1 samples (900 tokens)" in caplog.text


def test_plan_as_data():
    plan = pack_sequences([5, 3, 4, 2, 6], capacity=8)
    s = DistributedPackedBatchSampler(plan, num_replicas=1, shuffle=False)
    assert sorted(map(sorted, s)) == sorted(map(sorted, plan.bins))
    split = pack_sequences([5, 12], capacity=8, overlong="split")
    with pytest.raises(InvalidArgumentError, match="PackingDataset built with overlong='split'"):
        DistributedPackedBatchSampler(split, num_replicas=1)


def test_rank_and_world_size_defaults(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    s = DistributedPackedBatchSampler([5, 6], 8)
    assert (s.num_replicas, s.rank) == (1, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(InvalidArgumentError, match="WORLD_SIZE='4'"):
        DistributedPackedBatchSampler([5, 6], 8)
    with pytest.raises(InvalidArgumentError, match=r"rank is None with num_replicas=4"):
        DistributedPackedBatchSampler([5, 6], 8, num_replicas=4)
    assert DistributedPackedBatchSampler([5, 6], 8, num_replicas=4, all_ranks=True).rank == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(num_replicas=2, rank=2), InvalidArgumentError, r"rank must be an integer in \[0, 2\).*got 2"),
        (dict(num_replicas=0, rank=0), InvalidArgumentError, "num_replicas must be an integer >= 1, got 0"),
        (dict(num_replicas=1, micro_batch_size=0), InvalidArgumentError, "micro_batch_size must be an integer >= 1"),
        (dict(num_replicas=1, remainder="pad"), InvalidArgumentError, "remainder must be one of 'repeat', 'drop'"),
        (dict(num_replicas=1, seed=None), InvalidArgumentError, "seed must be an integer >= 0, got None"),
        (dict(num_replicas=1, shuffle=1), InvalidArgumentError, "shuffle must be True or False"),
        (dict(num_replicas=1, all_ranks="yes"), InvalidArgumentError, "all_ranks must be True or False"),
        (dict(num_replicas=1, overlong="split"), InvalidArgumentError, "overlong='split' cannot be used"),
        (dict(num_replicas=1, strategy="best"), InvalidArgumentError, "strategy must be one of"),
        (dict(capacity=None, num_replicas=1), InvalidArgumentError, "capacity is required"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"capacity": 8, **kwargs}
    with pytest.raises(error, match=match):
        DistributedPackedBatchSampler([5, 6, 7], **kwargs)


def test_bad_data():
    with pytest.raises(InvalidLengthsError, match=r"data\[1\] = 0.*a PackResult or a PackingDataset"):
        DistributedPackedBatchSampler([5, 0], 8, num_replicas=1)
    with pytest.raises(InvalidArgumentError, match="pass its per-sample lengths"):
        DistributedPackedBatchSampler(torch.utils.data.TensorDataset(torch.zeros(3)), 8, num_replicas=1)
    s = DistributedPackedBatchSampler([5], 8, num_replicas=1)
    with pytest.raises(InvalidArgumentError, match="epoch must be an integer >= 0, got -1"):
        s.set_epoch(-1)
    assert list(DistributedPackedBatchSampler([], 8, num_replicas=2, rank=1)) == []
    assert "rank=1" in repr(DistributedPackedBatchSampler([5], 8, num_replicas=2, rank=1))


def test_a_datasets_dataset_is_scheduled_from_its_arrow_lengths():
    datasets = pytest.importorskip("datasets")
    lengths = [5, 3, 8, 2, 7, 1, 4, 6, 6, 2]
    ds = datasets.Dataset.from_dict({"input_ids": [list(range(1, n + 1)) for n in lengths]})
    shuffled = ds.shuffle(seed=3)  # an indices mapping: the sampler must follow the dataset's own order
    order = [len(x) for x in shuffled["input_ids"]]
    for data, expected in ((ds, lengths), (shuffled, order)):
        for rank in (0, 1):
            got = list(DistributedPackedBatchSampler(data, 10, num_replicas=2, rank=rank, seed=1))
            assert got == list(DistributedPackedBatchSampler(expected, 10, num_replicas=2, rank=rank, seed=1))
    with pytest.raises(InvalidArgumentError, match="without an 'input_ids' column"):
        DistributedPackedBatchSampler(datasets.Dataset.from_dict({"text": ["a"]}), 8, num_replicas=1)
    with pytest.raises(InvalidLengthsError, match=r"data\[1\] = 0"):  # a missing list is 0 tokens: refused
        DistributedPackedBatchSampler(datasets.Dataset.from_dict({"input_ids": [[1, 2], None]}), 8, num_replicas=1)


# --------------------------------------------------------------------------------------------------
# Rows that are packed already (from_rows)
# --------------------------------------------------------------------------------------------------


def _packed_rows_lengths(n_rows: int = 41, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 200, int(rng.integers(1, 6))).tolist() for _ in range(n_rows)]


@pytest.mark.parametrize(("world", "mbs", "remainder"),
                         [(2, 1, "repeat"), (3, 2, "repeat"), (2, 3, "drop"), (1, 2, "repeat")])
def test_from_rows_yields_row_indices_balanced_by_row_loads(world, mbs, remainder):
    rows = _packed_rows_lengths()
    tokens = np.array([sum(r) for r in rows])
    cost = np.array([sum(n * n for n in r) for r in rows])
    samplers = [DistributedPackedBatchSampler.from_rows(rows, num_replicas=world, rank=r, micro_batch_size=mbs,
                                                        seed=SEED, remainder=remainder) for r in range(world)]
    s = samplers[0].schedule
    assert samplers[0].capacity == tokens.max() and "rows" in repr(samplers[0])
    np.testing.assert_array_equal(s.tokens, tokens)  # each row is one bin: tokens = sum(seq_lens)
    np.testing.assert_array_equal(s.cost, cost)  # ... and cost = Σ seq_lens²
    batches = [list(x) for x in samplers]
    assert len({len(b) for b in batches}) == 1 and all(len(mb) == mbs for b in batches for mb in b)
    seen = Counter(i for b in batches for mb in b for i in mb)
    expected = Counter(range(len(rows))) + Counter(s.repeated_bins.tolist())
    expected -= Counter(s.dropped_bins.tolist())
    assert seen == expected
    assert (s.repeated_bins.size if remainder == "repeat" else s.dropped_bins.size) < world * mbs
    for step in range(s.num_steps):  # rank r's micro-batch of a step is the schedule's, as row indices
        for r in range(world):
            assert sorted(batches[r][step]) == sorted(s.steps[step, r].tolist())
    # all_ranks: the interleaved stream accelerate re-shards
    stream = list(DistributedPackedBatchSampler.from_rows(rows, num_replicas=world, micro_batch_size=mbs, seed=SEED,
                                                          remainder=remainder, all_ranks=True))
    assert [stream[i::world] for i in range(world)] == batches
    if world > 1:
        assert s.cost_imbalance < 0.5 * _idle(cost[np.arange(s.num_steps * world) % len(rows)].reshape(-1, world))


def test_from_rows_reads_a_datasets_dataset_and_matches_lists():
    datasets = pytest.importorskip("datasets")
    rows = _packed_rows_lengths()
    ds = datasets.Dataset.from_dict({"seq_lens": rows, "row": list(range(len(rows)))})
    shuffled = ds.shuffle(seed=1)  # an indices mapping, like select
    for data in (ds, ds.select([5, 3, 0, 40, 7, 7]), shuffled, shuffled.flatten_indices()):
        lens = [rows[i] for i in data["row"]]
        for epoch in (0, 2):
            a = DistributedPackedBatchSampler.from_rows(data, capacity=1000, num_replicas=2, rank=1, seed=SEED)
            b = DistributedPackedBatchSampler.from_rows(lens, capacity=1000, num_replicas=2, rank=1, seed=SEED)
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            assert list(a) == list(b)
            assert a.capacity == 1000


def test_from_rows_through_accelerate_resharding():
    from accelerate.data_loader import prepare_data_loader

    rows = _packed_rows_lengths()
    for p in (0, 1):
        stream = DistributedPackedBatchSampler.from_rows(rows, num_replicas=2, all_ranks=True, micro_batch_size=2,
                                                         seed=SEED)
        loader = DataLoader(list(range(len(rows))), batch_sampler=stream, collate_fn=list)
        prepared = prepare_data_loader(loader, num_processes=2, process_index=p, put_on_device=False)
        own = DistributedPackedBatchSampler.from_rows(rows, num_replicas=2, rank=p, micro_batch_size=2, seed=SEED)
        assert list(prepared) == list(own)


@pytest.mark.parametrize(("rows", "kwargs", "match"), [
    ([[3], []], {}, r"rows\[1\] holds no sequence"),
    ([[3], [0, 2]], {}, "must be >= 1"),
    ([[30], [5, 5]], {"capacity": 20}, r"rows\[0\] holds 30 tokens, more than capacity=20"),
    ([[3], 4], {}, "got a scalar"),
    ("abc", {}, "per-row lists of sequence lengths"),
    ([[3]], {"strategy": "ffd"}, "do not apply to from_rows"),
])
def test_from_rows_bad_input(rows, kwargs, match):
    with pytest.raises((InvalidArgumentError, InvalidLengthsError), match=match):
        DistributedPackedBatchSampler.from_rows(rows, num_replicas=1, **kwargs)


def test_from_rows_dataset_without_seq_lens():
    datasets = pytest.importorskip("datasets")
    with pytest.raises(InvalidArgumentError, match="without a seq_lens column"):
        DistributedPackedBatchSampler.from_rows(datasets.Dataset.from_dict({"input_ids": [[1, 2]]}), num_replicas=1)


# ---- from_samples: unpacked samples, random steps dealt by load ---------------------------------------------------


def _sample_lengths() -> np.ndarray:
    rng = np.random.default_rng(5)
    return np.clip(np.round(rng.lognormal(np.log(120), 1.0, 1003)), 1, 2048).astype(np.int64)


@pytest.mark.parametrize(("world", "mbs", "remainder"), [(2, 2, "repeat"), (3, 4, "drop"), (4, 8, "repeat")])
def test_from_samples_keeps_the_random_steps_and_deals_them_by_load(world, mbs, remainder):
    lengths = _sample_lengths()
    samplers = [DistributedPackedBatchSampler.from_samples(lengths, micro_batch_size=mbs, num_replicas=world, rank=r,
                                                           seed=SEED, remainder=remainder) for r in range(world)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        batches = [list(s) for s in samplers]
        sched = samplers[0].schedule
        assert len({len(b) for b in batches}) == 1 and all(len(mb) == mbs for b in batches for mb in b)
        seen = Counter(i for b in batches for mb in b for i in mb)
        expected = Counter(range(len(lengths))) + Counter(sched.repeated_bins.tolist())
        assert seen == expected - Counter(sched.dropped_bins.tolist())  # every sample once, plus the counted rest
        # which samples share a step is a random draw, not chosen by length: the mean length of a step varies as
        # a random sample's mean does, far less than across steps of length-sorted samples
        steps = [np.array([i for b in batches for i in b[k]]) for k in range(len(batches[0]))]
        spread = np.std([lengths[s].mean() for s in steps])
        sorted_spread = np.std([c.mean() for c in np.array_split(np.sort(lengths), len(steps))])
        assert spread < 0.6 * sorted_spread
        # ... and dealing each step by load leaves far less token idle than a random cut of the same step
        rng = np.random.default_rng(0)
        tokens = np.array([[lengths[b[k]].sum() for b in batches] for k in range(len(steps))], np.float64)
        naive = np.array([lengths[rng.permutation(s)].reshape(world, mbs).sum(axis=1) for s in steps], np.float64)
        assert _idle(tokens) < (0.7 if mbs == 2 else 0.5) * _idle(naive)  # 2 + 2 samples: little to trade
    stream = list(DistributedPackedBatchSampler.from_samples(lengths, micro_batch_size=mbs, num_replicas=world,
                                                             seed=SEED, remainder=remainder, all_ranks=True))
    stream_ep0 = [stream[i::world] for i in range(world)]
    for s in samplers:
        s.set_epoch(0)
    assert stream_ep0 == [list(s) for s in samplers]


def test_from_samples_reads_a_datasets_dataset():
    datasets = pytest.importorskip("datasets")
    lengths = _sample_lengths()
    ds = datasets.Dataset.from_dict({"input_ids": [[7] * int(n) for n in lengths]}).shuffle(seed=2)
    own = [len(x) for x in ds["input_ids"]]
    a = DistributedPackedBatchSampler.from_samples(ds, micro_batch_size=3, num_replicas=2, rank=0, seed=SEED)
    b = DistributedPackedBatchSampler.from_samples(own, micro_batch_size=3, num_replicas=2, rank=0, seed=SEED)
    assert list(a) == list(b)


@pytest.mark.parametrize(("data", "kwargs", "match"), [
    ([3, 4], {"micro_batch_size": 1}, "micro_batch_size must be >= 2 for from_samples, got 1"),
    ([3, 4], {"micro_batch_size": 2, "capacity": 8}, "capacity do not apply to from_samples"),
    ([3, 0], {"micro_batch_size": 2}, "must be >= 1"),
    ("abc", {"micro_batch_size": 2}, "per-sample lengths or a datasets.Dataset"),
])
def test_from_samples_bad_input(data, kwargs, match):
    with pytest.raises((InvalidArgumentError, InvalidLengthsError), match=match):
        DistributedPackedBatchSampler.from_samples(data, num_replicas=2, rank=0, **kwargs)


def test_check_ranks_without_a_process_group_is_a_no_op_and_fingerprints_differ():
    a = DistributedPackedBatchSampler([5, 6, 7, 8], 16, num_replicas=2, rank=0)
    assert a.check_ranks() is None  # nothing to compare with
    b = DistributedPackedBatchSampler([5, 6, 7, 8], 16, num_replicas=2, rank=1)
    assert a.fingerprint() == b.fingerprint()  # the rank is not part of the schedule
    for other in (DistributedPackedBatchSampler([5, 6, 7, 9], 16, num_replicas=2, rank=0),
                  DistributedPackedBatchSampler([5, 6, 7, 8], 16, num_replicas=2, rank=0, seed=1)):
        assert other.fingerprint() != a.fingerprint()
    b.set_epoch(1)
    assert a.fingerprint() != b.fingerprint()
