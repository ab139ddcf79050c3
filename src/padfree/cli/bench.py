"""``padfree bench``: packing speed of every strategy, and training throughput padded vs packed, on this machine."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from padfree.cli._inputs import optional_positive
from padfree.cli._optional import import_error, install_hint, require
from padfree.cli._output import Progress, note, num, one_line, table
from padfree.cli._training import add_training_args, build_model, prepare, train, training_options


def add_parser(subparsers: Any) -> None:
    """Declare ``padfree bench`` and its arguments."""
    p = subparsers.add_parser(
        "bench",
        help="measure packing speed and training throughput (padded vs packed) on this machine",
        description=(
            "Two measurements on this machine: (1) packing — every padfree strategy on N synthetic lognormal "
            "lengths and on the real corpus' lengths: time, rows, lower bound, efficiency; (2) training — the "
            "same real tokens trained padded (random and length-grouped), through TRL's packing (when trl is "
            "installed), packed by padfree, and as the no-padding ideal: real tokens/s and the ratios. "
            "benchmarks/bench_packing.py and bench_training.py in the repository are the full versions."
        ),
    )
    add_training_args(p, "bench")
    p.add_argument("--lengths", type=int, metavar="N",
                   help="synthetic lengths to pack (lognormal, median 250, sigma 1; default 1,000,000; "
                        "--quick 100,000)")
    p.add_argument("--no-training", action="store_true", help="measure packing only (no model, no torch)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Time every strategy on synthetic and real lengths, then (unless ``--no-training``) train every mode."""
    started = time.perf_counter()
    opts = training_options(args, "bench")
    import numpy as np

    from padfree.analysis import analyze_lengths
    from padfree.throughput import MODES, sample_sequences

    n = optional_positive(args.lengths, "--lengths") or (100_000 if opts.quick else 1_000_000)
    if not args.no_training:
        require("padfree bench (its training part; --no-training measures packing alone)", "torch", "transformers")
    elif args.data is not None:
        require("padfree bench --data (it tokenizes the text)", "transformers")
    # what the trl mode imports (padfree.throughput): trl's packing and collator need datasets as well
    trl_missing = None if args.no_training else import_error("datasets", "trl.data_utils", "trl.trainer.sft_trainer")
    say = Progress(enabled=not args.quiet)
    rng = np.random.default_rng(opts.seed)
    synthetic = np.clip(np.rint(rng.lognormal(np.log(250), 1.0, n)), 1, opts.capacity).astype(np.int64)
    say(f"packing {n:,} synthetic lengths with every strategy")
    packing = {"synthetic": analyze_lengths(synthetic, opts.capacity, batch_size=opts.rows, repeats=5, seed=opts.seed)}
    data = None
    if not args.no_training or args.data is not None:
        data = prepare(args, opts, say)
        packing["corpus"] = analyze_lengths(data.lengths, opts.capacity, batch_size=opts.rows, repeats=5,
                                            seed=opts.seed)
    report = model_text = None
    if not args.no_training:
        assert data is not None
        model, model_text = build_model(args, opts, data.vocab, data.ids)
        modes = [m for m in MODES if m != "trl" or trl_missing is None]
        sample = sample_sequences(data.ids, opts.tokens, opts.capacity, seed=opts.seed)
        report, _ = train(model, sample, opts, modes, say)
    summary: dict[str, Any] = {"capacity": opts.capacity, "packing": {}, "seconds": 0.0}
    for name, a in packing.items():
        summary["packing"][name] = {
            "sequences": a.stats.count, "tokens": a.stats.total_tokens, "padded_waste": a.padded.waste_longest,
            "strategies": {r.name: {"ms": r.time_ms, "bins": r.num_bins, "lower_bound": r.lower_bound,
                                    "efficiency": r.efficiency} for r in a.strategies}}
    if data is not None:
        summary["packing"]["corpus"]["source"] = data.source
    if report is not None:
        summary["training"] = report.as_dict()
        summary["training"]["model"] = model_text
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary, indent=2) if args.json else render_bench(summary, packing, report))
    if trl_missing is not None:
        name = getattr(trl_missing, "name", None) or "trl"
        note(f"TRL's packing was not measured: {one_line(trl_missing)}; {install_hint(name)} adds it")
    return 0


def render_bench(summary: dict[str, Any], packing: dict[str, Any], report: Any) -> str:
    """The ``padfree bench`` report."""
    out = ["padfree bench"]
    for name, a in packing.items():
        what = (f"{a.stats.count:,} synthetic lognormal lengths (median 250, sigma 1)" if name == "synthetic"
                else f"{a.stats.count:,} sequences of {summary['packing']['corpus']['source']}")
        out += ["", f"Packing {what} into rows of {num(a.capacity)} (median of 5 warm runs)"]
        rows = [[r.name, f"{r.time_ms:.2f}", num(r.num_bins), num(r.lower_bound), f"{r.efficiency:.3%}"]
                for r in a.strategies]
        out += table(["strategy", "ms", "rows", "lower bound", "efficiency"], rows, "lrrrr")
        out.append(f"  random padded batches of {a.batch_size} waste {a.padded.waste_longest:.1%} of their positions")
    if report is not None:
        out += ["", f"Training: {summary['training']['model']}"]
        out += ["  " + line for line in str(report).splitlines()]
        ex = report.exactness
        if ex is not None:
            out.append(f"  padfree exact: {ex.ok} (max |dlogit| {ex.max_logit_diff:.1e}, max |dgrad| "
                       f"{ex.max_grad_diff:.1e})")
        if "trl" in report.leaks:
            out.append(f"  TRL path: max |dlogit| vs sequences alone {report.leaks['trl']:.1e}; "
                       f"{report.cross_targets['trl']:,} targets cross a sequence boundary")
    out.append(f"\n{summary['seconds']:.0f} s in all")
    return "\n".join(out)
