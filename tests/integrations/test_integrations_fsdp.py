"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on two real gloo CPU processes, fed by
:class:`~padfree.integrations.distributed.DistributedPackedBatchSampler` and :func:`padfree.packed_collate_fn`.

What is proved, on a tiny Llama configured for packing and sharded layer by layer then as a whole:

- both ranks run the same number of steps over an epoch (``remainder="repeat"``: one sample scheduled twice) and
  the run ends, never hangs (a deadline turns a hang into a failure);
- after one SGD step (lr 1, no momentum) the full, unsharded parameters equal a single-process reference to fp32
  round-off: the same initial model, *not* configured for packing, every sequence of both ranks' micro-batches run
  alone, loss = Σ token losses / the step's targets on all ranks. Each rank passes the global target count (an
  all-reduce) as ``num_items_in_batch`` and multiplies its loss by the world size, because FSDP averages gradients
  over the ranks like DDP. The same holds after the whole epoch;
- the check discriminates: normalising each rank by its own targets (the naive per-rank mean, which FSDP then
  averages) gives other parameters — the FSDP run of it matches the naive reference and not the true one.

accelerate: 1.15.0 does not refuse FSDP on the CPU; it silently ignores the plugin. With
``Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` on 2 gloo processes,
``AcceleratorState`` sets ``distributed_type = DistributedType.FSDP`` only inside its branch for
``MULTI_GPU/MLU/SDAA/MUSA/NPU/XPU/HPU/NEURON``, so on the CPU it stays ``DistributedType.MULTI_CPU``,
``accelerator.is_fsdp2`` is False, and ``accelerator.prepare(model, optimizer)`` returns a
``DistributedDataParallel`` model with plain (unsharded) ``Parameter``s. The accelerate test below observes this in
the workers and skips with that reason; if a later accelerate shards on the CPU, it runs the same exactness check
through ``accelerator.prepare`` / ``accelerator.backward`` instead.
"""

from __future__ import annotations

import datetime
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - torch < 2.6
    pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not available", allow_module_level=True)

import padfree  # noqa: E402
from multiproc import as_launched_rank, free_port, run_ranks  # noqa: E402
from padfree.data.batch import packed_collate_fn  # noqa: E402
from padfree.integrations.distributed import DistributedPackedBatchSampler  # noqa: E402
from padfree.model.loss import causal_lm_loss  # noqa: E402
from zoo import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

from realdata import gsm8k_records  # noqa: E402

CAPACITY = 64
MICRO_BATCH = 2
SEED = 7
WORLD = 2
TOL = 1e-5


def _samples(n: int = 10) -> list[dict]:
    """Real text as byte-level token ids (the tiny model's vocabulary is 96): the first GSM8K records, one token per
    12 characters, 5..60 tokens. With capacity 64 and 2 rows per micro-batch they make 2 steps of 2 ranks; step 0
    has rows holding two sequences, and the ranks carry different target counts (121 and 109)."""
    records = gsm8k_records(n)
    out = []
    for r in records:
        raw = np.frombuffer((r["instruction"] + "\n" + r["output"]).encode(), np.uint8)
        out.append({"input_ids": torch.from_numpy(3 + raw[: int(np.clip(raw.size // 12, 5, 60))] % 93).long()})
    return out


def _sampler() -> DistributedPackedBatchSampler:
    lengths = [len(s["input_ids"]) for s in _samples()]
    return DistributedPackedBatchSampler(lengths, CAPACITY, micro_batch_size=MICRO_BATCH, remainder="repeat",
                                         seed=SEED)  # rank and world size from the process group


def _sharded_model() -> torch.nn.Module:
    model = tiny_model("llama", seed=0)
    padfree.configure_packing(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters (``full_tensor`` is a collective: every rank calls it)."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def _global_targets(batch) -> tuple[int, int]:
    """``(targets on this rank, targets of the step on all ranks)``; HF-aligned labels: the model shifts."""
    local = int((batch.labels[:, 1:] != -100).sum())
    total = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(total)
    return local, int(total)


def _step(model, opt, batch, world: int, naive: bool = False) -> float:
    _, total = _global_targets(batch)
    # true: Σ token losses / the step's targets on all ranks, times world (FSDP averages the ranks' gradients);
    # naive: this rank's own token mean (what model(**inputs).loss gives), averaged by FSDP
    inputs = batch.model_inputs()
    loss = model(**inputs).loss if naive else model(**inputs, num_items_in_batch=total).loss * world
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _fsdp_worker(rank: int, world: int, tmp: str, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        out: dict = {}
        samples = _samples()
        sampler = _sampler()
        out["group"] = (sampler.rank, sampler.num_replicas)
        out["batches"] = list(sampler)
        out["len"] = len(sampler)
        out["repeated"] = sampler.repeated_samples.tolist()
        loader = DataLoader(samples, batch_sampler=sampler, collate_fn=packed_collate_fn(CAPACITY, strategy="nf"))

        model = _sharded_model()
        out["sharded"] = type(next(model.parameters())).__name__  # DTensor: really sharded
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        out["losses"], out["targets"], out["rows"] = [], [], []
        for step, batch in enumerate(loader):
            out["targets"].append(_global_targets(batch)[0])
            out["rows"].append(batch.seqs_per_row.tolist())
            out["losses"].append(_step(model, opt, batch, world))
            if step == 0:
                out["step1"] = _full_params(model)
        out["epoch"] = _full_params(model)

        fused = _sharded_model()  # the same first step with padfree's fused loss (no logits)
        opt = torch.optim.SGD(fused.parameters(), lr=1.0)
        batch = next(iter(loader))
        try:
            loss = causal_lm_loss(fused, batch.model_inputs(), num_items_in_batch=_global_targets(batch)[1]) * world
            loss.backward()
            opt.step()
            out["fused_step1"] = _full_params(fused)
        except Exception as exc:  # carried back to the test, which shows it
            out["fused_step1"] = f"{type(exc).__name__}: {exc}"

        naive = _sharded_model()  # the negative control: one step normalised per rank
        opt = torch.optim.SGD(naive.parameters(), lr=1.0)
        _step(naive, opt, next(iter(loader)), world, naive=True)
        out["naive"] = _full_params(naive)

        out["accelerate"] = _accelerate_part(rank, world, port, loader)
        if rank != 0:  # rank 0 carries the parameters back
            for key in ("step1", "epoch", "naive", "fused_step1"):
                out.pop(key)
        with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def _accelerate_part(rank: int, world: int, port: int, loader: DataLoader) -> dict:
    """What accelerate makes of its FSDP2 plugin here; where it really shards, one step through it."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")
    as_launched_rank(rank, world, port, OMP_NUM_THREADS="1")
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = tiny_model("llama", seed=0)
    padfree.configure_packing(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = accelerator.prepare(model, opt)
    out = {"type": str(accelerator.distributed_type), "is_fsdp2": accelerator.is_fsdp2,
           "model": type(model).__name__, "param": type(next(model.parameters())).__name__}
    if accelerator.is_fsdp2:  # pragma: no cover - accelerate 1.15 does not shard on the CPU (module docstring)
        batch = next(iter(loader))
        _, total = _global_targets(batch)
        loss = model(**batch.model_inputs(), num_items_in_batch=total).loss * world
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        full = _full_params(model)
        if rank == 0:
            out["step1"] = full
    return out




@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    port = free_port()
    # warm up what both children need (transformers' Llama modules, accelerate, the packing and row kernels)
    import accelerate  # noqa: F401

    tiny_model("llama")
    packed_collate_fn(CAPACITY, strategy="nf")(_samples(4))
    return run_ranks(_fsdp_worker, tmp, port, deadline=90)


# --------------------------------------------------------------------------------------------------
# The single-process reference: the unconfigured model, every sequence alone
# --------------------------------------------------------------------------------------------------


def _reference(steps: list[list[list[int]]], naive: bool = False) -> dict[str, torch.Tensor]:
    """Parameters after SGD (lr 1) over ``steps`` (per step, per rank: sample indices), each sequence run alone
    through the model as built (no packing configured). True: Σ token losses / the step's targets; naive: the mean
    over ranks of each rank's own token mean."""
    samples = _samples()
    model = tiny_model("llama", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for ranks in steps:
        sums, counts = [], []
        for indices in ranks:
            total = 0.0
            for i in indices:
                ids = samples[i]["input_ids"]
                logits = model(input_ids=ids[None], use_cache=False).logits[0]
                total = total + torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")
            sums.append(total)
            counts.append(sum(len(samples[i]["input_ids"]) - 1 for i in indices))
        means = [s / c for s, c in zip(sums, counts, strict=True)]
        loss = sum(means) / len(ranks) if naive else sum(sums) / sum(counts)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {name: value.detach() for name, value in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp2_ranks_run_the_same_steps_without_a_hang(two_ranks):
    r0, r1 = two_ranks
    assert [r["group"] for r in two_ranks] == [(0, 2), (1, 2)]
    assert r0["sharded"] == r1["sharded"] == "DTensor"  # fully_shard really sharded the parameters
    assert len(r0["losses"]) == len(r1["losses"]) == r0["len"] == len(r0["batches"]) >= 2
    assert all(np.isfinite(r0["losses"] + r1["losses"]))
    assert r0["repeated"] == r1["repeated"] != []  # remainder="repeat" scheduled a sample a second time
    # every sample once, plus the repeats, on some rank
    seen = sorted(i for r in two_ranks for b in r["batches"] for i in b)
    assert seen == sorted(list(range(len(_samples()))) + r0["repeated"])
    # what the loader handed each rank is what an explicit-rank sampler yields in this process
    lengths = [len(s["input_ids"]) for s in _samples()]
    for rank, r in enumerate(two_ranks):
        explicit = DistributedPackedBatchSampler(lengths, CAPACITY, num_replicas=WORLD, rank=rank,
                                                 micro_batch_size=MICRO_BATCH, remainder="repeat", seed=SEED)
        assert r["batches"] == list(explicit)
    # the data exercise packing: a row holds several sequences, and the ranks' target counts differ
    assert max(n for r in two_ranks for n in r["rows"][0]) >= 2
    assert r0["targets"][0] != r1["targets"][0]


@pytest.mark.slow
def test_fsdp2_step_equals_the_single_process_reference(two_ranks):
    r0, r1 = two_ranks
    steps = [list(pair) for pair in zip(r0["batches"], r1["batches"], strict=True)]
    initial = {k: v.detach() for k, v in tiny_model("llama", seed=0).state_dict().items()}
    first = _reference(steps[:1])
    assert _max_diff(r0["step1"], first) <= TOL
    assert _max_diff(first, initial) > 1e-2  # the step moved the parameters: the comparison is not vacuous
    assert _max_diff(r0["epoch"], _reference(steps)) <= TOL  # and so on, step after step, over the epoch


@pytest.mark.slow
def test_fsdp2_step_with_the_fused_loss_equals_the_reference(two_ranks):
    """padfree.causal_lm_loss under FSDP2: the head's weight is sharded between forwards; the fused loss uses it
    after the model's forward, and the step must still be the reference step."""
    r0, r1 = two_ranks
    steps = [list(pair) for pair in zip(r0["batches"], r1["batches"], strict=True)]
    assert not isinstance(r0["fused_step1"], str), r0["fused_step1"]
    assert _max_diff(r0["fused_step1"], _reference(steps[:1])) <= TOL


@pytest.mark.slow
def test_the_check_discriminates_the_naive_per_rank_mean(two_ranks):
    r0, r1 = two_ranks
    step = [[r0["batches"][0], r1["batches"][0]]]
    true, naive = _reference(step), _reference(step, naive=True)
    assert _max_diff(true, naive) > 1e-4  # the data tell the two normalisations apart ...
    assert _max_diff(r0["naive"], naive) <= TOL  # ... FSDP computed the naive one as predicted ...
    assert _max_diff(r0["naive"], true) > 1e-4  # ... and it fails the exactness check


@pytest.mark.slow
def test_accelerate_fsdp_plugin_on_cpu(two_ranks):
    acc = [r["accelerate"] for r in two_ranks]
    if not acc[0]["is_fsdp2"]:
        assert acc[0]["model"] == "DistributedDataParallel"  # what it did instead: DDP, unsharded parameters
        pytest.skip(f"accelerate {__import__('accelerate').__version__} ignores FullyShardedDataParallelPlugin on "
                    f"the CPU: distributed_type={acc[0]['type']}, is_fsdp2=False, prepare() returned "
                    f"{acc[0]['model']} with {acc[0]['param']} parameters (FSDP is set only for GPU-like devices)")
    steps = [[two_ranks[0]["batches"][0], two_ranks[1]["batches"][0]]]  # pragma: no cover - see the docstring
    assert _max_diff(acc[0]["step1"], _reference(steps)) <= TOL  # pragma: no cover
