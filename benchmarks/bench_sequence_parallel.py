"""Sequence parallelism on the CPU: peak memory per rank and training-step time of one packed row split across 1, 2
and 4 gloo ranks; writes its section of ``BENCHMARKS.md``.

One packed row of ``T`` tokens (real GSM8K records, tokenized) trains forward + backward under
``padfree.configure_packing(model, sequence_parallel=P)``: each of the ``P`` ranks holds ``T / P`` tokens
(``split_for_sequence_parallel``), attention and the GatedDeltaNet scans run over the whole row for ``1 / P`` of the
heads (Ulysses all-to-alls), the token count of the loss is all-reduced over the group and the gradients are summed
over it. ``P = 1`` is the baseline: ``configure_packing(model)`` and the whole row in one process.

Per rank and model, measured in a fresh process (``torch.multiprocessing`` with ``spawn``, one torch thread, gloo
over loopback TCP):

- *saved activations*: the bytes of the tensors autograd saves for backward during one forward
  (``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, parameters left out) — exact and
  independent of the machine; the activation memory sequence parallelism divides;
- *peak RSS*: ``VmHWM`` after the steps, and its growth over the RSS measured after building the model and the
  batch, before the first step (the peak cannot be reset, so the growth is what the steps added: activations,
  gradients, communication buffers);
- *step time*: forward + backward + gradient all-reduce, one warm-up step then ``--steps`` timed, median;
- *exactness*: the group's loss (all-reduced) and gradient norm (after the all-reduce) against one rank's;
- *others' CPU*: the share of the cores that other processes used during the launch (the machine's busy CPU time
  less this script's and its ranks'), since the machine may be shared.

Models (random weights, seed 0, fp32, sdpa): a Llama and a hybrid ``qwen3_5_text`` (3 GatedDeltaNet + 1 attention
layers), both hidden 256, 4 layers, 8 heads over 4 KV heads, vocabulary 32000.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_sequence_parallel.py            # ~5-8 min on 2 cores
    python benchmarks/bench_sequence_parallel.py --quick    # a smoke run (~2 min): T = 1024, 1 timed step

Only the section between ``<!-- bench_sequence_parallel:start -->`` and ``<!-- bench_sequence_parallel:end -->`` is
replaced; ``--quick`` prints its section instead of writing it (unless ``--write``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, allocator, emit, generated, load_snapshot, machine, peak_rss, rss, table

START, END = "<!-- bench_sequence_parallel:start -->", "<!-- bench_sequence_parallel:end -->"
MODELS = ("llama", "qwen3_5_text")
SIZES = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32)
HYBRID = dict(linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
DATA = "gsm8k_train.json"
MiB = 2**20


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def data_dir() -> Path:
    return Path(os.environ.get("PADFREE_DATA", REPO.parent / "shared" / "data"))


def packed_row(tokens: int, seed: int) -> tuple[list[list[int]], str]:
    """Token ids of the GSM8K records (instruction + worked solution) that fill one row of ``tokens`` tokens, in a
    seeded random order; the last record is cut to fit. And a description."""
    from padfree import corpus

    records = json.loads((data_dir() / DATA).read_text(encoding="utf-8"))
    order = np.random.default_rng(seed).permutation(len(records))
    tokenizer = corpus.load_tokenizer()
    seqs: list[list[int]] = []
    filled, at = 0, 0
    while filled < tokens:
        chunk = [records[i] for i in order[at:at + 64]]
        at += 64
        ids = corpus.encode([r["instruction"] + "\n" + r["output"] for r in chunk], tokenizer)["input_ids"]
        for x in ids:
            x = list(x)[: tokens - filled]
            if x:
                seqs.append(x)
                filled += len(x)
            if filled == tokens:
                break
    lengths = np.array([len(s) for s in seqs])
    what = (f"one row of {tokens:,} tokens packed from {len(seqs)} GSM8K records ({DATA}, drawn with seed {seed}; "
            f"instruction + worked solution, tokenized by {corpus.DEFAULT_TOKENIZER_NAME}, no special tokens, the "
            f"last record cut to fit): lengths median {int(np.median(lengths))}, min {lengths.min()}, max "
            f"{lengths.max()} tokens; the token ids are the records' own")
    return seqs, what


def build_model(kind: str, tokens: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**SIZES, max_position_embeddings=tokens, attention_dropout=0.0)
    else:
        config = transformers.Qwen3_5TextConfig(**SIZES, **HYBRID, max_position_embeddings=tokens)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def describe_model(kind: str, params: int) -> str:
    mix = ""
    if kind == "qwen3_5_text":
        mix = (f" ({HYBRID['layer_types'].count('linear_attention')} GatedDeltaNet + "
               f"{HYBRID['layer_types'].count('full_attention')} attention; GatedDeltaNet: "
               f"{HYBRID['linear_num_value_heads']} value heads over {HYBRID['linear_num_key_heads']} key heads of "
               f"dimension {HYBRID['linear_key_head_dim']}, conv kernel {HYBRID['linear_conv_kernel_dim']})")
    return (f"{params / 1e6:.1f}M parameters: vocab {SIZES['vocab_size']}, hidden {SIZES['hidden_size']}, MLP "
            f"{SIZES['intermediate_size']}, {SIZES['num_hidden_layers']} layers{mix}, "
            f"{SIZES['num_attention_heads']} heads over {SIZES['num_key_value_heads']} KV heads of dimension "
            f"{SIZES['head_dim']}; float32, sdpa")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def _batch(seqs: list[list[int]]) -> dict[str, Any]:
    """The packed row: ``input_ids``, ``position_ids`` restarting at 0 and ``labels`` (-100 at each start), (1, T)."""
    import torch

    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _saved_bytes(model: Any) -> tuple[Any, dict[int, int]]:
    """A ``saved_tensors_hooks`` context that records every saved tensor's storage (by address; parameters left
    out) and the record it fills."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def worker(rank: int, world: int, port: int, kind: str, seqs: list[list[int]], steps: int, out: str) -> None:
    """One rank: build the model, configure it, split the row, one measured warm-up step then ``steps`` timed
    ones; the numbers go to ``out/<rank>.json``."""
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import transformers

    import padfree
    from padfree.sequence_parallel import split_for_sequence_parallel

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    tokens = sum(len(s) for s in seqs)
    model = build_model(kind, tokens)
    model.train()
    report = padfree.configure_packing(model, sequence_parallel=world) if world > 1 else \
        padfree.configure_packing(model)
    part = split_for_sequence_parallel(_batch(seqs), world)
    inputs = {"input_ids": part["input_ids"], "position_ids": part["position_ids"]}
    labels = part["shift_labels"]
    params = [p for p in model.parameters() if p.requires_grad]

    def step(record: dict[str, int] | None = None) -> tuple[float, float, float, float]:
        model.zero_grad(set_to_none=True)
        measure = record is not None
        hooks, seen = _saved_bytes(model) if measure else (contextlib.nullcontext(), {})
        loss_hooks, loss_seen = _saved_bytes(model) if measure else (contextlib.nullcontext(), {})
        t0 = time.perf_counter()
        with hooks:
            logits = model(**inputs, use_cache=False).logits
        with loss_hooks:
            local = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                      ignore_index=-100, reduction="sum")
        if measure:
            record["model"] = sum(seen.values())
            record["loss"] = sum(n for ptr, n in loss_seen.items() if ptr not in seen)
        count = (labels != -100).sum()
        if world > 1:
            dist.all_reduce(count)
        loss = local / count
        t1 = time.perf_counter()
        loss.backward()
        del logits, local
        t2 = time.perf_counter()
        if world > 1:
            for p in params:
                dist.all_reduce(p.grad)
        t3 = time.perf_counter()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        return t1 - t0, t2 - t1, t3 - t2, float(value)

    before = rss()
    saved: dict[str, int] = {}
    _, _, _, loss = step(saved)
    grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params])))
    times = [step() for _ in range(steps)]
    peak = peak_rss()
    result = {
        "rank": rank, "world": world, "tokens": int(part["input_ids"].shape[1]), "padding": int(part.padding),
        "labels": int((labels != -100).sum()), "saved": saved["model"] + saved["loss"],
        "saved_loss": saved["loss"], "rss_before": before, "peak": peak,
        "forward": statistics.median(t[0] for t in times), "backward": statistics.median(t[1] for t in times),
        "allreduce": statistics.median(t[2] for t in times),
        "step": statistics.median(t[0] + t[1] + t[2] for t in times), "loss": loss, "grad_norm": grad_norm,
        "params": sum(p.numel() for p in params), "proof": str(report.proof),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------------------


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores, steal time left out)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq


def own_seconds() -> float:
    """CPU seconds of this process and its waited-for children (the ranks of finished launches)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def launch(kind: str, world: int, seqs: list[list[int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``world`` fresh processes training ``kind`` on the row; their results, rank by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        start, busy0, own0 = time.perf_counter(), busy_seconds(), own_seconds()
        context = mp.start_processes(worker, args=(world, free_port(), kind, seqs, args.steps, out), nprocs=world,
                                     join=False, start_method="spawn")
        while not context.join(timeout=5):
            if time.perf_counter() - start > args.timeout:
                for p in context.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"{kind} on {world} ranks ran past --timeout {args.timeout} s; its processes "
                                   "were terminated")
        results = [json.loads(Path(out, f"{r}.json").read_text(encoding="utf-8")) for r in range(world)]
    wall = time.perf_counter() - start
    others = (busy_seconds() - busy0 - (own_seconds() - own0)) / (wall * (os.cpu_count() or 1))
    for r in results:
        r["others"] = max(0.0, others)
    log(f"{kind} on {world} rank(s): {wall:.0f} s; step "
        f"{max(r['step'] for r in results):.2f} s, saved {max(r['saved'] for r in results) / MiB:.0f} MiB, peak RSS "
        f"{max(r['peak'] for r in results) / MiB:.0f} MiB, loss {results[0]['loss']!r}, grad norm "
        f"{results[0]['grad_norm']!r}; other processes used {others:.0%} of the cores")
    return results


def render(args: argparse.Namespace, info: dict[str, str], before: str, after: str, what: str,
           results: dict[str, dict[int, list[dict[str, Any]]]], elapsed: float) -> str:
    others = [ranks[0]["others"] for by_world in results.values() for ranks in by_world.values()]
    shared = ""
    if max(others) > 0.05:
        shared = (f" **A shared machine**: other processes used {min(others):.0%}-{max(others):.0%} of the "
                  "cores during the launches (the column *others' CPU*: the machine's busy CPU time less this "
                  "script's and its ranks', over the launch's wall time and the cores), so the step times carry "
                  "their noise; the saved-activation bytes and the losses do not depend on it.")
    lines = [
        START,
        "## Sequence parallelism on the CPU (`benchmarks/bench_sequence_parallel.py`)",
        "",
        generated("bench_sequence_parallel.py", args.argv, info["commit"], elapsed),
        "",
        "One packed row trained forward + backward with `configure_packing(model, sequence_parallel=P)`: each of "
        "the P ranks holds T / P of the row's tokens (`split_for_sequence_parallel`); attention and the "
        "GatedDeltaNet scans run over the whole row for 1 / P of the heads (Ulysses all-to-alls); the loss's token "
        "count is all-reduced over the group and the gradients summed over it. P = 1 is `configure_packing(model)` "
        "on the whole row in one process.",
        "",
        "### Machine and conditions",
        "",
        f"- CPU: {info['cpu']}, {info['cores']}, {info['memory']} RAM; {info['os']}",
        f"- Versions: {info['versions']}; {allocator()}",
        f"- Load at start: {before}. At end: {after}.{shared}",
        "- Ranks: fresh processes (`torch.multiprocessing`, `spawn`), one torch thread each, gloo backend over "
        "loopback TCP (127.0.0.1): the all-to-alls and all-reduces are socket copies between processes of one "
        f"machine. **{os.cpu_count()} cores: 4 ranks oversubscribe them** (2 ranks per core), so the 4-rank step "
        "time is no speed-up measure; on one machine gloo measures how sequence parallelism divides the memory, "
        "not multi-GPU speed.",
        f"- Data: {what}.",
        f"- Per model and rank count: one warm-up step (which also records the saved tensors, the loss and the "
        f"gradient norm), then {args.steps} timed step(s), median per rank; the table gives the largest value "
        "over the ranks. A step: forward, the token-sum cross-entropy over the rank's slice of the 32k-vocabulary "
        "logits divided by the group's all-reduced label count, backward, and the all-reduce (sum) of every "
        "gradient over the group (none on 1 rank); no optimizer step.",
        "- *Saved activations*: bytes of the tensors autograd saves for backward during one forward "
        "(`torch.autograd.graph.saved_tensors_hooks` around the model's forward and the cross-entropy, each "
        "storage counted once, parameters left out) — exact and the same on any machine; *of which the loss*: "
        "what the cross-entropy saves beyond the model (its log-probabilities over the 32k vocabulary).",
        "- *Peak RSS growth*: `VmHWM` after the steps minus the RSS after building the model and the batch "
        "(activations, gradients, the loss's logits and communication buffers; the absolute peak is given too).",
        "",
    ]
    facts, diffs = [], []
    for kind, by_world in results.items():
        base = by_world[1][0]
        base_growth = base["peak"] - base["rss_before"]
        rows, ratios = [], []
        for world, ranks in by_world.items():
            saved = max(r["saved"] for r in ranks)
            growth = max(r["peak"] - r["rss_before"] for r in ranks)
            step = max(r["step"] for r in ranks)
            loss = ranks[0]["loss"]
            diff = abs(loss - base["loss"]) / abs(base["loss"])
            gdiff = abs(ranks[0]["grad_norm"] - base["grad_norm"]) / base["grad_norm"]
            diffs.append((diff, gdiff))
            if world > 1:
                ratios.append(f"{world} ranks: activations {saved / base['saved']:.3f}× (1 / {world} = "
                              f"{1 / world:.3f}), RSS growth {growth / base_growth:.2f}×, step "
                              f"{step / base['step']:.2f}×")
            rows.append([f"{world}", f"{ranks[0]['tokens']:,}", f"{saved / MiB:,.1f}",
                         f"{max(r['saved_loss'] for r in ranks) / MiB:,.1f}", f"{saved / base['saved']:.3f}",
                         f"{growth / MiB:,.0f}", f"{growth / base_growth:.2f}",
                         f"{max(r['peak'] for r in ranks) / MiB:,.0f}", f"{max(r['forward'] for r in ranks):.2f}",
                         f"{max(r['backward'] for r in ranks):.2f}", f"{max(r['allreduce'] for r in ranks):.2f}",
                         f"{step:.2f}", f"{step / base['step']:.2f}", f"{loss:.6f}", f"{diff:.1e}",
                         f"{gdiff:.1e}", f"{ranks[0]['others']:.0%}"])
        facts.append(f"- {kind}, per rank against one rank: " + "; ".join(ratios) + ". Its gradients are "
                     f"{base['params'] * 4 / MiB:.0f} MiB per rank whatever the rank count (inside the RSS "
                     "growth; they do not divide).")
        lines += [f"### {kind}: {describe_model(kind, base['params'])}", "",
                  f"padfree's proof of exactness on 1 rank: {base['proof']}.", "",
                  table(["ranks", "tokens per rank", "saved activations per rank (MiB)", "of which the loss",
                         "vs 1 rank", "peak RSS growth per rank (MiB)", "vs 1 rank", "peak RSS per rank (MiB)",
                         "forward (s)", "backward (s)", "grad all-reduce (s)", "step (s)", "vs 1 rank", "loss",
                         "loss rel. diff vs 1 rank", "grad-norm rel. diff vs 1 rank", "others' CPU"],
                        rows, "rrrrrrrrrrrrrrrrr"), ""]
    lines += ["### What this shows", "", *facts]
    lines += [
        f"- Exactness: over every model and rank count, the group's loss differs from one rank's by at most "
        f"{max(d for d, _ in diffs):.1e} (relative) and the summed gradients' norm by at most "
        f"{max(g for _, g in diffs):.1e}.",
        f"- Step times are those of ranks sharing {os.cpu_count()} cores and exchanging through loopback TCP "
        "sockets (gloo): the ranks compute in parallel only up to the core count, 4 ranks oversubscribe the "
        "cores, and every all-to-all and all-reduce is a copy through the kernel. They show the division of the "
        "memory and the cost of the exchanges on one machine, not the speed of a group of GPUs.",
        END,
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (~2 min): T = 1024, 1 timed step")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: llama,qwen3_5_text")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts; 1 comes first")
    parser.add_argument("--tokens", type=int, default=None, help="tokens of the packed row (default 8192)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per rank (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=400, help="seconds one launch may run")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--write", action="store_true", help="--quick: write the section anyway")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.argv = [a for a in given if a not in ("--no-write", "--write")]
    args.models = args.models.split(",")
    args.ranks = sorted({int(x) for x in args.ranks.split(",")} | {1})
    args.tokens = args.tokens or (1024 if args.quick else 8192)
    args.steps = args.steps or (1 if args.quick else 3)
    if args.quick and not args.write:
        args.no_write = True  # a smoke run never replaces the measured section
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    info = machine(("numpy", "torch", "transformers", "padfree"))
    before = load_snapshot()
    seqs, what = packed_row(args.tokens, args.seed)
    log(f"{what}")
    results = {kind: {world: launch(kind, world, seqs, args) for world in args.ranks} for kind in args.models}
    after = load_snapshot()
    section = render(args, info, before, after, what, results, time.perf_counter() - t0)
    emit(section, args.no_write, args.output, (START, END), log)


if __name__ == "__main__":
    main()
