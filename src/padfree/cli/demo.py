"""``padfree demo``: tokenize, analyze and pack a real corpus, verify a model, train it padded and packed, draw it."""

from __future__ import annotations

import argparse
import json
import textwrap
import time
from pathlib import Path
from typing import Any

from padfree.cli._optional import importable, install_hint, require
from padfree.cli._output import Progress, bar, log_bins, new_figure, note, num, save_png, table
from padfree.cli._training import Prepared, add_training_args, build_model, prepare, train, training_options
from padfree.errors import InvalidArgumentError

DEMO_PNG = "padfree-demo.png"


def add_parser(subparsers: Any) -> None:
    """Declare ``padfree demo`` and its arguments."""
    p = subparsers.add_parser(
        "demo",
        help="tokenize, analyze and pack a real corpus, verify a model, and train it padded vs packed",
        description=(
            "The whole story on your machine, offline, in a few minutes (--quick: a smaller run; --full: the whole "
            "corpus, a larger model, several times longer): tokenize a real corpus (a quarter of the embedded one: "
            "CPython's standard library and pydoc topics; or --data), analyze its lengths, pack it, build a small "
            "Llama (or load "
            "--model), prove with verify() that a packed step equals the per-sequence steps, then train the same "
            "real tokens four ways — random padded batches, length-grouped padded batches, padfree packed rows, and "
            "packed rows with padfree's fused loss — and report real tokens/s, the speedups and the losses; writes "
            f"{DEMO_PNG} (lengths, row fill, throughput) to --output. Needs torch and transformers; without "
            "matplotlib everything runs and only the picture is left out (one line says so)."
        ),
    )
    add_training_args(p, "demo")
    p.add_argument("-o", "--output", default=".", metavar="DIR",
                   help=f"directory for {DEMO_PNG} (created if missing; default: the current directory)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prepare the tokens, analyze and pack them, train every mode, report and draw."""
    started = time.perf_counter()
    opts = training_options(args, "demo")
    output = _check_output_dir(args.output)
    from padfree.analysis import analyze_lengths
    from padfree.packing import pack_sequences
    from padfree.throughput import sample_sequences

    require("padfree demo", "torch", "transformers")
    # the picture only illustrates the numbers: without matplotlib the demo runs and says what it left out
    draw = importable("matplotlib")
    say = Progress(enabled=not args.quiet)
    data = prepare(args, opts, say)
    say(f"analyzing {data.lengths.shape[0]:,} lengths and packing them into rows of {opts.capacity:,}")
    progress = bar(data.lengths.shape[0], "packing", "seq")
    try:
        analysis = analyze_lengths(data.lengths, opts.capacity, batch_size=opts.rows, strategies=["obfd"],
                                   seed=opts.seed)
        plan = pack_sequences(data.lengths, opts.capacity, overlong="truncate")
        progress.update(data.lengths.shape[0])
    finally:
        progress.close()
    model, model_text = build_model(args, opts, data.vocab, data.ids)
    sample = sample_sequences(data.ids, opts.tokens, opts.capacity, seed=opts.seed)
    report, plans = train(model, sample, opts, ("padded", "grouped", "packed"), say, fused=("packed",))
    png = output / DEMO_PNG if draw else None
    if png is not None:
        output.mkdir(exist_ok=True)
        _write_plot(png, data, plan, plans, report)
    summary = {"data": data.source, "tokenizer": data.tokenizer_name, "model": model_text,
               "sequences": int(data.lengths.shape[0]), "tokens": int(data.lengths.sum()),
               "packing": {"capacity": opts.capacity, "rows": plan.num_bins, "efficiency": plan.efficiency,
                           "padded_waste": analysis.padded.waste_longest},
               "training": report.as_dict(), "threads": opts.threads, "size": opts.size,
               "png": None if png is None else str(png),
               "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(summary, indent=2) if args.json else render_demo(summary, data, analysis, plan, report))
    if png is None:
        note(f"{DEMO_PNG} was not drawn: matplotlib cannot be imported; {install_hint('matplotlib')} draws it")
    return 0


def _check_output_dir(output: str) -> Path:
    path = Path(output).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidArgumentError(f"--output {output!r} is a file; give a directory for {DEMO_PNG}")
    if not path.exists() and not path.parent.is_dir():
        raise InvalidArgumentError(f"--output {output!r}: the directory {str(path.parent)!r} does not exist")
    return path


def render_demo(summary: dict[str, Any], data: Prepared, analysis: Any, plan: Any, report: Any) -> str:
    """The ``padfree demo`` report."""
    s = analysis.stats
    out = ["padfree demo"]
    out += textwrap.wrap(data.source, width=110, initial_indent="  data       ", subsequent_indent=" " * 13)
    out += [f"  tokenizer  {data.tokenizer_name}",
            f"  lengths    {num(s.count)} sequences, {num(s.total_tokens)} tokens; median {num(round(s.median))}, "
            f"p99 {num(round(s.p99))}, max {num(s.max)}" + (f"; {data.skipped} empty texts skipped" if data.skipped
                                                           else ""),
            f"  padding    random batches of {analysis.batch_size} padded to the longest: "
            f"{analysis.padded.waste_longest:.1%} of the positions are padding"
            + (f" ({num(analysis.overlong)} sequences longer than {num(plan.capacity)} truncated)"
               if analysis.overlong else ""),
            f"  packed     {num(plan.num_bins)} rows of {num(plan.capacity)} (lower bound {num(plan.lower_bound)}): "
            f"{plan.efficiency:.2%} of the positions are real tokens",
            f"  model      {summary['model']}"]
    ex = report.exactness
    out += ["", "Exactness: verify() — the packed row holding the most sequences against each of them alone, same "
                "weights"]
    out += (["  " + line for line in str(ex).splitlines()[-2:]] if ex is not None
            else ["  no packed row holds two sequences: no boundary to check"])
    if report.inrun_proof is not None:
        seconds, proof = report.inrun_proof
        trained = sum(report.results["packed"].seconds)
        control = "none" if proof.control is None else f"{proof.control:.1e}"
        out += ["  in-run proof, what padfree's trainers run before their first optimizer step "
                "(padfree_verify='first_step'):",
                f"    {proof.num_sequences} sequences of the first packed micro-batch: max |Δlogit| "
                f"{proof.max_logit_diff:.1e} within {proof.atol:.1e}, leaking control {control}",
                f"    {seconds:.2f} s, {report.inrun_proof_share:.1%} of the packed mode's {trained:.1f} s of training "
                f"here ({report.inrun_proof_cpu_share:.1%} in CPU time; once per run: a smaller share of a longer "
                "one)"]
    out += _training_section(report, summary)
    done = (f"plot written to {summary['png']}" if summary["png"] is not None
            else f"no plot ({DEMO_PNG} needs matplotlib)")
    out += ["", f"{done} ({summary['seconds']:.0f} s in all)"]
    return "\n".join(out)


def _training_section(report: Any, summary: dict[str, Any]) -> list[str]:
    """The training table and what its numbers mean, said in the report itself."""
    r = report.results
    padded, packed = r["padded"], r["packed"]
    threads = summary.get("threads")
    where = f"{threads} torch thread{'s' if threads != 1 else ''}" if threads else "torch's threads"
    out = ["", f"Training the same {num(packed.real_tokens)} real tokens {len(r)} ways ({report.repetitions} timed "
               f"pass(es) each, interleaved; AdamW from the same initial weights every pass; {where})"]
    rows = [[m, num(x.steps), num(x.positions), f"{x.efficiency:.1%}", f"{x.median_seconds:.2f}",
             num(round(x.tokens_per_second)), f"{report.speedup(m, 'padded'):.2f}x", f"{x.final_loss():.3f}"]
            for m, x in r.items()]
    out += table(["mode", "optimizer steps", "positions", "filled", "seconds", "real tokens/s", "vs padded",
                  "final loss"], rows, "lrrrrrrr")
    wrap = dict(width=110, initial_indent="  - ", subsequent_indent="    ")
    out += ["", "  How to read it:"]
    out += textwrap.wrap(
        f"steps: every mode trains the same real tokens, {report.rows} rows per optimizer step. A padded step holds "
        f"{report.rows} sequences, each padded to the longest; a packed step holds {report.rows} rows of up to "
        f"{num(report.capacity)} tokens, each several whole sequences end to end (positions restart, attention "
        f"stays within each sequence). "
        + (f"So packed takes fewer optimizer steps for the same tokens ({num(packed.steps)} vs {num(padded.steps)})."
           if packed.steps < padded.steps else
           f"Here the sequences are long enough that packing saves no step ({num(packed.steps)} vs "
           f"{num(padded.steps)}): it saves the padding."), **wrap)
    out += textwrap.wrap(
        "positions: what the model computes over, padding included; filled = real tokens / positions.", **wrap)
    out += textwrap.wrap(
        "vs padded: this mode's real tokens per second divided by those of random padded batches — same tokens, "
        "same model, same machine, timed together; above 1.00x is faster.", **wrap)
    out += textwrap.wrap(
        "final loss: the token-weighted mean loss over the last quarter of the tokens, where each mode got to. With "
        "fewer, larger steps a pass makes fewer updates, so packed can end a single pass at a different loss; that "
        "is the number of updates, not what a step computes (verify() above: a packed step equals its sequences "
        "run alone; with the same batches, padfree.SFTTrainer's step equals TRL's padded step).", **wrap)
    out += ["", f"Packed trains {report.speedup('packed', 'padded'):.2f}x the real tokens per second of random "
                f"padded batches and {report.speedup('packed', 'grouped'):.2f}x those of length-grouped ones."]
    if "packed+fused" in r:
        out += textwrap.wrap(
            f"With padfree's fused loss as well (padfree_fused_loss=True / padfree.causal_lm_loss: the LM head and "
            f"the cross-entropy fused, over target positions only, no logits tensor), packed trains "
            f"{report.speedup('packed+fused', 'padded'):.2f}x random padded batches; the fused loss alone gives "
            f"packed {report.speedup('packed+fused', 'packed'):.2f}x.", width=110)
    out += textwrap.wrap(
        "These ratios belong to this small model on this CPU; how much packing saves grows with the padding it "
        "removes and the model's size (BENCHMARKS.md measures larger settings).", width=110)
    return out


def _write_plot(path: Path, data: Prepared, plan: Any, plans: dict[str, Any], report: Any) -> None:
    """Three panels: the lengths (log histogram, capacity marked), how full rows and batches are, the throughput."""
    import numpy as np
    fig = new_figure(15, 4.8, dpi=100)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    lengths = data.lengths
    ax1.hist(lengths, bins=log_bins(lengths), color="#4c72b0", edgecolor="white", linewidth=0.4)
    ax1.set_xscale("log")
    ax1.axvline(plan.capacity, color="#c44e52", linestyle="--", linewidth=2, label=f"capacity {plan.capacity:,}")
    ax1.set_xlabel("sequence length (tokens, log scale)")
    ax1.set_ylabel("sequences")
    ax1.set_title(f"{lengths.shape[0]:,} sequences, {int(lengths.sum()):,} tokens", fontsize=10)
    ax1.legend(fontsize=9)

    grid = np.linspace(0, 1, 21)
    fills = {m: np.array([s.real_tokens / s.positions for s in plans[m].steps]) for m in plans}
    labels = {"padded": "random padded batches", "grouped": "length-grouped batches", "packed": "packed steps"}
    for m, color in (("padded", "#c44e52"), ("grouped", "#dd8452"), ("packed", "#55a868")):
        values = fills[m]
        label = f"{labels[m]} ({plans[m].efficiency:.1%})"
        weights = np.full(values.shape[0], 100.0 / max(values.shape[0], 1))
        ax2.hist(values, bins=grid, weights=weights, alpha=0.6, color=color, label=label)
    ax2.set_xlabel("share of the step's positions holding real tokens")
    ax2.set_ylabel("% of the steps")
    ax2.set_title(f"how full the steps are (whole corpus packed: {plan.efficiency:.1%})", fontsize=10)
    ax2.legend(fontsize=9, loc="upper left")

    modes = list(report.results)
    speeds = [report[m].tokens_per_second for m in modes]
    colors = {"padded": "#c44e52", "grouped": "#dd8452", "packed": "#55a868", "ideal": "#8172b3", "trl": "#937860"}
    bars = ax3.bar(modes, speeds, color=[colors.get(m, "0.5") for m in modes])
    for rect, m in zip(bars, modes, strict=True):
        ax3.annotate(f"{report.speedup(m, 'padded'):.2f}x", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                     ha="center", va="bottom", fontsize=10)
    ax3.set_ylabel("real tokens / s (median pass)")
    ax3.set_title(f"training the same {report['packed'].real_tokens:,} tokens (x = vs random padded)", fontsize=10)
    save_png(fig, path, f"--output {str(path.parent)!r}: {path.name}")
