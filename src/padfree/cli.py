"""The ``padfree`` command line: ``padfree analyze [DATA] ...``.

Each subcommand is a pair of functions — ``_add_<name>(subparsers)`` declares its arguments and
``_run_<name>(args) -> int`` does the work — registered in :data:`COMMANDS`, so ``pack``, ``verify``, ``bench``
and ``demo`` slot in beside ``analyze`` without touching :func:`main`.

This module is the only place in padfree that prints. Library code raises :class:`~padfree.errors.PadfreeError`
for bad input; :func:`main` turns it into one line, ``padfree: error: ...``, on stderr and exit status 2 (the
status argparse uses for usage errors), and writes no output file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from padfree import __version__
from padfree.errors import DataLoadError, InvalidArgumentError, InvalidLengthsError, PadfreeError
from padfree.packing import STRATEGIES
from padfree.packing.inputs import as_lengths, as_positive_int, as_seed

__all__ = ["COMMANDS", "build_parser", "main"]

logger = logging.getLogger("padfree")

DATA_FORMATS = ".json (a list of records, or JSON Lines), .jsonl, .parquet, .csv, or a datasets.save_to_disk directory"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``padfree`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    0: success; 2: a usage error (argparse prints the usage) or a :class:`PadfreeError` (one line on stderr).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: argparse has already printed
        return exc.code if isinstance(exc.code, int) else 0
    _configure_logging(args.verbose)
    try:
        return args.run(args)
    except PadfreeError as exc:
        print(f"padfree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("padfree: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="padfree",
        description="Exact padding-free (packed-sequence) training: analyze, pack and verify.",
    )
    parser.add_argument("--version", action="version", version=f"padfree {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details (debug level) on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS.values():
        add(subparsers)
    return parser


def _configure_logging(verbose: bool) -> None:
    # the library logs, the CLI shows: one stderr handler on the "padfree" logger, added once per process
    if not any(getattr(h, "_padfree_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("padfree: %(levelname)s: %(message)s"))
        handler._padfree_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)


# ==================================================================================================
# padfree analyze
# ==================================================================================================


def _add_analyze(subparsers: Any) -> None:
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
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a tokenizer directory (save_pretrained); default: mistral-common's 32k SentencePiece")
    p.add_argument("--lengths-column", metavar="COL", help="use this column of precomputed lengths, no tokenizing")
    p.add_argument("--capacity", type=int, default=2048, help="packed row length in tokens (default: 2048)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="sequences per naive padded batch to compare against (default: 8)")
    p.add_argument("--strategies", metavar="LIST",
                   help=f"comma-separated strategies to compare (default: all of {','.join(STRATEGIES)})")
    p.add_argument("--plot", metavar="PNG", help="write a length histogram with the capacity marked to this PNG")
    p.add_argument("--seed", type=int, default=0, help="seed of the random batch order and of 'ffs' (default: 0)")
    p.add_argument("--limit", type=int, metavar="N", help="analyze only the first N records (or documents)")
    p.set_defaults(run=_run_analyze)


@dataclass
class _Lengths:
    """What the analyze command measured before analyzing: lengths and how they were obtained."""

    lengths: np.ndarray
    source: str
    measure: str
    skipped: int


def _run_analyze(args: argparse.Namespace) -> int:
    from padfree.analysis import analyze_lengths

    # every cheap check first, so a typo fails in milliseconds and not after tokenizing
    capacity = as_positive_int(args.capacity, "--capacity")
    batch_size = as_positive_int(args.batch_size, "--batch-size")
    seed = as_seed(args.seed, "--seed")
    limit = as_positive_int(args.limit, "--limit", allow_none=True)
    strategies = _parse_strategies(args.strategies)
    plot = _check_plot_path(args.plot)
    if args.lengths_column is not None:
        if args.data is None:
            raise InvalidArgumentError("--lengths-column needs DATA: the embedded corpus has no lengths column")
        if args.fields:
            raise InvalidArgumentError("--lengths-column and --field exclude each other: lengths are either "
                                       "read from a column or counted by tokenizing text columns")
        if args.tokenizer is not None:
            raise InvalidArgumentError("--tokenizer is not used with --lengths-column (nothing is tokenized)")
    if args.data is None and args.fields:
        raise InvalidArgumentError("--field needs DATA: the embedded corpus has no columns")

    measured = _measure(args, limit)
    analysis = analyze_lengths(measured.lengths, capacity, batch_size=batch_size, strategies=strategies, seed=seed)
    if plot is not None:
        _write_plot(plot, measured, analysis)
    print(render_analysis(analysis, measured))
    if plot is not None:
        print(f"\nplot written to {plot}")
    return 0


def _parse_strategies(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise InvalidArgumentError(
            f"--strategies {text!r}: unknown strategy {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {','.join(STRATEGIES)}"
        )
    return names


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
    from padfree import corpus

    if args.data is None:
        texts = corpus.embedded_corpus()[:limit]
        source = f"embedded corpus: {corpus.embedded_corpus_description()}"
        if limit is not None:
            source += f", first {len(texts)} documents"
        column_note = "every document"
    else:
        table = _read_table(args.data)
        if table.num_rows == 0:
            raise DataLoadError(f"DATA {args.data!r} holds no records")
        if limit is not None:
            table = table.slice(0, limit)
        source = f"{args.data} ({table.num_rows:,} records" + (f", --limit {limit})" if limit is not None else ")")
        if args.lengths_column is not None:
            lengths, skipped = _lengths_from_column(table, args.lengths_column)
            return _Lengths(lengths, source, f"precomputed lengths from column {args.lengths_column!r}", skipped)
        texts, column_note = _texts_from_columns(table, args.fields)

    tokenizer = corpus.load_tokenizer(args.tokenizer)
    name = corpus.DEFAULT_TOKENIZER_NAME if args.tokenizer is None else f"{args.tokenizer} ({type(tokenizer).__name__})"
    raw = corpus.token_lengths(texts, tokenizer, progress=None)
    # a record with no tokens cannot be packed (and would not be trained on): skip it, but say how many
    keep = raw > 0
    if not keep.any():
        raise DataLoadError(f"every one of the {raw.shape[0]} texts ({column_note}) is empty: nothing to analyze")
    return _Lengths(raw[keep], source, f"{column_note}, tokenized by {name}", int((~keep).sum()))


# ---- reading data ------------------------------------------------------------------------------------


def _read_table(data: str) -> Any:
    """``data`` as a ``pyarrow.Table``, or a :class:`DataLoadError` naming the path and the accepted formats."""
    import pyarrow as pa

    path = Path(data).expanduser()
    if not path.exists():
        raise DataLoadError(f"DATA {data!r}: no such file or directory")
    try:
        if path.is_dir():
            return _read_saved_dataset(path, data)
        suffix = path.suffix.lower()
        if suffix == ".json":
            return _read_json(path)
        if suffix in (".jsonl", ".ndjson"):
            import pyarrow.json

            return pyarrow.json.read_json(path)
        if suffix == ".parquet":
            import pyarrow.parquet

            return pyarrow.parquet.read_table(path)
        if suffix == ".csv":
            import pyarrow.csv

            return pyarrow.csv.read_csv(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        if isinstance(exc, PadfreeError):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataLoadError(f"DATA {data!r} could not be read ({type(exc).__name__}: {first})") from exc
    raise DataLoadError(f"DATA {data!r}: unsupported file type {path.suffix or '(none)'!r}; expected {DATA_FORMATS}")


def _read_json(path: Path) -> Any:
    import pyarrow as pa

    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):
        import pyarrow.json

        return pyarrow.json.read_json(path)  # JSON Lines with a .json name
    records = json.loads(path.read_text(encoding="utf-8"))
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DataLoadError(
            f"DATA {str(path)!r}: record {bad} is of type {type(records[bad]).__name__}, not an object; "
            "expected a JSON list of records such as [{\"text\": ...}, ...]"
        )
    return pa.Table.from_pylist(records)


def _read_saved_dataset(path: Path, data: str) -> Any:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataLoadError(
            f"DATA {data!r} is a DatasetDict with splits {splits}; pass one split's directory, e.g. {data}/{splits[0]}"
            if splits else f"DATA {data!r} is an empty DatasetDict"
        )
    if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
        raise DataLoadError(f"DATA {data!r} is a directory but not one written by datasets' save_to_disk; "
                            f"expected {DATA_FORMATS}")
    import datasets

    # save_to_disk writes the selected rows themselves (no indices mapping), so the backing Arrow table is the data
    return datasets.load_from_disk(str(path)).data.table


def _describe_columns(table: Any) -> str:
    return ", ".join(f"{name} ({field.type})" for name, field in zip(table.column_names, table.schema, strict=True))


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _texts_from_columns(table: Any, fields: list[str] | None) -> tuple[list[str], str]:
    import pyarrow.compute as pc

    if fields:
        for name in fields:
            if name not in table.column_names:
                raise DataLoadError(f"--field {name!r}: no such column; available columns: {_describe_columns(table)}")
            if not _is_text(table.schema.field(name).type):
                raise DataLoadError(
                    f"--field {name!r} has type {table.schema.field(name).type}, not text; choose string columns "
                    f"({_describe_columns(table)}) or pass precomputed lengths with --lengths-column"
                )
        columns = list(fields)
        note = "column " + " + ".join(map(repr, columns))
    elif "text" in table.column_names and _is_text(table.schema.field("text").type):
        columns = ["text"]
        note = "column 'text'"
    else:
        columns = [name for name, field in zip(table.column_names, table.schema, strict=True) if _is_text(field.type)]
        if not columns:
            raise DataLoadError(f"no text column to tokenize; available columns: {_describe_columns(table)}; "
                                "pass precomputed lengths with --lengths-column")
        note = ("no 'text' column, so every string column: " + " + ".join(map(repr, columns))
                + " (choose with --field)")
    if len(columns) > 1:
        note += ", joined with newlines"
        joined = pc.binary_join_element_wise(*(table[c] for c in columns), "\n",
                                             null_handling="replace", null_replacement="")
    else:
        joined = pc.fill_null(table[columns[0]], "")
    return joined.to_pylist(), note


def _lengths_from_column(table: Any, column: str) -> tuple[np.ndarray, int]:
    import pyarrow as pa

    if column not in table.column_names:
        raise DataLoadError(f"--lengths-column {column!r}: no such column; available columns: "
                            f"{_describe_columns(table)}")
    values = table[column]
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise DataLoadError(f"--lengths-column {column!r} has type {values.type}, not numbers")
    if values.null_count:
        raise DataLoadError(f"--lengths-column {column!r} has {values.null_count} missing values")
    raw = values.to_numpy()
    negative = raw < 0
    if negative.any():
        i = int(np.argmax(negative))
        raise DataLoadError(f"--lengths-column {column!r}: row {i} is {raw[i]}, but a length cannot be negative")
    keep = raw != 0
    if not keep.any():
        raise DataLoadError(f"--lengths-column {column!r}: every length is 0, nothing to analyze")
    try:
        lengths = as_lengths(raw[keep], name=f"column {column!r}")
    except InvalidLengthsError as exc:
        raise DataLoadError(f"--lengths-column: {exc}") from exc
    return lengths, int((~keep).sum())


# ---- output --------------------------------------------------------------------------------------


def _n(x: float) -> str:
    """A number with thousands separators; non-integers with one decimal."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str, indent: str = "  ") -> list[str]:
    """Aligned columns (``align``: one ``l`` or ``r`` per header); cells past the headers are free notes."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        cols = zip(cells[: len(headers)], widths, align, strict=True)
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in cols]
        return (indent + "  ".join([*parts, *cells[len(headers):]])).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def render_analysis(analysis: Any, measured: _Lengths) -> str:
    """The ``padfree analyze`` report for a :class:`~padfree.analysis.LengthAnalysis`."""
    a = analysis
    s = a.stats
    pb = a.padded
    cap = _n(a.capacity)
    out = ["padfree analyze"]
    out += textwrap.wrap(measured.source, width=110, initial_indent="  data       ", subsequent_indent=" " * 13)
    out += textwrap.wrap(measured.measure, width=110, initial_indent="  lengths    ", subsequent_indent=" " * 13)
    if measured.skipped:
        out.append(f"  skipped    {measured.skipped} empty records (no tokens: nothing to pack)")

    out += ["", f"Sequence lengths (tokens): {_n(s.count)} sequences, {_n(s.total_tokens)} tokens"]
    out += _table(
        ["", "", "", ""],
        [["min", _n(s.min), "  mean", _n(round(s.mean, 1))],
         ["median", _n(round(s.median, 1)), "  p90", _n(round(s.p90, 1))],
         ["p99", _n(round(s.p99, 1)), "  max", _n(s.max)]],
        "lrlr",
    )[1:]

    out += ["", f"Naive padded batches: {a.batch_size} sequences per batch in random order (seed {a.seed}), "
                f"rows cut at capacity {cap}"]
    if pb.truncated_sequences:
        out.append(f"  {_n(pb.truncated_sequences)} of {_n(s.count)} sequences ({pb.truncated_sequences / s.count:.1%})"
                   f" are longer than {cap} and truncated: {_n(pb.truncated_tokens)} of {_n(s.total_tokens)} tokens"
                   f" lost ({pb.truncated_tokens / s.total_tokens:.1%})")
    else:
        out.append(f"  every sequence fits in {cap} tokens")
    out += _table(
        ["padded to", "positions", "real tokens", "padding"],
        [["the longest in each batch", _n(pb.positions_longest), _n(pb.real_tokens), f"{pb.waste_longest:.1%}"],
         [f"the capacity ({cap})", _n(pb.positions_capacity), _n(pb.real_tokens), f"{pb.waste_capacity:.1%}"]],
        "lrrr",
    )

    over = f"overlong=\"truncate\": {_n(a.overlong)} sequences truncated" if a.overlong else "no sequence truncated"
    out += ["", f"Packing strategies at capacity {cap} ({over}; time: median of warm runs)"]
    rows = []
    for r in a.strategies:
        note = ["default"] if r.name == a.candidate_strategy else []
        rows.append([r.name, "online" if r.online else "offline", _n(r.num_bins), _n(r.lower_bound),
                     f"{r.efficiency:.2%}", _n(r.padding_tokens), f"{r.time_ms:.3f}", *note])
    out += _table(["strategy", "kind", "bins", "lower bound", "efficiency", "padding", "time (ms)"], rows, "llrrrrr")

    out += ["", f"Capacity candidates (strategy {a.candidate_strategy}; compared with padded batches of "
                f"{a.batch_size} cut at the same capacity)"]
    rows = []
    for c in a.candidates:
        notes = (["requested"] if c.requested else []) + (["recommended"] if c.capacity == a.recommended else [])
        rows.append([_n(c.capacity), f"{_n(c.overlong)} ({c.overlong / s.count:.1%})",
                     f"{_n(c.truncated_tokens)} ({c.truncated_tokens / s.total_tokens:.1%})", _n(c.num_bins),
                     f"{c.efficiency:.2%}", f"{c.speedup:.2f}x", f"{c.attention_ratio:.2f}x",
                     "<- " + ", ".join(notes) if notes else ""])
    out += _table(["capacity", "truncated seqs", "truncated tokens", "bins", "efficiency", "token speedup",
                   "attention"], rows, "rrrrrrr")
    out += ["  token speedup = padded positions / packed positions (real tokens per step, packed vs padded);",
            "  attention = padded attention cost (rows x width^2) / packed block-diagonal cost (sum of len^2)"]

    out += ["", f"Recommendation: capacity {_n(a.recommended)}"]
    out += textwrap.wrap(a.reason, width=110, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(out)


def _write_plot(path: Path, measured: _Lengths, analysis: Any) -> None:
    """A PNG histogram of the lengths (log x) with the capacity and the recommendation marked."""
    # the object-oriented API with an explicit Agg canvas: no pyplot state, no display, no global backend switch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lengths = measured.lengths
    a = analysis
    fig = Figure(figsize=(9, 5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lo, hi = max(1, int(lengths.min())), max(2, int(lengths.max()))
    # about 25 bins per decade, at most 60: narrower log bins over integer lengths hold uneven numbers of
    # integers, which shows up as a comb pattern
    num = int(np.clip(25 * np.log10((hi + 1) / lo), 15, 60))
    edges = np.unique(np.geomspace(lo, hi + 1, num=num + 1).astype(np.int64))
    ax.hist(lengths, bins=edges, color="#4c72b0", edgecolor="white", linewidth=0.4)
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
    # write next to the target, then rename: a failed or interrupted write never leaves a broken PNG behind
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except OSError as exc:
        raise InvalidArgumentError(f"--plot {str(path)!r} could not be written ({exc})") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


#: subcommand name -> function adding its parser; each parser sets ``run`` to the function doing the work
COMMANDS: dict[str, Callable[[Any], None]] = {"analyze": _add_analyze}


if __name__ == "__main__":
    sys.exit(main())
