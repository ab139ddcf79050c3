"""The fused LM head of DPO on the CPU, TRL's and padfree's, per token, at the row lengths padfree's DPO modes give
it, under glibc's allocator defaults and with freed memory kept; writes its section of ``BENCHMARKS.md``.

Why: ``bench_preference.py`` compares ``packing`` (one row of up to 8,192 tokens per micro-batch) with padding-free
DPO over the same pairs (rows of ~1,000-2,700 tokens). On the CPU most of a step there is TRL's fused LM head
(``trl.kernels.ChunkedLogProbFunction`` as ``trl.DPOTrainer`` calls it through ``add_fused_lm_head``): it scores
every position it is given against the whole vocabulary in tiles of up to ``TOKEN_CHUNK_SIZE`` = 4,096 tokens, each
temporary ``[tile, vocab]`` fp32 (500 MiB at a 32k vocabulary). This script times that function alone, forward and
backward, per token at each row length, so the packed-vs-padding-free ratio can be read against the head's own
behaviour on the machine — and beside it padfree's per-token head (``padfree.model.log_probs.token_log_probs``), which
padfree's ``DPOTrainer`` runs in its place on the CPU (``padfree.integrations.fused_head``): the same fields from
two reused ``[1048, vocab]`` buffers.

What runs: ``ChunkedLogProbFunction.apply`` with TRL's DPO arguments (vocabulary chunk 32,768, temperature 1, no
softcap, outputs ``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``), and ``token_log_probs`` with the same
outputs, each on random fp32 hidden states ``(N, hidden)`` and a random ``(vocab, hidden)`` weight with every
position a target, then the backward of the log-probs' sum (the weight's and the hidden states' gradients), for
``N`` in ``--lengths``. Each allocator setting runs in its own child process (glibc
reads ``MALLOC_*`` at start): the defaults, and ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` raised so
freed blocks stay in the process. In a child, the heads and lengths run round robin for ``--repetitions`` rounds after
one untimed round; medians of the wall time per token, and the process's kernel (system) time and minor page faults
per token over the same calls.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_lm_head.py            # ~6 min on 2 cores
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


HEADS = {"trl": "TRL's `ChunkedLogProbFunction`", "padfree": "padfree's `token_log_probs`"}


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """In this process: per head and row length (``"trl:1100"``), the median forward and backward wall microseconds
    per token, and the kernel microseconds and minor faults per token of the forward + backward."""
    import torch
    from trl.kernels import ChunkedLogProbFunction

    from padfree.model.log_probs import token_log_probs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, requires_grad=True)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")

    def trl_head(hidden: Any, targets: Any) -> Any:
        return ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, outputs)[0]

    def padfree_head(hidden: Any, targets: Any) -> Any:
        return token_log_probs(hidden, weight, targets, outputs=outputs)["log_probs"]

    heads = {"trl": trl_head, "padfree": padfree_head}
    samples: dict[str, list[tuple[float, float, float, float]]] = {f"{h}:{n}": [] for h in heads for n in args.lengths}
    for rnd in range(args.repetitions + 1):
        for name, head in heads.items():
            for n in args.lengths:
                hidden = torch.randn(n, args.hidden, requires_grad=True)
                targets = torch.randint(0, args.vocab, (n,))
                before = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                log_probs = head(hidden, targets)
                t1 = time.perf_counter()
                log_probs.sum().backward()
                t2 = time.perf_counter()
                after = resource.getrusage(resource.RUSAGE_SELF)
                weight.grad = None
                if rnd:  # the first round is the warm-up
                    samples[f"{name}:{n}"].append(((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6,
                                                   (after.ru_stime - before.ru_stime) / n * 1e6,
                                                   (after.ru_minflt - before.ru_minflt) / n))
    keys = ("forward", "backward", "kernel", "faults")
    return {key: {k: statistics.median(s[i] for s in got) for i, k in enumerate(keys)}
            for key, got in samples.items()}


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
    from padfree.model.loss import default_chunk_size

    chunk = default_chunk_size(args.vocab)
    rows = []
    for head in HEADS:
        for n in args.lengths:
            chunks = (" + ".join(f"{min(4096, n - a):,}" for a in range(0, n, 4096)) if head == "trl" else
                      f"{-(-n // min(n, chunk))} × ≤ {min(n, chunk):,}")
            row = [HEADS[head], f"{n:,}", chunks]
            for setting in SETTINGS:
                r = results[setting][f"{head}:{n}"]
                row += [f"{r['forward']:,.0f}", f"{r['backward']:,.0f}", f"{r['kernel']:,.0f}",
                        f"{r['faults']:,.0f}"]
            rows.append(row)
    heads = ["head", "tokens N", "tiles (tokens)"]
    for setting in SETTINGS:
        heads += [f"{setting}: forward µs/token", "backward µs/token", "kernel µs/token", "page faults/token"]
    short, full = args.lengths[0], args.lengths[-1]

    def per_token(setting: str, head: str, n: int) -> float:
        r = results[setting][f"{head}:{n}"]
        return r["forward"] + r["backward"]

    growth = {h: ", ".join(f"{s} **{per_token(s, h, full) / per_token(s, h, short):.2f}×**" for s in SETTINGS)
              for h in HEADS}
    speed = {s: " / ".join(f"{per_token(s, 'trl', n) / per_token(s, 'padfree', n):.2f}×" for n in args.lengths)
             for s in SETTINGS}
    d = results["glibc defaults"]
    return "\n".join([
        START,
        "## DPO's fused LM head on the CPU, TRL's and padfree's, per token (`benchmarks/bench_lm_head.py`)",
        "",
        generated("bench_lm_head.py", args.argv, info["commit"], elapsed),
        "",
        *conditions(info, before, after, versions=[f"torch threads {args.threads}"]),
        f"- What runs: `trl.kernels.ChunkedLogProbFunction` as `trl.DPOTrainer`'s fused head calls it on a device "
        f"without Triton (every position scored, tiles of up to 4,096 tokens against the whole vocabulary), and "
        f"padfree's `padfree.model.log_probs.token_log_probs`, which padfree's `DPOTrainer` runs in its place on the "
        f"CPU (chunks of {chunk:,} positions in two reused buffers); outputs log-probs, entropy, mean logits, top-1; "
        f"hidden {args.hidden}, vocabulary {args.vocab:,} (the sizes of `bench_preference.py`'s llama), fp32, every "
        f"position a target (in a DPO step padfree's head is given the completion tokens only, TRL's every "
        f"position); then the backward of the log-probs' sum. Each allocator setting in its own process: glibc "
        f"defaults, and freed memory kept ({' '.join(f'`{k}={v}`' for k, v in KEEP.items())}). Medians over "
        f"{args.repetitions} round-robin rounds after one untimed round; kernel time and minor page faults per token "
        "are the process's over the same calls.",
        "- The lengths: ~1,100-2,700 tokens is a padding-free DPO micro-batch of 8 pairs in `bench_preference.py`, "
        "8,191 the scored positions of a packed row of 8,192 tokens (`packing`).",
        "",
        table(heads, rows, "ll" + "r" * (len(heads) - 2)),
        "",
        f"- Forward + backward per token at {full:,} tokens against {short:,}: TRL's head {growth['trl']}; "
        f"padfree's head {growth['padfree']}.",
        f"- TRL's head / padfree's per token (forward + backward) at {' / '.join(f'{n:,}' for n in args.lengths)} "
        "tokens: " + "; ".join(f"{s} {v}" for s, v in speed.items()) + ".",
        "- Reading it: a head's arithmetic per token does not depend on N (the same products, tile by tile); "
        "what can is memory. Under glibc's defaults every block above 32 MiB is mapped fresh and unmapped when "
        "freed, so each of TRL's `[tile, vocab]` temporaries is faulted in page by page on every call (at "
        f"{full:,} against {short:,} tokens its page faults per token are "
        f"{d[f'trl:{full}']['faults'] / max(1e-9, d[f'trl:{short}']['faults']):.2f}× and its kernel time per token "
        f"{d[f'trl:{full}']['kernel'] / max(1e-9, d[f'trl:{short}']['kernel']):.2f}×); padfree's head makes its "
        "buffers once per call and reuses them for every chunk (page faults per token at "
        f"{full:,}: {d[f'padfree:{full}']['faults']:,.0f} against TRL's {d[f'trl:{full}']['faults']:,.0f}). With "
        "freed memory kept both processes reuse what they freed (no faults once grown).",
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
