"""``padfree analyze [DATA]``: how much padding packing removes from a dataset, and which capacity to use."""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from padfree.cli._columns import chat_columns, lengths_from_column, texts_from_columns
from padfree.cli._inputs import DATA_FORMATS, check_data_path, optional_positive, read_table
from padfree.cli._optional import importable, require
from padfree.cli._output import log_bins, new_figure, num, save_png, table
from padfree.cli._tokens import chat_lengths, load_tokenizer
from padfree.errors import DataLoadError, InvalidArgumentError

if TYPE_CHECKING:  # numpy is imported where it is used: a usage error costs no import
    import numpy as np


def add_parser(subparsers: Any) -> None:
    """Declare ``padfree analyze`` and its arguments."""
    p = subparsers.add_parser(
        "analyze",
        help="how much padding packing removes from a dataset, and which capacity to use",
        description=(
            "Tokenize a dataset (or read precomputed lengths), then compare naive padded batches with packing: "
            "length statistics, padding waste, every packing strategy, candidate capacities and a recommendation. "
            "Without DATA: the embedded corpus (CPython's standard library and pydoc topics) with the default "
            "tokenizer, offline."
        ),
    )
    p.add_argument("data", nargs="?", metavar="DATA", help=f"dataset: {DATA_FORMATS}")
    p.add_argument("--field", action="append", dest="fields", metavar="F",
                   help="text column (repeat for several, joined with newlines); default: 'text' if present, "
                        "else every string column")
    p.add_argument("--chat", action="store_true",
                   help="chat data, measured through the tokenizer's chat template: a 'messages' column (read as "
                        "chat even without --chat), or 'prompt' and 'completion' columns (lists of messages, or with "
                        "--chat strings: a user turn and the assistant's answer)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a tokenizer directory (save_pretrained); default: mistral-common's 32k SentencePiece, "
                        "with padfree's chat template (padfree.corpus.CHAT_TEMPLATE)")
    p.add_argument("--lengths-column", metavar="COL", help="use this column of precomputed lengths, no tokenizing")
    p.add_argument("--capacity", type=int, default=2048, help="packed row length in tokens (default: 2048)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="sequences per naive padded batch to compare against (default: 8)")
    p.add_argument("--strategies", metavar="LIST",
                   help="comma-separated strategies to compare (default: all of {strategies})")
    p.add_argument("--plot", metavar="PNG", help="write a length histogram with the capacity marked to this PNG")
    p.add_argument("--seed", type=int, default=0, help="seed of the random batch order and of 'ffs' (default: 0)")
    p.add_argument("--limit", type=int, metavar="N", help="analyze only the first N records (or documents)")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON on stdout")
    p.set_defaults(run=run)


@dataclass
class _Lengths:
    """What the analyze command measured before analyzing: lengths and how they were obtained."""

    lengths: np.ndarray
    source: str
    measure: str
    skipped: int


def run(args: argparse.Namespace) -> int:
    """Measure the lengths of DATA, analyze them, print the report (or JSON), draw ``--plot``."""
    # every cheap check first, so a typo fails in milliseconds and not after tokenizing; a missing DATA first of
    # all, before the packing engine (numba) is imported
    if args.data is not None:
        check_data_path(args.data)
    from padfree.packing.inputs import as_capacity, as_positive_int, as_seed

    capacity = as_capacity(args.capacity, "--capacity")
    batch_size = as_positive_int(args.batch_size, "--batch-size")
    seed = as_seed(args.seed, "--seed")
    limit = optional_positive(args.limit, "--limit")
    strategies = _parse_strategies(args.strategies)
    plot = _check_plot_path(args.plot)
    if args.chat and args.data is None:
        raise InvalidArgumentError("--chat needs DATA: the embedded corpus holds no conversations")
    if args.lengths_column is not None:
        if args.chat:
            raise InvalidArgumentError("--lengths-column and --chat exclude each other: lengths are either read from "
                                       "a column or counted through the chat template")
        if args.data is None:
            raise InvalidArgumentError("--lengths-column needs DATA: the embedded corpus has no lengths column")
        if args.fields:
            raise InvalidArgumentError("--lengths-column and --field exclude each other: lengths are either "
                                       "read from a column or counted by tokenizing text columns")
        if args.tokenizer is not None:
            raise InvalidArgumentError("--tokenizer is not used with --lengths-column (nothing is tokenized)")
    if args.data is None and args.fields:
        raise InvalidArgumentError("--field needs DATA: the embedded corpus has no columns")
    if plot is not None:
        require("padfree analyze --plot", "matplotlib")
    if args.lengths_column is None:
        require("padfree analyze (it tokenizes the text)", "transformers")

    from padfree.analysis import analyze_lengths

    measured = _measure(args, limit)
    analysis = analyze_lengths(measured.lengths, capacity, batch_size=batch_size, strategies=strategies, seed=seed)
    if plot is not None:
        _write_plot(plot, measured, analysis)
    if args.json:
        print(json.dumps(analysis_json(analysis, measured, plot), indent=2))
        return 0
    print(render_analysis(analysis, measured))
    if plot is not None:
        print(f"\nplot written to {plot}")
    return 0


def analysis_json(analysis: Any, measured: _Lengths, plot: Path | None) -> dict[str, Any]:
    """What ``padfree analyze --json`` prints: the :class:`~padfree.analysis.LengthAnalysis` as plain data, with
    where the lengths came from and the padded batches' waste."""
    result = dataclasses.asdict(analysis)
    result["padded"].update(waste_longest=analysis.padded.waste_longest,
                            waste_capacity=analysis.padded.waste_capacity)
    return {"data": measured.source, "lengths": measured.measure, "skipped_empty": measured.skipped,
            **result, "plot": None if plot is None else str(plot)}


def _parse_strategies(text: str | None) -> list[str] | None:
    from padfree.packing import STRATEGIES, as_strategy

    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    canonical, unknown = [], []
    for name in names:
        try:
            canonical.append(as_strategy(name))
        except InvalidArgumentError:
            unknown.append(name)
    if unknown or not names:
        raise InvalidArgumentError(
            f"--strategies {text!r}: unknown strategy {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {','.join(STRATEGIES)} (any case; SeqPacker's names are accepted too)"
        )
    return list(dict.fromkeys(canonical))


def _check_plot_path(plot: str | None) -> Path | None:
    if plot is None:
        return None
    path = Path(plot).expanduser()
    if path.is_dir():
        raise InvalidArgumentError(f"--plot {plot!r} is a directory; give a file name such as lengths.png")
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"--plot {plot!r}: the directory {str(path.parent)!r} does not exist")
    return path


def _measure(args: argparse.Namespace, limit: int | None) -> _Lengths:
    import numpy as np

    from padfree import corpus

    if args.data is None:
        texts = corpus.embedded_corpus()[:limit]
        source = f"embedded corpus: {corpus.embedded_corpus_description()}"
        if limit is not None:
            source += f", first {len(texts)} documents"
        column_note = "every document"
    else:
        data = read_table(args.data)
        if limit is not None:
            data = data.slice(0, limit)
        source = f"{args.data} ({data.num_rows:,} records" + (f", --limit {limit})" if limit is not None else ")")
        if args.lengths_column is not None:
            lengths, skipped = lengths_from_column(data, args.lengths_column)
            return _Lengths(lengths, source, f"precomputed lengths from column {args.lengths_column!r}", skipped)
        chat = chat_columns(data.schema, args.chat, "--field" if args.fields else None, source=f"DATA {args.data!r}")
        if chat is not None:
            tokenizer, name = load_tokenizer(args.tokenizer)
            raw = np.asarray(chat_lengths(data, chat, tokenizer), np.int64)
            return _Lengths(raw, source, f"{chat.note}, tokenized by {name}", 0)
        texts, column_note = texts_from_columns(data, args.fields, source=f"DATA {args.data!r}")

    tokenizer, name = load_tokenizer(args.tokenizer)
    raw = corpus.token_lengths(texts, tokenizer, progress=None if importable("tqdm") else False)
    # a record with no tokens cannot be packed (and would not be trained on): skip it, but say how many
    keep = raw > 0
    if not keep.any():
        raise DataLoadError(f"every one of the {raw.shape[0]} texts ({column_note}) is empty: nothing to analyze")
    return _Lengths(raw[keep], source, f"{column_note}, tokenized by {name}", int((~keep).sum()))


def render_analysis(analysis: Any, measured: _Lengths) -> str:
    """The ``padfree analyze`` report for a :class:`~padfree.analysis.LengthAnalysis`."""
    a = analysis
    s = a.stats
    pb = a.padded
    cap = num(a.capacity)
    out = ["padfree analyze"]
    out += textwrap.wrap(measured.source, width=110, initial_indent="  data       ", subsequent_indent=" " * 13)
    out += textwrap.wrap(measured.measure, width=110, initial_indent="  lengths    ", subsequent_indent=" " * 13)
    if measured.skipped:
        out.append(f"  skipped    {measured.skipped} empty records (no tokens: nothing to pack)")

    out += ["", f"Sequence lengths (tokens): {num(s.count)} sequences, {num(s.total_tokens)} tokens"]
    out += table(
        ["", "", "", ""],
        [["min", num(s.min), "  mean", num(round(s.mean, 1))],
         ["median", num(round(s.median, 1)), "  p90", num(round(s.p90, 1))],
         ["p99", num(round(s.p99, 1)), "  max", num(s.max)]],
        "lrlr",
    )[1:]

    out += ["", f"Naive padded batches: {a.batch_size} sequences per batch in random order (seed {a.seed}), "
                f"rows cut at capacity {cap}"]
    if pb.truncated_sequences:
        out.append(f"  {num(pb.truncated_sequences)} of {num(s.count)} sequences "
                   f"({pb.truncated_sequences / s.count:.1%}) are longer than {cap} and truncated: "
                   f"{num(pb.truncated_tokens)} of {num(s.total_tokens)} tokens lost "
                   f"({pb.truncated_tokens / s.total_tokens:.1%})")
    else:
        out.append(f"  every sequence fits in {cap} tokens")
    out += table(
        ["padded to", "positions", "real tokens", "padding"],
        [["the longest in each batch", num(pb.positions_longest), num(pb.real_tokens), f"{pb.waste_longest:.1%}"],
         [f"the capacity ({cap})", num(pb.positions_capacity), num(pb.real_tokens), f"{pb.waste_capacity:.1%}"]],
        "lrrr",
    )

    over = f"overlong=\"truncate\": {num(a.overlong)} sequences truncated" if a.overlong else "no sequence truncated"
    out += ["", f"Packing strategies at capacity {cap} ({over}; time: median of warm runs)"]
    rows = []
    for r in a.strategies:
        note = ["default"] if r.name == a.candidate_strategy else []
        rows.append([r.name, "online" if r.online else "offline", num(r.num_bins), num(r.lower_bound),
                     f"{r.efficiency:.2%}", num(r.padding_tokens), f"{r.time_ms:.3f}", *note])
    out += table(["strategy", "kind", "bins", "lower bound", "efficiency", "padding", "time (ms)"], rows, "llrrrrr")

    out += ["", f"Capacity candidates (strategy {a.candidate_strategy}; compared with padded batches of "
                f"{a.batch_size} cut at the same capacity)"]
    rows = []
    for c in a.candidates:
        notes = (["requested"] if c.requested else []) + (["recommended"] if c.capacity == a.recommended else [])
        rows.append([num(c.capacity), f"{num(c.overlong)} ({c.overlong / s.count:.1%})",
                     f"{num(c.truncated_tokens)} ({c.truncated_tokens / s.total_tokens:.1%})", num(c.num_bins),
                     f"{c.efficiency:.2%}", f"{c.speedup:.2f}x", f"{c.attention_ratio:.2f}x",
                     "<- " + ", ".join(notes) if notes else ""])
    out += table(["capacity", "truncated seqs", "truncated tokens", "bins", "efficiency", "token speedup",
                  "attention"], rows, "rrrrrrr")
    out += ["  token speedup = padded positions / packed positions (real tokens per step, packed vs padded);",
            "  attention = padded attention cost (rows x width^2) / packed block-diagonal cost (sum of len^2)"]

    out += ["", f"Recommendation: capacity {num(a.recommended)}"]
    out += textwrap.wrap(a.reason, width=110, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(out)


def _write_plot(path: Path, measured: _Lengths, analysis: Any) -> None:
    """A PNG histogram of the lengths (log x) with the capacity and the recommendation marked."""
    lengths = measured.lengths
    a = analysis
    fig = new_figure(9, 5, dpi=110)
    ax = fig.add_subplot()
    ax.hist(lengths, bins=log_bins(lengths), color="#4c72b0", edgecolor="white", linewidth=0.4)
    ax.set_xscale("log")
    ax.set_xlabel("sequence length (tokens, log scale)")
    ax.set_ylabel("sequences")
    ax.axvline(a.capacity, color="#c44e52", linestyle="--", linewidth=2,
               label=f"capacity {a.capacity:,} ({a.overlong:,} longer, {a.overlong / a.stats.count:.1%})")
    if a.recommended != a.capacity:
        rec = a.candidate(a.recommended)
        ax.axvline(a.recommended, color="#55a868", linestyle=":", linewidth=2,
                   label=f"recommended {a.recommended:,} ({rec.overlong:,} longer)")
    ax.axvline(a.stats.median, color="0.35", linewidth=1, label=f"median {a.stats.median:,.0f}")
    ax.legend(loc="upper right", fontsize=9)
    eff = a.candidate(a.capacity).efficiency
    title = measured.source if len(measured.source) <= 110 else measured.source[:107] + "..."
    ax.set_title(f"{title}\n{a.stats.count:,} sequences, {a.stats.total_tokens:,} tokens; "
                 f"packed at {a.capacity:,}: {eff:.1%} efficiency vs {1 - a.padded.waste_longest:.1%} padded",
                 fontsize=10)
    save_png(fig, path, f"--plot {str(path)!r}")
