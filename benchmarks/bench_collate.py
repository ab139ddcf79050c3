"""Collate throughput: padfree's ``packed_collate_fn`` and ``PaddingFreeCollator`` against transformers'
``DataCollatorWithFlattening``; writes its section of ``BENCHMARKS.md``.

What it measures, in one process, on the same samples for every contender:

- ``padfree.data.batch.packed_collate_fn(C)`` — packs the loader batch into rows of C tokens (``obfd``, padding at
  the end of each row) and returns a ``PackedBatch`` (ids, labels, position_ids, cu_seqlens, flash kwargs);
- ``padfree.data.batch.PaddingFreeCollator()`` — one row, no padding, same ``PackedBatch``;
- ``transformers.DataCollatorWithFlattening()`` with its defaults (input_ids, labels, position_ids), and again with
  ``return_flash_attn_kwargs=True`` (what padfree's batches always carry).

Throughput is batches per second: one timed pass calls the collator on K prepared loader batches (lists of sample
dicts, built before the clock starts), and the figure is K / time. Contenders take turns within every run (round
robin, so slow drift hits all of them alike); the table gives the median over the runs, and the ratios divide
padfree's median by HF's default collator's. One untimed warm-up pass per contender first.

Samples: ``{"input_ids", "labels"}`` dicts, labels = ids with the prompt masked (-100), in two forms: Python lists
(what a ``datasets.Dataset`` without a format yields) and int64 torch tensors (``set_format("torch")``). Data sets:
GSM8K train records (``/work/shared/data/gsm8k_train.json`` or ``$PADFREE_DATA``) tokenized with padfree's default
tokenizer (``padfree.corpus.load_tokenizer()``), BOS + prompt + answer + EOS; and synthetic samples whose lengths
are lognormal (median 300, sigma 1, clipped to [8, C]), random ids. Batch sizes 16 and 64; C = 2048.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_collate.py            # full run: about a minute on 2 cores
    python benchmarks/bench_collate.py --quick    # fewer batches and runs: a smoke test

Only the section between ``<!-- bench_collate:start -->`` and ``<!-- bench_collate:end -->`` of the output file is
replaced (appended after the existing sections the first time).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from _common import emit, load_snapshot, machine, table

REPO = Path(__file__).resolve().parents[1]
START_MARK = "<!-- bench_collate:start -->"
END_MARK = "<!-- bench_collate:end -->"
CAPACITY = 2048


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------------------------------


def data_dir() -> Path:
    return Path(os.environ.get("PADFREE_DATA", "/work/shared/data"))


def gsm8k_samples(limit: int) -> list[dict[str, list[int]]]:
    from padfree.corpus import load_tokenizer

    records = json.loads((data_dir() / "gsm8k_train.json").read_text(encoding="utf-8"))[:limit]
    tok = load_tokenizer()
    prompts = tok([r["instruction"] + "\n" + (r["input"] + "\n" if r["input"] else "") for r in records],
                  add_special_tokens=False)["input_ids"]
    answers = tok([r["output"] for r in records], add_special_tokens=False)["input_ids"]
    samples = []
    for p, a in zip(prompts, answers, strict=True):
        ids = [tok.bos_token_id, *p, *a, tok.eos_token_id]
        samples.append({"input_ids": ids, "labels": [-100] * (1 + len(p)) + [*a, tok.eos_token_id]})
    return samples


def lognormal_samples(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(300), 1.0, n)), 8, CAPACITY).astype(np.int64)
    samples = []
    for length in lengths.tolist():
        ids = rng.integers(3, 32000, length).tolist()
        prompt = length // 3
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return samples


def as_tensors(samples: list[dict[str, list[int]]]) -> list[dict[str, object]]:
    import torch

    return [{k: torch.tensor(v, dtype=torch.int64) for k, v in s.items()} for s in samples]


# ------------------------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Measure:
    dataset: str
    form: str
    batch_size: int
    tokens_per_batch: float
    rows_packed: float
    medians: dict[str, float]  # contender -> batches/s


def contenders() -> dict[str, Callable]:
    from transformers import DataCollatorWithFlattening

    from padfree.data.batch import PaddingFreeCollator, packed_collate_fn

    return {
        "packed_collate_fn": packed_collate_fn(CAPACITY),
        "PaddingFreeCollator": PaddingFreeCollator(),
        "HF flattening": DataCollatorWithFlattening(),
        "HF flattening + flash kwargs": DataCollatorWithFlattening(return_flash_attn_kwargs=True),
    }


def check_agreement(fns: dict[str, Callable], batch: list) -> None:
    """The padding-free outputs of padfree and HF must be the same tokens, positions and labels."""
    import torch

    ours = fns["PaddingFreeCollator"](batch)
    hf = fns["HF flattening"](batch)
    for key in ("input_ids", "position_ids", "labels"):
        assert torch.equal(getattr(ours, key), hf[key]), key
    packed = fns["packed_collate_fn"](batch)
    assert packed.num_tokens == ours.num_tokens


def measure(name: str, form: str, samples: list, batch_size: int, num_batches: int, runs: int) -> Measure:
    fns = contenders()
    batches = [samples[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]
    batches = [b for b in batches if len(b) == batch_size]
    check_agreement(fns, batches[0])
    for fn in fns.values():  # warm-up pass
        for b in batches:
            fn(b)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for key, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            for b in batches:
                fn(b)
            times[key].append(time.perf_counter() - t0)
    tokens = statistics.mean(sum(len(s["input_ids"]) for s in b) for b in batches)
    rows = statistics.mean(fns["packed_collate_fn"](b).batch_size for b in batches[:20])
    medians = {k: len(batches) / statistics.median(v) for k, v in times.items()}
    m = Measure(name, form, batch_size, tokens, rows, medians)
    log(f"{name:10s} {form:7s} bs={batch_size:3d}: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in medians.items()))
    return m


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------





def render(args: argparse.Namespace, info: dict[str, str], before: str, after: str, results: list[Measure],
           elapsed: float, num_batches: int) -> str:
    names = list(results[0].medians)
    rows = []
    for m in results:
        hf = m.medians["HF flattening"]
        rows.append([
            m.dataset, m.form, str(m.batch_size), f"{m.tokens_per_batch:,.0f}", f"{m.rows_packed:.1f}",
            *[f"{m.medians[k]:,.0f}" for k in names],
            f"{m.medians['packed_collate_fn'] / hf:.2f}×", f"{m.medians['PaddingFreeCollator'] / hf:.2f}×",
        ])
    headers = ["data set", "samples", "batch size", "tokens / batch", "packed rows of 2048",
               *[f"{k} (batches/s)" for k in names], "packed / HF", "padding-free / HF"]
    now = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    mode = " --quick" if args.quick else ""
    return "\n".join([
        START_MARK,
        "## Collate throughput (`benchmarks/bench_collate.py`)",
        "",
        f"_Generated by `python benchmarks/bench_collate.py{mode}` on {now} (commit {info['commit']}); the run took "
        f"{elapsed:.0f} s. Regenerating replaces only this section._",
        "",
        "### Machine and conditions",
        "",
        f"- CPU: {info['cpu']}, {info['cores']}, {info['memory']} RAM; {info['os']}",
        f"- Versions: {info['versions']}; torch threads {info['torch_threads']}",
        f"- Load at start: {before}. At end: {after}.",
        "- A small shared VM: other processes may run at the same time; absolute rates drift by about ±20% between "
        "runs. The ratios, measured round robin in the same process on the same batches, are the figures to trust.",
        f"- Method: each contender collates the same {num_batches} prepared loader batches per timed pass (sample "
        f"dicts with `input_ids` and `labels`, prompt masked with -100); contenders take turns within each of "
        f"{args.runs} runs after one warm-up pass; the table gives median batches/s. Every collator returns torch "
        "tensors on the CPU; no DataLoader, no workers (a worker runs the same call).",
        f"- Contenders: `packed_collate_fn({CAPACITY})` (obfd packing into rows of {CAPACITY}, right padding, a "
        "`PackedBatch` with cu_seqlens and flash kwargs); `PaddingFreeCollator()` (one row, no padding, same "
        "`PackedBatch`); transformers' `DataCollatorWithFlattening()` (defaults: input_ids, labels, position_ids) "
        "and with `return_flash_attn_kwargs=True`. Ratios divide padfree's rate by the HF default's. Before timing, "
        "the padding-free outputs of padfree and HF are checked equal (input_ids, position_ids, labels).",
        "- Samples: *lists* = Python lists of ints (a `datasets.Dataset` without a format); *tensors* = int64 torch "
        "tensors (`set_format(\"torch\")`). gsm8k = GSM8K train records tokenized with padfree's default tokenizer "
        "(BOS + question + answer + EOS); lognormal = synthetic lengths, median 300, sigma 1, clipped to "
        f"[8, {CAPACITY}], random ids.",
        "",
        table(headers, rows, "lllrr" + "r" * len(names) + "rr"),
        "",
        "Reading it: padfree converts each sample once (one `array('q', ids)` per list, a zero-copy view per tensor) "
        "and does the rest as whole-batch numpy operations; HF's collator extends Python lists token by token "
        "(`list +=`, a list comprehension for the positions) and builds tensors from those lists, so its cost per "
        "token is Python's. `packed_collate_fn` additionally packs the batch and scatters it into padded rows.",
        END_MARK,
    ])



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and runs (a smoke test)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per contender (default 7, quick 3)")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md", help="markdown file to update")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = 3 if args.quick else 7
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    t_start = time.perf_counter()
    info = machine(("numpy", "numba", "torch", "transformers", "padfree"))
    info["torch_threads"] = str(torch.get_num_threads())
    before = load_snapshot()
    num_batches = 20 if args.quick else 60
    need = 64 * num_batches
    log(f"tokenizing {need} GSM8K records")
    data = {"gsm8k": gsm8k_samples(need), "lognormal": lognormal_samples(need)}
    results = []
    for name, samples in data.items():
        for form, prepared in (("lists", samples), ("tensors", as_tensors(samples))):
            for batch_size in (16, 64):
                results.append(measure(name, form, prepared, batch_size, num_batches, args.runs))
    after = load_snapshot()
    section = render(args, info, before, after, results, time.perf_counter() - t_start, num_batches)
    emit(section, args.no_write, args.output, (START_MARK, END_MARK), log)


if __name__ == "__main__":
    main()
