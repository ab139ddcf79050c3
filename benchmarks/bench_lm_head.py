"""TRL's fused LM head on the CPU, per token, at the row lengths padfree's DPO modes give it, under glibc's
allocator defaults and with freed memory kept; writes its section of ``BENCHMARKS.md``.

Why: ``bench_preference.py`` compares ``packing`` (one row of up to 8,192 tokens per micro-batch) with padding-free
DPO over the same pairs (rows of ~1,000-2,700 tokens). On the CPU most of a step there is TRL's fused LM head
(``trl.kernels.ChunkedLogProbFunction`` as ``trl.DPOTrainer`` calls it through ``add_fused_lm_head``): it scores
every position it is given against the whole vocabulary in tiles of up to ``TOKEN_CHUNK_SIZE`` = 4,096 tokens, each
temporary ``[tile, vocab]`` fp32 (500 MiB at a 32k vocabulary). This script times that function alone, forward and
backward, per token at each row length, so the packed-vs-padding-free ratio can be read against the head's own
behaviour on the machine.

What runs: ``ChunkedLogProbFunction.apply`` with TRL's DPO arguments (vocabulary chunk 32,768, temperature 1, no
softcap, outputs ``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``) on random fp32 hidden states ``(N,
hidden)`` and a random ``(vocab, hidden)`` weight, then the backward of the log-probs' sum (the weight's and the
hidden states' gradients), for ``N`` in ``--lengths``. Each allocator setting runs in its own child process (glibc
reads ``MALLOC_*`` at start): the defaults, and ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` raised so
freed blocks stay in the process. In a child, the lengths run round robin for ``--repetitions`` rounds after one
untimed round; medians of the wall time per token, and the process's kernel (system) time and minor page faults
per token over the same calls.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_lm_head.py            # ~2 min on 2 cores
    python benchmarks/bench_lm_head.py --quick    # a smoke run: small sizes, printed only

Only the section between ``<!-- bench_lm_head:start -->`` and ``<!-- bench_lm_head:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, emit, generated, load_snapshot, machine, table

START, END = "<!-- bench_lm_head:start -->", "<!-- bench_lm_head:end -->"
KEEP = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "17179869184"}
SETTINGS = {"glibc defaults": {}, "freed memory kept": KEEP}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """In this process: per row length, the median forward and backward wall microseconds per token, and the kernel
    microseconds and minor faults per token of the forward + backward."""
    import torch
    from trl.kernels import ChunkedLogProbFunction

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, requires_grad=True)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    samples: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in args.lengths}
    for rnd in range(args.repetitions + 1):
        for n in args.lengths:
            hidden = torch.randn(n, args.hidden, requires_grad=True)
            targets = torch.randint(0, args.vocab, (n,))
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            log_probs, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0,
                                                         outputs)
            t1 = time.perf_counter()
            log_probs.sum().backward()
            t2 = time.perf_counter()
            after = resource.getrusage(resource.RUSAGE_SELF)
            weight.grad = None
            if rnd:  # the first round is the warm-up
                samples[n].append(((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6,
                                   (after.ru_stime - before.ru_stime) / n * 1e6,
                                   (after.ru_minflt - before.ru_minflt) / n))
    keys = ("forward", "backward", "kernel", "faults")
    return {str(n): {k: statistics.median(s[i] for s in got) for i, k in enumerate(keys)}
            for n, got in samples.items()}


def child(setting: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(SETTINGS[setting])
    argv = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--hidden", str(args.hidden),
            "--vocab", str(args.vocab), "--repetitions", str(args.repetitions),
            "--lengths", ",".join(map(str, args.lengths))]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def render(args: argparse.Namespace, info: dict[str, str], before: str, after: str,
           results: dict[str, dict[str, dict[str, float]]], elapsed: float) -> str:
    rows = []
    for n in args.lengths:
        row = [f"{n:,}", " + ".join(f"{min(4096, n - a):,}" for a in range(0, n, 4096))]
        for setting in SETTINGS:
            r = results[setting][str(n)]
            row += [f"{r['forward']:,.0f}", f"{r['backward']:,.0f}", f"{r['kernel']:,.0f}", f"{r['faults']:,.0f}"]
        rows.append(row)
    heads = ["tokens N", "tiles (tokens)"]
    for setting in SETTINGS:
        heads += [f"{setting}: forward µs/token", "backward µs/token", "kernel µs/token", "page faults/token"]
    short, full = str(args.lengths[0]), str(args.lengths[-1])
    d = results["glibc defaults"]
    ratio = {s: (r[full]["forward"] + r[full]["backward"]) / (r[short]["forward"] + r[short]["backward"])
             for s, r in results.items()}
    return "\n".join([
        START,
        "## TRL's fused LM head on the CPU, per token (`benchmarks/bench_lm_head.py`)",
        "",
        generated("bench_lm_head.py", args.argv, info["commit"], elapsed),
        "",
        *conditions(info, before, after, versions=[f"torch threads {args.threads}"]),
        f"- What runs: `trl.kernels.ChunkedLogProbFunction` as `trl.DPOTrainer`'s fused head calls it on a device "
        f"without Triton (every position scored, tiles of up to 4,096 tokens against the whole vocabulary; outputs "
        f"log-probs, entropy, mean logits, top-1), hidden {args.hidden}, vocabulary {args.vocab:,} (the sizes of "
        f"`bench_preference.py`'s llama), fp32; then the backward of the log-probs' sum. Each allocator setting in "
        f"its own process: glibc defaults, and freed memory kept ({' '.join(f'`{k}={v}`' for k, v in KEEP.items())})."
        f" Medians over {args.repetitions} round-robin rounds after one untimed round; kernel time and minor page "
        "faults per token are the process's over the same calls.",
        "- The lengths: ~1,100-2,700 tokens is a padding-free DPO micro-batch of 8 pairs in `bench_preference.py`, "
        "8,191 the scored positions of a packed row of 8,192 tokens (`packing`).",
        "",
        table(heads, rows, "l" + "r" * (len(heads) - 1)),
        "",
        f"- Forward + backward per token at {int(full):,} tokens against {int(short):,}: "
        + ", ".join(f"{s} **{v:.2f}×**" for s, v in ratio.items()) + ".",
        "- Reading it: the head's arithmetic per token does not depend on N (the same products, tile by tile); "
        "what can is memory. Under glibc's defaults every block above 32 MiB is mapped fresh and unmapped when "
        "freed, so each `[tile, vocab]` temporary is faulted in page by page on every call; at "
        f"{int(full):,} against {int(short):,} tokens the page faults per token are "
        f"{d[full]['faults'] / max(1e-9, d[short]['faults']):.2f}× and the kernel time per token "
        f"{d[full]['kernel'] / max(1e-9, d[short]['kernel']):.2f}×. With freed memory kept the process reuses "
        "them (no faults once it has grown). Where the ratio above is above 1, a packed DPO row pays more per token "
        "in TRL's head than a padding-free micro-batch, whatever padfree does around it.",
        END,
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, printed only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default=None, help="comma-separated token counts (default 1100,2700,4096,8191)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=None, help="default 32000")
    parser.add_argument("--repetitions", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.argv = [a for a in given if a != "--no-write"]
    args.lengths = [int(x) for x in (args.lengths or ("300,5000" if args.quick else "1100,2700,4096,8191")).split(",")]
    args.vocab = args.vocab or (4096 if args.quick else 32000)
    args.repetitions = args.repetitions or (1 if args.quick else 3)
    args.threads = args.threads or os.cpu_count() or 1
    if args.quick:
        args.no_write = True  # a smoke run never replaces the measured section
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return
    t0 = time.perf_counter()
    info = machine(("torch", "trl"))
    before = load_snapshot()
    results: dict[str, Any] = {}
    for setting in SETTINGS:
        log(f"{setting}: {len(args.lengths)} lengths x {args.repetitions + 1} rounds")
        results[setting] = child(setting, args)
    after = load_snapshot()
    emit(render(args, info, before, after, results, time.perf_counter() - t0), args.no_write, args.output,
         (START, END), log)


if __name__ == "__main__":
    main()
