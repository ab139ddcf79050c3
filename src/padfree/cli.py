"""The ``padfree`` command line: ``padfree analyze [DATA]``, ``padfree pack [DATA] -o OUT``, ``padfree verify``,
``padfree demo`` and ``padfree bench``.

Each subcommand is a pair of functions — ``_add_<name>(subparsers)`` declares its arguments and
``_run_<name>(args) -> int`` does the work — registered in :data:`COMMANDS`, so a new command slots in beside the
others without touching :func:`main`. ``analyze`` and ``pack`` read their input through the
same helpers (:func:`_read_table` / :func:`_read_dataset`, :func:`_text_columns`, :func:`_join_text`), so a file
that ``analyze`` measures is tokenized by ``pack`` into exactly the tokens that were counted.

This module is the only place in padfree that prints. Library code raises :class:`~padfree.errors.PadfreeError`
for bad input; :func:`main` turns it into one line, ``padfree: error: ...``, on stderr and exit status 2 (the
status argparse uses for usage errors), and writes no output file: ``pack`` builds its output in a hidden work
directory beside ``--output`` and renames it into place only when complete (see :class:`_AtomicOutput`).

Optional packages: ``padfree --help`` and every ``padfree COMMAND --help`` need only numpy and numba. A command
checks the packages its work needs (:func:`_require`) after its cheap argument checks and before it reads,
tokenizes or trains anything, and stops with one line naming the package and the extra that installs it
(:func:`_install_hint`). What only decorates a run is skipped instead: without tqdm there are no progress bars;
without matplotlib ``padfree demo`` does all its work and says in one line that the picture was not drawn (``analyze
--plot`` asks for the picture itself, so it stops up front). An ``ImportError`` that still escapes becomes one line
too (:func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from padfree import __version__
from padfree.errors import (
    BackendUnavailableError,
    DataLoadError,
    InvalidArgumentError,
    InvalidLengthsError,
    PadfreeError,
    TokenizerLoadError,
    UnsupportedModelError,
)
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
        print(f"padfree: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except ImportError as exc:  # an optional package a path needs that no _require() named up front
        missing = exc.name or "a package"
        fix = ("this padfree installation is incomplete: reinstall padfree" if missing.partition(".")[0] == "padfree"
               else f"install it with: {_install_hint(missing)}")
        print(f"padfree: error: padfree {args.command} could not import {missing} ({_one_line(exc)}); {fix}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("padfree: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="padfree",
        description="Exact padding-free (packed-sequence) training: analyze, pack, verify, demo and bench.",
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


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (a multi-line message would read as several errors)."""
    return " ".join(str(exc).split()) or type(exc).__name__


# ---- optional packages -------------------------------------------------------------------------------

#: top-level module -> (the name pip knows it by, the extra of pyproject.toml that installs it). Every package the
#: commands import beyond numpy and numba is in the ``cli`` extra, except torch and trl.
_OPTIONAL = {
    "torch": ("torch", "torch"),
    "transformers": ("transformers", "cli"),
    "datasets": ("datasets", "cli"),
    "pyarrow": ("pyarrow", "cli"),
    "tqdm": ("tqdm", "cli"),
    "matplotlib": ("matplotlib", "cli"),
    "mistral_common": ("mistral-common", "cli"),
    "sentencepiece": ("sentencepiece", "cli"),
    "google": ("protobuf", "cli"),
    "trl": ("trl", "trl"),
}

#: torch is in no extra but its own, and the wheel pip picks by default is the CUDA one on Linux
_CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _install_hint(module: str) -> str:
    """What to run to install ``module`` (a dotted name is fine): the padfree extra that brings it."""
    top = module.partition(".")[0]
    package, extra = _OPTIONAL.get(top, (top, "all"))
    if top == "torch":
        return f"pip install 'padfree[torch]' (without an NVIDIA GPU, install the CPU wheel instead: {_CPU_TORCH})"
    return f"pip install 'padfree[{extra}]' (it brings {package})"


def _require(needed_for: str, *modules: str) -> None:
    """Import ``modules`` now, or stop with one line naming the first that cannot be imported and its extra.

    Called before a command does any work, so that a missing package costs milliseconds, not a tokenized corpus.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as exc:  # OSError: an installed package whose shared libraries do not load
            package = _OPTIONAL.get(module.partition(".")[0], (module,))[0]
            # the hint names what is missing, which may be a package the wanted one needs (transformers: tqdm)
            name = getattr(exc, "name", None)
            missing = name if name and name.partition(".")[0] in _OPTIONAL else module
            raise BackendUnavailableError(f"{needed_for} needs {package}, which could not be imported "
                                          f"({_one_line(exc)}); install it with: {_install_hint(missing)}") from exc


def _importable(module: str) -> bool:
    """Whether ``module`` imports (a broken install counts as missing: it would fail later, mid-run)."""
    return _import_error(module) is None


def _import_error(*modules: str) -> BaseException | None:
    """Why the first of ``modules`` that cannot be imported fails, or None when they all import."""
    for module in modules:
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as exc:
            logger.debug("%s cannot be imported (%s)", module, exc)
            return exc
    return None


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
    p.add_argument("--json", action="store_true", help="print the analysis as JSON on stdout")
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
    limit = _optional_positive(args.limit, "--limit")
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
    if plot is not None:
        _require("padfree analyze --plot", "matplotlib")
    if args.lengths_column is None:
        _require("padfree analyze (it tokenizes the text)", "transformers")

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
    raw = corpus.token_lengths(texts, tokenizer, progress=None if _importable("tqdm") else False)
    # a record with no tokens cannot be packed (and would not be trained on): skip it, but say how many
    keep = raw > 0
    if not keep.any():
        raise DataLoadError(f"every one of the {raw.shape[0]} texts ({column_note}) is empty: nothing to analyze")
    return _Lengths(raw[keep], source, f"{column_note}, tokenized by {name}", int((~keep).sum()))


# ---- reading data ------------------------------------------------------------------------------------


def _read_table(data: str) -> Any:
    """``data`` as a ``pyarrow.Table``, or a :class:`DataLoadError` naming the path and the accepted formats."""
    path = _data_path(data)
    _require_readers(data, path)
    with _reading(data):
        if path.is_dir():
            # save_to_disk writes the selected rows themselves (no indices mapping): the backing table is the data
            return _load_saved_dataset(path, data).data.table
        return _read_file(path, data)


def _read_dataset(data: str) -> Any:
    """``data`` as a ``datasets.Dataset``: a saved dataset directory memory-mapped, a file read into memory."""
    path = _data_path(data)
    _require_readers(data, path)
    _require(f"reading {data}", "datasets")
    with _reading(data):
        if path.is_dir():
            return _load_saved_dataset(path, data)
        table = _read_file(path, data)
    import datasets
    from datasets.table import InMemoryTable

    return datasets.Dataset(InMemoryTable(table))


def _data_path(data: str) -> Path:
    path = Path(data).expanduser()
    if not path.exists():
        raise DataLoadError(f"DATA {data!r}: no such file or directory")
    return path


def _require_readers(data: str, path: Path) -> None:
    # pyarrow reads every file; a save_to_disk directory needs datasets
    _require(f"reading {data}", "pyarrow")
    if path.is_dir():
        _require(f"reading the saved dataset {data}", "datasets")


@contextlib.contextmanager
def _reading(data: str) -> Iterator[None]:
    """Turn what pyarrow and datasets raise on an unreadable input into one :class:`DataLoadError`."""
    import pyarrow as pa

    try:
        yield
    except PadfreeError:
        raise
    except (OSError, ValueError, pa.ArrowException) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataLoadError(f"DATA {data!r} could not be read ({type(exc).__name__}: {first})") from exc


def _read_file(path: Path, data: str) -> Any:
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


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "state.json").is_file()


def _load_saved_dataset(path: Path, data: str) -> Any:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataLoadError(
            f"DATA {data!r} is a DatasetDict with splits {splits}; pass one split's directory, e.g. {data}/{splits[0]}"
            if splits else f"DATA {data!r} is an empty DatasetDict"
        )
    if not _is_saved_dataset(path):
        raise DataLoadError(f"DATA {data!r} is a directory but not one written by datasets' save_to_disk; "
                            f"expected {DATA_FORMATS}")
    import datasets

    return datasets.load_from_disk(str(path))


def _describe_columns(table: Any) -> str:
    return ", ".join(f"{name} ({field.type})" for name, field in zip(table.column_names, table.schema, strict=True))


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _texts_from_columns(table: Any, fields: list[str] | None) -> tuple[list[str], str]:
    columns, note = _text_columns(table.schema, fields)
    return _join_text(table, columns).to_pylist(), note


def _text_columns(schema: Any, fields: list[str] | None, *, exclude: str | None = None,
                  instead: str = "pass precomputed lengths with --lengths-column") -> tuple[list[str], str]:
    """The text columns to tokenize, chosen as ``--field`` says, and a note saying which and why.

    ``fields``: the ``--field`` names (each must be a string column), else ``text`` if it is one, else every string
    column. ``exclude``: a column never chosen by default (``padfree pack --completion-field``); with it, finding no
    other text column is no error. ``instead``: what the errors suggest when there is no text to tokenize.
    """
    names = list(schema.names)

    def described() -> str:
        return ", ".join(f"{name} ({field.type})" for name, field in zip(names, schema, strict=True))

    if fields:
        for name in fields:
            if name not in names:
                raise DataLoadError(f"--field {name!r}: no such column; available columns: {described()}")
            if not _is_text(schema.field(name).type):
                raise DataLoadError(
                    f"--field {name!r} has type {schema.field(name).type}, not text; choose string columns "
                    f"({described()}) or {instead}"
                )
        columns = list(fields)
        note = "column " + " + ".join(map(repr, columns))
    elif "text" in names and _is_text(schema.field("text").type) and exclude != "text":
        columns = ["text"]
        note = "column 'text'"
    else:
        columns = [name for name, field in zip(names, schema, strict=True) if _is_text(field.type) and name != exclude]
        if not columns and exclude is None:
            raise DataLoadError(f"no text column to tokenize; available columns: {described()}; {instead}")
        note = ("no 'text' column, so every string column: " + " + ".join(map(repr, columns))
                + " (choose with --field)")
    if len(columns) > 1:
        note += ", joined with newlines"
    return columns, note


def _join_text(table: Any, columns: Sequence[str]) -> Any:
    """``(num_rows,)`` pyarrow strings: the ``columns`` of every row joined with newlines, a missing value as ``""``."""
    import pyarrow.compute as pc

    if len(columns) > 1:
        return pc.binary_join_element_wise(*(table[c] for c in columns), "\n",
                                           null_handling="replace", null_replacement="")
    return pc.fill_null(table[columns[0]], "")


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


# ==================================================================================================
# padfree pack
# ==================================================================================================

PACK_FORMATS = ("arrow", "parquet")
_PACK_PADDINGS = ("capacity", "longest", "none")
_PACK_MASKS = ("binary", "segments", "none")
_INT32_RANGE = (-(2**31), 2**31 - 1)


def _add_pack(subparsers: Any) -> None:
    from padfree.data.hf import COLUMNS, DEFAULT_COLUMNS
    from padfree.packing import DEFAULT_STRATEGY
    from padfree.packing.inputs import OVERLONG_POLICIES

    p = subparsers.add_parser(
        "pack",
        help="pack a dataset into rows of CAPACITY tokens and write them as an Arrow or Parquet dataset",
        description=(
            "Read token ids (or tokenize text), pack every sequence of the dataset into rows of CAPACITY tokens "
            "with one global plan, and write the rows with the columns of padfree.pack_dataset: a "
            "datasets.save_to_disk directory (--format arrow) or one Parquet file. The output is built beside "
            "--output and renamed into place only when complete: an interrupted run leaves nothing at --output. "
            "Without DATA: the embedded corpus (CPython's standard library and pydoc topics), offline."
        ),
    )
    p.add_argument("data", nargs="?", metavar="DATA", help=f"dataset: {DATA_FORMATS}")
    p.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="where to write the packed dataset (a directory for arrow, a file for parquet)")

    g = p.add_argument_group("input")
    g.add_argument("--input-ids-column", metavar="COL",
                   help="pack this column of token-id lists as it is (default: 'input_ids' when DATA has it and "
                        "no --field is given; otherwise text is tokenized)")
    g.add_argument("--labels-column", metavar="COL",
                   help="labels aligned with the token ids, -100 on non-targets (default: 'labels' if present; "
                        "without one, TRL's completion_mask / assistant_masks columns are honoured)")
    g.add_argument("--field", action="append", dest="fields", metavar="F",
                   help="text column to tokenize (repeat for several, joined with newlines); default: 'text' if "
                        "present, else every string column (the Alpaca layout: instruction + input + output)")
    g.add_argument("--completion-field", metavar="F",
                   help="train on this text column only: it is joined last, and every token before it (the "
                        "prompt: the other text columns) gets label -100")
    g.add_argument("--tokenizer", metavar="DIR",
                   help="a tokenizer directory (save_pretrained); default: mistral-common's 32k SentencePiece")
    g.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add its special tokens (e.g. BOS) to every text")
    g.add_argument("--append-eos", action="store_true",
                   help="end every text with the tokenizer's EOS token (a target: the model learns to stop)")
    g.add_argument("--num-proc", type=int, metavar="N",
                   help="tokenize in N processes (datasets.map(batched=True, num_proc=N)); default: 1")
    g.add_argument("--limit", type=int, metavar="N", help="pack only the first N records (or documents)")

    g = p.add_argument_group("packing")
    g.add_argument("--capacity", type=int, default=2048, help="tokens per packed row (default: 2048)")
    g.add_argument("--strategy", default=DEFAULT_STRATEGY, metavar="NAME",
                   help=f"packing strategy: {', '.join(STRATEGIES)} (default: %(default)s)")
    g.add_argument("--overlong", default="error", metavar="POLICY",
                   help=f"sequences longer than CAPACITY: {' | '.join(OVERLONG_POLICIES)} — refuse (default), keep "
                        "the first CAPACITY tokens, cut into pieces of CAPACITY (each a sequence of its own), or "
                        "leave out; what is cut or left out is counted in the summary")
    g.add_argument("--seed", type=int, default=0, help="seed of the 'ffs' shuffle (default: 0)")
    g.add_argument("--max-sequences-per-bin", type=int, metavar="K", help="at most K sequences in a row")

    g = p.add_argument_group("output")
    g.add_argument("--format", metavar="FMT",
                   help="arrow (a datasets.save_to_disk directory: datasets.load_from_disk reads it) or parquet "
                        "(one file); default: parquet when --output ends with .parquet, else arrow")
    g.add_argument("--columns", metavar="LIST",
                   help=f"comma-separated columns to write, each COL or COL=NAME to rename it, from "
                        f"{','.join(COLUMNS)} (default: {','.join(DEFAULT_COLUMNS)}); sequence_ids are rows of DATA")
    g.add_argument("--padding", default="capacity", metavar="HOW",
                   help="row length: capacity (default), longest (the longest row), none (each row as long as "
                        "its tokens) or a number of tokens")
    g.add_argument("--attention-mask", default="binary", metavar="KIND",
                   help="binary (1 real, 0 padding; default), segments (1-based index of the sequence in its "
                        "row, 0 on padding) or none")
    g.add_argument("--padding-value", type=int, default=0, metavar="ID",
                   help="token id written on padding (default: 0)")
    g.add_argument("--label-padding-value", type=int, default=-100, metavar="L",
                   help="label on padding and on the first token of every sequence (default: -100)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output (once the new one is complete)")

    g = p.add_argument_group("report")
    g.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=_run_pack)


@dataclass(frozen=True)
class _PackOptions:
    """The ``padfree pack`` arguments, checked before anything is read."""

    output: Path
    format: str
    capacity: int
    strategy: str
    overlong: str
    seed: int | None
    max_sequences_per_bin: int | None
    padding: str | int | None
    attention_mask: str | None
    columns: dict[str, str] | None
    padding_value: int
    label_padding_value: int
    limit: int | None
    num_proc: int | None


@dataclass
class _PackInput:
    """What ``padfree pack`` packs: a dataset of token ids with at least one token per row, and where it came from."""

    dataset: Any  # datasets.Dataset: input_ids (+ labels, or TRL's mask columns)
    records: int  # records read (after --limit)
    kept: np.ndarray | None  # (sequences,) int64 — the record of every row of `dataset`; None: row i is record i
    source: str
    measure: str

    @property
    def skipped(self) -> int:
        return 0 if self.kept is None else self.records - int(self.kept.shape[0])


def _run_pack(args: argparse.Namespace) -> int:
    """Check the arguments, read (and tokenize) DATA, pack it with ``padfree.pack_dataset``, write atomically, report.

    Intermediate files (the tokenized rows, the packed Arrow file) live in the output's work directory, never
    next to the input: a saved dataset given as DATA is only read.
    """
    import padfree

    started = time.perf_counter()
    opts = _pack_options(args)  # every cheap check first: a typo fails before anything is read or tokenized
    _check_pack_input_args(args)
    _require("padfree pack", "pyarrow", "datasets")
    if args.data is None or (args.input_ids_column is None and _text_flags(args)):
        _require("padfree pack (it tokenizes the text)", "transformers")
    say = _Progress(enabled=not args.quiet)
    with _progress_bars(not args.quiet), _AtomicOutput(opts.output, replace=args.overwrite) as out:
        packing = _pack_input(args, opts, out.cache, say)
        say(f"packing {packing.dataset.num_rows:,} sequences into rows of {opts.capacity:,} tokens ({opts.strategy})")
        packed, result = padfree.pack_dataset(
            packing.dataset, opts.capacity, opts.strategy, opts.seed, opts.padding_value, opts.label_padding_value,
            overlong=opts.overlong, max_sequences_per_bin=opts.max_sequences_per_bin, padding=opts.padding,
            attention_mask=opts.attention_mask, columns=opts.columns,
            cache_file_name=str(out.cache / "packed.arrow"), return_result=True,
        )
        if packing.kept is not None:
            packed = _records_as_sequence_ids(packed, packing.kept, opts.columns)
        say(f"writing {packed.num_rows:,} rows ({opts.format}) to {opts.output}")
        try:
            if opts.format == "arrow":
                packed.save_to_disk(str(out.staged))
            else:
                packed.to_parquet(str(out.staged))
            size = _disk_size(out.staged)
            out.commit()
        except OSError as exc:
            raise InvalidArgumentError(f"--output {str(opts.output)!r} could not be written ({exc})") from exc
    summary = _pack_summary(args, opts, packing, result, packed.column_names, size, time.perf_counter() - started)
    print(json.dumps(summary, indent=2) if args.json else render_pack_summary(summary, packing))
    return 0


def _pack_options(args: argparse.Namespace) -> _PackOptions:
    from padfree.packing.inputs import OVERLONG_POLICIES, as_capacity, as_choice

    padding: str | int | None = args.padding
    if isinstance(padding, str) and padding.strip().isdigit():
        padding = as_positive_int(int(padding), "--padding")
    elif padding not in _PACK_PADDINGS:
        raise InvalidArgumentError(f"--padding must be one of {', '.join(_PACK_PADDINGS)} or a number of tokens, "
                                   f"got {padding!r}")
    mask = as_choice(args.attention_mask, "--attention-mask", _PACK_MASKS)
    columns = _parse_pack_columns(args.columns, mask)
    output = _check_output(args.output, args.format, args.overwrite, args.data)
    for value, name in ((args.padding_value, "--padding-value"), (args.label_padding_value, "--label-padding-value")):
        if not _INT32_RANGE[0] <= value <= _INT32_RANGE[1]:
            raise InvalidArgumentError(f"{name} must fit int32 ({_INT32_RANGE[0]} to {_INT32_RANGE[1]}), got {value}")
    return _PackOptions(
        output=output[0],
        format=output[1],
        capacity=as_capacity(args.capacity, "--capacity"),
        strategy=as_choice(args.strategy, "--strategy", tuple(STRATEGIES)),
        overlong=as_choice(args.overlong, "--overlong", OVERLONG_POLICIES),
        seed=as_seed(args.seed, "--seed"),
        max_sequences_per_bin=_optional_positive(args.max_sequences_per_bin, "--max-sequences-per-bin"),
        padding=None if padding == "none" else padding,
        attention_mask=None if mask == "none" else mask,
        columns=columns,
        padding_value=args.padding_value,
        label_padding_value=args.label_padding_value,
        limit=_optional_positive(args.limit, "--limit"),
        num_proc=_optional_positive(args.num_proc, "--num-proc"),
    )


def _optional_positive(value: int | None, flag: str) -> int | None:
    # an option left out is None; one given must be >= 1 (the message need not mention None: it cannot be typed)
    return None if value is None else as_positive_int(value, flag)


def _parse_pack_columns(text: str | None, mask: str) -> dict[str, str] | None:
    from padfree.data.hf import COLUMNS, DEFAULT_COLUMNS

    if text is None:
        return None
    columns: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        what, _, name = (s.strip() for s in item.partition("="))
        if what not in COLUMNS:
            raise InvalidArgumentError(f"--columns {text!r}: unknown column {what!r}; choose from {','.join(COLUMNS)}")
        if what in columns or (name or what) in columns.values():
            raise InvalidArgumentError(f"--columns {text!r} names {what!r} (or the output name {name or what!r}) twice")
        columns[what] = name or what
    if not columns:
        raise InvalidArgumentError(f"--columns {text!r} names no column; choose from {','.join(COLUMNS)} "
                                   f"(default: {','.join(DEFAULT_COLUMNS)})")
    if mask == "none" and "attention_mask" in columns:
        raise InvalidArgumentError("--columns asks for attention_mask but --attention-mask is none; "
                                   "choose binary or segments, or leave the column out")
    return columns


def _check_output(output: str, fmt: str | None, overwrite: bool, data: str | None) -> tuple[Path, str]:
    """``--output`` as a path and the format to write; refuse what would lose data the user did not ask to lose."""
    path = Path(output).expanduser()
    if fmt is None:
        fmt = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
    elif fmt not in PACK_FORMATS:
        raise InvalidArgumentError(f"--format must be one of {', '.join(PACK_FORMATS)}, got {fmt!r}")
    if not path.name or path.name in (".", ".."):
        raise InvalidArgumentError(f"--output {output!r} names no file or directory; give a path such as packed/")
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"--output {output!r}: the directory {str(path.parent)!r} does not exist")
    if data is not None:
        source = Path(data).expanduser().resolve()
        target = path.resolve()
        if target == source or target in source.parents:
            raise InvalidArgumentError(f"--output {output!r} is (or contains) DATA {data!r}; write the packed "
                                       "dataset somewhere else")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise InvalidArgumentError(f"--output {output!r} already exists; pass --overwrite to replace it (the "
                                       "old one is replaced only once the new one is complete)")
        if path.is_dir() and not path.is_symlink() and any(path.iterdir()) and not (
                _is_saved_dataset(path) or (path / "dataset_dict.json").is_file()):
            raise InvalidArgumentError(f"--output {output!r} is a directory that datasets' save_to_disk did not "
                                       "write; refusing to replace it even with --overwrite: choose another path")
    return path, fmt


def _check_pack_input_args(args: argparse.Namespace) -> None:
    if args.data is None:
        for flag, value in (("--field", args.fields), ("--completion-field", args.completion_field),
                            ("--input-ids-column", args.input_ids_column), ("--labels-column", args.labels_column)):
            if value:
                raise InvalidArgumentError(f"{flag} needs DATA: the embedded corpus has no columns")
    if args.input_ids_column is not None:
        text_flags = _text_flags(args)
        if text_flags:
            raise InvalidArgumentError(f"--input-ids-column and {text_flags[0]} exclude each other: token ids are "
                                       "either read from a column or made by tokenizing text")


def _text_flags(args: argparse.Namespace) -> list[str]:
    """The tokenizing options that were given (they make no sense when token ids are read from a column)."""
    flags = [("--field", args.fields), ("--completion-field", args.completion_field),
             ("--tokenizer", args.tokenizer), ("--add-special-tokens", args.add_special_tokens),
             ("--append-eos", args.append_eos), ("--num-proc", args.num_proc)]
    return [flag for flag, value in flags if value]


def _pack_input(args: argparse.Namespace, opts: _PackOptions, cache: Path, say: _Progress) -> _PackInput:
    """Read DATA (or the embedded corpus) and make the dataset of token ids to pack, tokenizing text if needed."""
    import datasets

    from padfree import corpus

    limit = opts.limit
    if args.data is None:
        texts = corpus.embedded_corpus()[:limit]
        source = f"embedded corpus: {corpus.embedded_corpus_description()}"
        if limit is not None:
            source += f", first {len(texts)} documents"
        ds = datasets.Dataset.from_dict({"text": texts})
    else:
        say(f"reading {args.data}")
        ds = _read_dataset(args.data)
        total = ds.num_rows
        if total == 0:
            raise DataLoadError(f"DATA {args.data!r} holds no records")
        if limit is not None and limit < total:
            ds = ds.select(range(limit))
        source = f"{args.data} ({ds.num_rows:,} records" + (f", --limit {limit})" if limit is not None else ")")

    schema = ds.data.schema
    ids_column = args.input_ids_column
    if ids_column is None and not args.fields and not args.completion_field and "input_ids" in schema.names:
        ids_column = "input_ids"
    if ids_column is not None:
        if args.input_ids_column is None and _text_flags(args):
            raise InvalidArgumentError(
                f"DATA has token ids in column 'input_ids', so nothing is tokenized and {_text_flags(args)[0]} does "
                "not apply; pass --field to tokenize a text column instead"
            )
        tokens, measure = _token_ids_from_column(ds, ids_column, args.labels_column)
    else:
        if args.labels_column is not None:
            raise InvalidArgumentError("--labels-column needs token ids (--input-ids-column); labels of tokenized "
                                       "text come from --completion-field")
        tokens, measure = _tokenize(ds, args, opts, cache, say)
    tokens, kept = _drop_empty(tokens)
    if kept is not None and kept.shape[0] == 0:
        raise DataLoadError(f"every one of the {ds.num_rows:,} records has no tokens ({measure}): nothing to pack")
    return _PackInput(tokens, ds.num_rows, kept, source, measure)


def _is_token_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    return (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and pa.types.is_integer(
        arrow_type.value_type)


def _token_ids_from_column(ds: Any, ids_column: str, labels_column: str | None) -> tuple[Any, str]:
    from padfree.data.hf import LABEL_MASK_COLUMNS

    schema = ds.data.schema
    for flag, name in (("--input-ids-column", ids_column), ("--labels-column", labels_column)):
        if name is None:
            continue
        if name not in schema.names:
            raise DataLoadError(f"{flag} {name!r}: no such column; available columns: {_describe_columns(ds.data)}")
        if not _is_token_list(schema.field(name).type):
            raise DataLoadError(f"{flag} {name!r} has type {schema.field(name).type}, not lists of integer token ids")
    if labels_column is None and "labels" in schema.names and ids_column != "labels":
        if not _is_token_list(schema.field("labels").type):
            raise DataLoadError(f"column 'labels' has type {schema.field('labels').type}, not lists of integers; "
                                "name the labels with --labels-column")
        labels_column = "labels"
    if labels_column == ids_column:
        raise InvalidArgumentError(f"--input-ids-column and --labels-column name the same column {ids_column!r}")
    keep = {ids_column: "input_ids"}
    measure = f"token ids from column {ids_column!r}"
    if labels_column is not None:
        keep[labels_column] = "labels"
        measure += f", labels from column {labels_column!r}"
    else:
        masks = [m for m in LABEL_MASK_COLUMNS if m in schema.names]
        keep.update({m: m for m in masks})
        if masks:
            measure += ", targets where " + " and ".join(map(repr, masks)) + " are nonzero"
    ds = ds.select_columns(list(keep)).rename_columns({k: v for k, v in keep.items() if k != v})
    return ds, measure


def _tokenize(ds: Any, args: argparse.Namespace, opts: _PackOptions, cache: Path, say: _Progress) -> tuple[Any, str]:
    import functools
    import uuid

    from padfree import corpus

    schema = ds.data.schema
    completion = args.completion_field
    if completion is not None:
        if completion not in schema.names:
            raise DataLoadError(f"--completion-field {completion!r}: no such column; available columns: "
                                f"{_describe_columns(ds.data)}")
        if not _is_text(schema.field(completion).type):
            raise DataLoadError(f"--completion-field {completion!r} has type {schema.field(completion).type}, "
                                "not text")
    instead = "or pass token ids with --input-ids-column"
    if args.fields and completion is not None:
        # --field names the prompt's columns; naming the completion among them too is natural and harmless
        fields = [f for f in args.fields if f != completion]
        prompt = _text_columns(schema, fields, instead=instead)[0] if fields else []
    else:
        prompt, note = _text_columns(schema, args.fields, exclude=completion, instead=instead)
    if completion is not None:
        note = (f"prompt {' + '.join(map(repr, prompt))}, then completion {completion!r} (the only targets), "
                "joined with newlines" if prompt else f"column {completion!r}, every token a target")
    _require("padfree pack (it tokenizes the text)", "transformers")
    tokenizer = corpus.load_tokenizer(args.tokenizer)
    name = corpus.DEFAULT_TOKENIZER_NAME if args.tokenizer is None else f"{args.tokenizer} ({type(tokenizer).__name__})"
    if completion is not None and not getattr(tokenizer, "is_fast", False):
        raise TokenizerLoadError(f"--completion-field needs a fast tokenizer (it finds the prompt's tokens through "
                                 f"their character offsets); {name} is not one")
    eos = None
    if args.append_eos:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise TokenizerLoadError(f"--append-eos: the tokenizer {name} has no EOS token")
    num_proc = min(opts.num_proc or 1, ds.num_rows)
    say(f"tokenizing {ds.num_rows:,} records with {name}" + (f" in {num_proc} processes" if num_proc > 1 else ""))
    function = functools.partial(_tokenize_batch, tokenizer=tokenizer, prompt=prompt, completion=completion,
                                 add_special_tokens=args.add_special_tokens, eos=eos)
    tokens = ds.with_format("arrow").map(
        function, batched=True, batch_size=1000, num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names, cache_file_name=str(cache / "tokenized.arrow"), load_from_cache_file=False,
        new_fingerprint=uuid.uuid4().hex, desc="tokenizing",
    ).with_format(None)
    extras = [flag for flag, on in (("special tokens", args.add_special_tokens), ("EOS appended", eos is not None))
              if on]
    return tokens, f"{note}, tokenized by {name}" + (f" ({', '.join(extras)})" if extras else "")


def _tokenize_batch(batch: Any, *, tokenizer: Any, prompt: list[str], completion: str | None,
                    add_special_tokens: bool, eos: int | None) -> Any:
    """One ``datasets.map`` batch (a ``pyarrow.Table``) -> ``input_ids`` (and ``labels`` with a completion)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from padfree import corpus

    boundary = None  # (rows,) — the character where the completion starts; tokens before it are not targets
    if completion is None:
        texts = _join_text(batch, prompt)
    else:
        answer = pc.fill_null(batch[completion], "")
        if prompt:
            question = _join_text(batch, prompt)
            texts = pc.binary_join_element_wise(question, answer, "\n")
            boundary = pc.utf8_length(question).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        else:
            texts = answer
            boundary = np.zeros(batch.num_rows, np.int64)
    encoded = corpus.encode(texts.to_pylist(), tokenizer, add_special_tokens=add_special_tokens,
                            offsets=boundary is not None)
    ids = encoded["input_ids"]
    if eos is not None:
        for row in ids:
            row.append(eos)
    ids_array = pa.array(ids, pa.list_(pa.int32()))
    if boundary is None:
        return pa.table({"input_ids": ids_array})
    spans = encoded["offset_mapping"]
    if eos is not None:  # the EOS sits after the text: a target
        ends = pc.utf8_length(texts).to_pylist()
        for row, end in zip(spans, ends, strict=True):
            row.append((end, end))
    starts = pa.array(spans, pa.list_(pa.list_(pa.int64(), 2))).flatten().flatten().to_numpy()[::2]
    counts = pc.list_value_length(ids_array).to_numpy(zero_copy_only=False)
    targets = starts >= np.repeat(boundary, counts)
    labels = np.where(targets, ids_array.values.to_numpy(), -100).astype(np.int32)
    return pa.table({"input_ids": ids_array, "labels": pa.ListArray.from_arrays(ids_array.offsets, labels)})


def _drop_empty(ds: Any) -> tuple[Any, np.ndarray | None]:
    """``ds`` without its rows of no tokens (nothing to pack or train on), and the rows kept (None: all)."""
    import pyarrow.compute as pc

    lengths = pc.fill_null(pc.list_value_length(ds.with_format("arrow")["input_ids"]), 0)
    keep = lengths.to_numpy() > 0
    if keep.all():
        return ds, None
    kept = np.flatnonzero(keep)
    return ds.select(kept), kept


def _records_as_sequence_ids(packed: Any, kept: np.ndarray, columns: dict[str, str] | None) -> Any:
    """Make the ``sequence_ids`` column name records of DATA again after :func:`_drop_empty` left some out."""
    if not columns or "sequence_ids" not in columns:
        return packed
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    name = columns["sequence_ids"]
    table = packed.data.table
    chunks = []
    for chunk in table[name].chunks:
        offsets = chunk.offsets.to_numpy()
        # flatten() honours a sliced chunk, offsets do not: rebase them to the values flatten() returns
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int32()),
                                               pa.array(kept[chunk.flatten().to_numpy()])))
    table = table.set_column(table.schema.get_field_index(name), name, pa.chunked_array(chunks, pa.list_(pa.int64())))
    return datasets.Dataset(InMemoryTable(table))


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class _Progress:
    """Progress lines on stderr (``padfree: <what is happening>``); ``datasets`` draws its bars beside them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"padfree: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """``datasets``' progress bars (tqdm) on or off for the block, then as they were."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    (ds_logging.enable_progress_bar if enabled else ds_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (ds_logging.enable_progress_bar if was else ds_logging.disable_progress_bar)()


class _AtomicOutput:
    """Build an output in a hidden work directory beside it; rename it into place only once it is complete.

    ``staged`` is where the output is written, ``cache`` where intermediate files go (tokenized rows, the packed
    Arrow file). :meth:`commit` renames ``staged`` to the output path — one ``rename`` on the same filesystem, so
    the path holds either nothing, the old output, or the complete new one. Leaving the block deletes the work
    directory, whatever happened; only a killed process leaves it behind (``.<name>.padfree-*``, never at the
    output path itself).
    """

    def __init__(self, path: Path, *, replace: bool) -> None:
        self.path = path
        self.replace = replace

    def __enter__(self) -> _AtomicOutput:
        try:
            self.work = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.padfree-", dir=self.path.parent))
        except OSError as exc:
            raise InvalidArgumentError(f"--output {str(self.path)!r} cannot be written ({exc})") from exc
        self.cache = self.work / "cache"
        self.cache.mkdir()
        self.staged = self.work / "output"
        return self

    def commit(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not self.replace:  # it appeared while we were packing
                raise InvalidArgumentError(f"--output {str(self.path)!r} already exists; pass --overwrite to "
                                           "replace it")
            # move the old output into the work directory (deleted on exit) with one rename, then the new one in
            old = self.work / "replaced"
            os.replace(self.path, old)
            try:
                os.replace(self.staged, self.path)
            except OSError:
                os.replace(old, self.path)
                raise
        else:
            os.replace(self.staged, self.path)

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _pack_summary(args: argparse.Namespace, opts: _PackOptions, packing: _PackInput, result: Any,
                  columns: list[str], size: int, seconds: float) -> dict[str, Any]:
    if opts.padding is None:
        slots = result.total_tokens  # every row as long as its tokens
    elif opts.padding == "capacity":
        slots = result.num_bins * result.capacity
    elif opts.padding == "longest":
        slots = result.num_bins * int(result.bin_fill.max(initial=0))
    else:
        slots = result.num_bins * int(opts.padding)
    split = int((result.lengths > result.capacity).sum()) if opts.overlong == "split" else 0
    return {
        "data": args.data,
        "output": str(opts.output),
        "format": opts.format,
        "records": packing.records,
        "skipped_empty": packing.skipped,
        "sequences": result.num_sequences,
        "input_tokens": result.input_tokens,
        "packed_tokens": result.total_tokens,
        "capacity": result.capacity,
        "strategy": result.strategy,
        "seed": result.seed,
        "overlong": opts.overlong,
        "bins": result.num_bins,
        "lower_bound": result.lower_bound,
        "efficiency": result.efficiency,
        "padding_tokens": slots - result.total_tokens,
        "pieces": result.num_pieces,
        "split_sequences": split,
        "truncated_sequences": result.num_truncated,
        "truncated_tokens": result.truncated_tokens,
        "dropped_sequences": result.num_dropped,
        "dropped_tokens": result.dropped_tokens,
        "columns": columns,
        "bytes": size,
        "seconds": round(seconds, 3),
    }


def render_pack_summary(summary: dict[str, Any], packing: _PackInput) -> str:
    """The ``padfree pack`` report (``summary`` is what ``--json`` prints)."""
    s = summary
    out = ["padfree pack"]
    out += textwrap.wrap(packing.source, width=110, initial_indent="  data        ", subsequent_indent=" " * 14)
    out += textwrap.wrap(packing.measure, width=110, initial_indent="  sequences   ", subsequent_indent=" " * 14)
    if s["skipped_empty"]:
        out.append(f"  skipped     {_n(s['skipped_empty'])} records with no tokens (nothing to pack)")
    out += [
        "",
        f"  packed      {_n(s['sequences'])} sequences, {_n(s['input_tokens'])} tokens -> {_n(s['bins'])} rows of "
        f"{_n(s['capacity'])} tokens (strategy {s['strategy']}; lower bound {_n(s['lower_bound'])} rows)",
        f"  efficiency  {s['efficiency']:.2%} ({_n(s['padding_tokens'])} padding tokens written)",
    ]
    cap = _n(s["capacity"])
    if s["truncated_sequences"]:
        over = (f"{_n(s['truncated_sequences'])} sequences longer than {cap} truncated: "
                f"{_n(s['truncated_tokens'])} tokens lost")
    elif s["dropped_sequences"]:
        over = (f"{_n(s['dropped_sequences'])} sequences longer than {cap} dropped: {_n(s['dropped_tokens'])} "
                "tokens lost")
    elif s["split_sequences"]:
        over = (f"{_n(s['split_sequences'])} sequences longer than {cap} split: {_n(s['pieces'])} pieces in all, "
                "no token lost")
    else:
        over = f"none: every sequence fits in {cap} tokens, no token lost"
    out.append(f"  overlong    {over} (--overlong {s['overlong']})")
    what = ("a datasets.save_to_disk directory (datasets.load_from_disk)" if s["format"] == "arrow"
            else "one Parquet file")
    out += textwrap.wrap(f"{s['output']}: {what}, {_n(s['bins'])} rows, {_size(s['bytes'])}; columns "
                         f"{', '.join(s['columns'])}", width=110, initial_indent="  written     ",
                         subsequent_indent=" " * 14)
    out.append(f"  time        {s['seconds']:.1f} s")
    return "\n".join(out)


def _size(num_bytes: int) -> str:
    if num_bytes < 1000:
        return f"{num_bytes} B"
    exponent = min(int(np.log10(num_bytes)) // 3, 3)
    return f"{num_bytes / 1000 ** exponent:,.1f} {('kB', 'MB', 'GB')[exponent - 1]}"


# ==================================================================================================
# padfree demo / padfree bench: train the same real tokens several ways (padfree.throughput)
# ==================================================================================================

#: The demo's model when no ``--model`` is given: a small Llama with random weights (vocab = the tokenizer's).
DEMO_MODEL = {"full": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2),
              "quick": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2)}
#: (capacity, rows, tokens, repetitions) of a full and a --quick run.
_TRAINING_DEFAULTS = {"demo": {"full": (1024, 8, 16384, 3), "quick": (256, 4, 1536, 1)},
                      "bench": {"full": (512, 8, 8192, 3), "quick": (256, 4, 1536, 1)}}
DEMO_PNG = "padfree-demo.png"


def _add_training_args(p: Any, command: str) -> None:
    full, quick = _TRAINING_DEFAULTS[command]["full"], _TRAINING_DEFAULTS[command]["quick"]
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="FILE",
                   help=f"train on this dataset instead of the embedded corpus: {DATA_FORMATS}")
    g.add_argument("--field", action="append", dest="fields", metavar="F",
                   help="text column of --data (repeat for several, joined with newlines); default: 'text' if "
                        "present, else every string column")
    g.add_argument("--tokenizer", metavar="DIR",
                   help="a tokenizer directory (save_pretrained); default: mistral-common's 32k SentencePiece")
    g.add_argument("--limit", type=int, metavar="N", help="use only the first N records (or documents)")
    g = p.add_argument_group("training")
    g.add_argument("--model", metavar="DIR",
                   help="a local causal-LM checkpoint (save_pretrained); default: a small Llama from a config with "
                        "random weights")
    g.add_argument("--capacity", type=int, help=f"tokens per packed row, the longest padded row (default: {full[0]}; "
                                                 f"--quick: {quick[0]})")
    g.add_argument("--rows", type=int, help=f"batch size: sequences per padded batch, rows per packed step "
                                             f"(default: {full[1]}; --quick: {quick[1]})")
    g.add_argument("--tokens", type=int, help=f"real tokens every mode trains per pass (default: {full[2]:,}; "
                                               f"--quick: {quick[2]:,})")
    g.add_argument("--repetitions", type=int,
                   help=f"timed passes per mode, interleaved; the median is reported (default: {full[3]}; "
                        f"--quick: {quick[3]})")
    g.add_argument("--seed", type=int, default=0, help="seed of the sample, the orders and the weights (default: 0)")
    g.add_argument("--threads", type=int, help="torch threads for every mode (default: torch's own choice)")
    p.add_argument("--quick", action="store_true", help="a small run: a slice of the corpus, a tiny model, few tokens")


@dataclass(frozen=True)
class _TrainingOptions:
    capacity: int
    rows: int
    tokens: int
    repetitions: int
    seed: int
    threads: int | None
    limit: int | None
    quick: bool


def _training_options(args: argparse.Namespace, command: str) -> _TrainingOptions:
    """The ``demo`` / ``bench`` training arguments checked (every cheap check first) with their defaults filled."""
    defaults = _TRAINING_DEFAULTS[command]["quick" if args.quick else "full"]
    values = []
    for flag, value, default in zip(("--capacity", "--rows", "--tokens", "--repetitions"),
                                    (args.capacity, args.rows, args.tokens, args.repetitions), defaults, strict=True):
        values.append(default if value is None else as_positive_int(value, flag))
    if args.data is None and args.fields:
        raise InvalidArgumentError("--field needs --data: the embedded corpus has no columns")
    if args.model is not None and not Path(args.model).expanduser().is_dir():
        raise InvalidArgumentError(f"--model {args.model!r} is not a directory; expected a checkpoint written by "
                                   "save_pretrained (config.json and the weights)")
    return _TrainingOptions(*values, seed=as_seed(args.seed, "--seed"),
                            threads=_optional_positive(args.threads, "--threads"),
                            limit=_optional_positive(args.limit, "--limit"), quick=args.quick)


def _bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm progress bar on stderr (drawn only on a terminal); without tqdm, one that draws nothing."""
    if not _importable("tqdm"):
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=None, leave=False, file=sys.stderr)


class _NoBar:
    """What :func:`_bar` returns without tqdm: the calls the commands make, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _note(message: str) -> None:
    """One line on stderr about something a run left out (shown even with ``-q``: it is not progress)."""
    print(f"padfree: note: {message}", file=sys.stderr, flush=True)


def _texts(args: argparse.Namespace, opts: _TrainingOptions) -> tuple[list[str], str]:
    from padfree import corpus

    if args.data is None:
        texts = _top_level_blocks(corpus.embedded_corpus())
        source = (f"embedded corpus: {corpus.embedded_corpus_description()}, one sample per top-level block "
                  f"(split at two blank lines, PEP 8's separation of top-level definitions): {len(texts):,}")
        if opts.quick:  # every 8th document: the same kinds of text, an eighth of the tokenizing
            texts = texts[::8]
            source += f", every 8th document (--quick): {len(texts)}"
        if opts.limit is not None:
            texts = texts[:opts.limit]
            source += f", first {len(texts)} documents"
        return texts, source
    table = _read_table(args.data)
    if table.num_rows == 0:
        raise DataLoadError(f"--data {args.data!r} holds no records")
    if opts.limit is not None:
        table = table.slice(0, opts.limit)
    texts, note = _texts_from_columns(table, args.fields)
    return texts, f"{args.data} ({table.num_rows:,} records; {note})"


def _top_level_blocks(documents: list[str]) -> list[str]:
    """Every document cut at two blank lines in a row — in Python sources, the gaps PEP 8 puts between top-level
    functions and classes — so that a sample is one function, class or block of statements (a long-tailed mix,
    like fine-tuning data) rather than a whole module. Blank-only pieces are dropped."""
    import re

    gap = re.compile(r"\n\n\n+")
    return [block for doc in documents for block in gap.split(doc) if block.strip()]


def _token_ids(texts: list[str], tokenizer: Any, batch_size: int = 64) -> list[list[int]]:
    from padfree import corpus

    ids: list[list[int]] = []
    bar = _bar(len(texts), "tokenizing", "doc")
    try:
        for start in range(0, len(texts), batch_size):
            batch = [str(t) for t in texts[start:start + batch_size]]
            ids.extend(corpus.encode(batch, tokenizer)["input_ids"])
            bar.update(len(batch))
    finally:
        bar.close()
    return ids


@dataclass
class _Prepared:
    """What ``demo`` and ``bench`` train on: the token ids, where they came from, the tokenizer's vocabulary."""

    ids: Any  # TokenBuffers of the non-empty sequences
    lengths: np.ndarray
    source: str
    tokenizer_name: str
    vocab: int
    skipped: int


def _prepare(args: argparse.Namespace, opts: _TrainingOptions, say: _Progress) -> _Prepared:
    from padfree import corpus
    from padfree.rows import as_token_buffers

    texts, source = _texts(args, opts)  # a bad --data or --field fails here, before the tokenizer loads
    say("loading the tokenizer")
    tokenizer = corpus.load_tokenizer(args.tokenizer)
    name = corpus.DEFAULT_TOKENIZER_NAME if args.tokenizer is None else f"{args.tokenizer} ({type(tokenizer).__name__})"
    say(f"tokenizing {len(texts):,} texts")
    ids = [x for x in _token_ids(texts, tokenizer) if x]
    if not ids:
        raise DataLoadError(f"every one of the {len(texts):,} texts is empty: nothing to train on")
    buf = as_token_buffers(ids)
    return _Prepared(buf, buf.lengths, source, name, len(tokenizer), len(texts) - len(ids))


def _model(args: argparse.Namespace, opts: _TrainingOptions, vocab: int, ids: Any) -> tuple[Any, str]:
    """The model every mode trains (from the same initial weights), and a line describing it."""
    import torch
    import transformers

    torch.manual_seed(opts.seed)
    if args.model is None:
        sizes = DEMO_MODEL["quick" if opts.quick else "full"]
        config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=opts.capacity, **sizes)
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config)
        where = "a Llama from a config, random weights"
    else:
        bars = transformers.utils.logging.is_progress_bar_enabled()
        if getattr(args, "quiet", False):
            transformers.utils.logging.disable_progress_bar()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                                       attn_implementation="sdpa")
        except Exception as exc:  # transformers raises many types for an unreadable checkpoint
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InvalidArgumentError(f"--model {args.model!r} could not be loaded ({type(exc).__name__}: "
                                       f"{first}); expected a causal-LM checkpoint written by save_pretrained") from exc
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        where = f"{args.model}"
        top = int(ids.values.max())
        size = model.get_input_embeddings().num_embeddings
        if top >= size:
            raise InvalidArgumentError(f"--model {args.model!r} has {size:,} embeddings but the tokenizer produced "
                                       f"token id {top:,}; pass the model's own tokenizer with --tokenizer")
    model.float()
    c = model.config
    params = sum(p.numel() for p in model.parameters()) / 1e6
    layers = f"{c.num_hidden_layers} layer{'s' if c.num_hidden_layers != 1 else ''}"
    text = (f"{type(model).__name__} ({where}): {params:.1f}M parameters, hidden {c.hidden_size}, {layers}, "
            f"vocab {model.get_input_embeddings().num_embeddings:,}, fp32, CPU")
    return model, text


def _train(model: Any, sample: Any, opts: _TrainingOptions, modes: Sequence[str], say: _Progress,
           fused: Sequence[str] = ()) -> tuple[Any, Any]:
    """Build the plans, verify, warm up and time every mode, and the ``fused`` ones again with padfree's fused loss
    (a tqdm bar over all the tokens trained)."""
    import torch

    from padfree.throughput import build_plans, compare_training

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    plans = build_plans(sample, opts.capacity, opts.rows, modes, seed=opts.seed)
    per_pass = sum(p.real_tokens * (1 + (m in fused)) for m, p in plans.items())
    warm = sum(p.steps[0].real_tokens * (1 + (m in fused)) for m, p in plans.items())
    names = [*plans, *(f"{m}+fused" for m in fused)]
    say(f"training {', '.join(names)}: {opts.repetitions} timed pass(es) each over the same "
        f"{plans['packed'].real_tokens:,} real tokens (checking exactness first)")
    bar = _bar(per_pass * opts.repetitions + warm, "training", "tok")
    try:
        report = compare_training(model, None, capacity=opts.capacity, rows=opts.rows, plans=plans,
                                  repetitions=opts.repetitions, seed=opts.seed, fused=fused,
                                  progress=lambda mode, rep, n: (bar.set_postfix_str(mode, refresh=False),
                                                                 bar.update(n)))
    finally:
        bar.close()
    return report, plans


def _check_output_dir(output: str) -> Path:
    path = Path(output).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidArgumentError(f"--output {output!r} is a file; give a directory for {DEMO_PNG}")
    if not path.exists() and not path.parent.is_dir():
        raise InvalidArgumentError(f"--output {output!r}: the directory {str(path.parent)!r} does not exist")
    return path


def _add_demo(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="tokenize, analyze and pack a real corpus, verify a model, and train it padded vs packed",
        description=(
            "The whole story on your machine, offline: tokenize a real corpus (the embedded one: CPython's standard "
            "library and pydoc topics; or --data), analyze its lengths, pack it, build a small Llama (or load "
            "--model), prove with verify() that a packed step equals the per-sequence steps, then train the same "
            "real tokens four ways — random padded batches, length-grouped padded batches, padfree packed rows, and "
            "packed rows with padfree's fused loss — and report real tokens/s, the speedups and the losses; writes "
            f"{DEMO_PNG} (lengths, row fill, throughput) to --output. Needs torch and transformers; without "
            "matplotlib everything runs and only the picture is left out (one line says so)."
        ),
    )
    _add_training_args(p, "demo")
    p.add_argument("-o", "--output", default=".", metavar="DIR",
                   help=f"directory for {DEMO_PNG} (created if missing; default: the current directory)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from padfree.analysis import analyze_lengths
    from padfree.throughput import sample_sequences

    started = time.perf_counter()
    opts = _training_options(args, "demo")
    output = _check_output_dir(args.output)
    _require("padfree demo", "torch", "transformers")
    # the picture only illustrates the numbers: without matplotlib the demo runs and says what it left out
    draw = _importable("matplotlib")
    say = _Progress(enabled=not args.quiet)
    data = _prepare(args, opts, say)
    say(f"analyzing {data.lengths.shape[0]:,} lengths and packing them into rows of {opts.capacity:,}")
    analysis = analyze_lengths(data.lengths, opts.capacity, batch_size=opts.rows, strategies=["obfd"], seed=opts.seed)
    plan = _pack_all(data.lengths, opts.capacity)
    model, model_text = _model(args, opts, data.vocab, data.ids)
    sample = sample_sequences(data.ids, opts.tokens, opts.capacity, seed=opts.seed)
    report, plans = _train(model, sample, opts, ("padded", "grouped", "packed"), say, fused=("packed",))
    png = output / DEMO_PNG if draw else None
    if png is not None:
        output.mkdir(exist_ok=True)
        _write_demo_plot(png, data, analysis, plan, plans, report)
    summary = {"data": data.source, "tokenizer": data.tokenizer_name, "model": model_text,
               "sequences": int(data.lengths.shape[0]), "tokens": int(data.lengths.sum()),
               "packing": {"capacity": opts.capacity, "rows": plan.num_bins, "efficiency": plan.efficiency,
                           "padded_waste": analysis.padded.waste_longest},
               "training": report.as_dict(), "png": None if png is None else str(png),
               "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(summary, indent=2) if args.json else render_demo(summary, data, analysis, plan, report))
    if png is None:
        _note(f"{DEMO_PNG} was not drawn: matplotlib cannot be imported; {_install_hint('matplotlib')} draws it")
    return 0


def _pack_all(lengths: np.ndarray, capacity: int) -> Any:
    from padfree.packing import pack_sequences

    return pack_sequences(lengths, capacity, overlong="truncate")


def render_demo(summary: dict[str, Any], data: _Prepared, analysis: Any, plan: Any, report: Any) -> str:
    """The ``padfree demo`` report."""
    s = analysis.stats
    out = ["padfree demo"]
    out += textwrap.wrap(data.source, width=110, initial_indent="  data       ", subsequent_indent=" " * 13)
    out += [f"  tokenizer  {data.tokenizer_name}",
            f"  lengths    {_n(s.count)} sequences, {_n(s.total_tokens)} tokens; median {_n(round(s.median))}, "
            f"p99 {_n(round(s.p99))}, max {_n(s.max)}" + (f"; {data.skipped} empty texts skipped" if data.skipped
                                                           else ""),
            f"  padding    random batches of {analysis.batch_size} padded to the longest: "
            f"{analysis.padded.waste_longest:.1%} of the positions are padding"
            + (f" ({_n(analysis.overlong)} sequences longer than {_n(plan.capacity)} truncated)" if analysis.overlong
               else ""),
            f"  packed     {_n(plan.num_bins)} rows of {_n(plan.capacity)} (lower bound {_n(plan.lower_bound)}): "
            f"{plan.efficiency:.2%} of the positions are real tokens",
            f"  model      {summary['model']}"]
    ex = report.exactness
    out += ["", "Exactness: verify() — the packed row holding the most sequences against each of them alone, same "
                "weights"]
    out += (["  " + line for line in str(ex).splitlines()[-2:]] if ex is not None
            else ["  no packed row holds two sequences: no boundary to check"])
    r = report.results
    out += ["", f"Training the same {_n(r['packed'].real_tokens)} real tokens {len(r)} ways ({report.repetitions} "
                f"timed pass(es) each, interleaved; AdamW, fresh from the same weights every pass)"]
    rows = [[m, _n(x.steps), _n(x.positions), f"{x.efficiency:.1%}", f"{x.median_seconds:.2f}",
             _n(round(x.tokens_per_second)), f"{report.speedup('packed', m):.2f}x", f"{x.final_loss():.3f}"]
            for m, x in r.items()]
    out += _table(["mode", "steps", "positions", "filled", "seconds", "real tokens/s", "packed is", "final loss"],
                  rows, "lrrrrrrr")
    out += ["", f"Packed trains {report.speedup('packed', 'padded'):.2f}x the real tokens per second of random "
                f"padded batches and {report.speedup('packed', 'grouped'):.2f}x those of length-grouped ones."]
    if "packed+fused" in r:
        out += textwrap.wrap(
            f"With padfree's fused loss as well (padfree_fused_loss=True / padfree.causal_lm_loss: the LM head and "
            f"the cross-entropy fused, over target positions only, no logits tensor), packed trains "
            f"{report.speedup('packed+fused', 'padded'):.2f}x random padded batches and "
            f"{report.speedup('packed+fused', 'grouped'):.2f}x length-grouped ones; the fused loss alone gives packed "
            f"{report.speedup('packed+fused', 'packed'):.2f}x. It would speed up padded batches too (their padding "
            "never reaches the head): BENCHMARKS.md measures it apart.", width=110)
    out += textwrap.wrap(
        "Loss agreement: a packed step is exact (verify() above: the same logits, loss and gradients as the "
        "sequences run alone). Over the pass the modes form different optimizer steps (different sequences per "
        "step, different step counts), so their curves are not identical; 'final loss' is the token-weighted "
        "mean loss over the last quarter of the tokens, for comparing where each mode got to.",
        width=110, initial_indent="  ", subsequent_indent="  ")
    done = (f"plot written to {summary['png']}" if summary["png"] is not None
            else f"no plot ({DEMO_PNG} needs matplotlib)")
    out += ["", f"{done} ({summary['seconds']:.0f} s in all)"]
    return "\n".join(out)


def _write_demo_plot(path: Path, data: _Prepared, analysis: Any, plan: Any, plans: dict[str, Any],
                     report: Any) -> None:
    """Three panels: the lengths (log histogram, capacity marked), how full rows and batches are, the throughput."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    lengths = data.lengths
    lo, hi = max(1, int(lengths.min())), max(2, int(lengths.max()))
    edges = np.unique(np.geomspace(lo, hi + 1, num=int(np.clip(25 * np.log10((hi + 1) / lo), 15, 60)) + 1)
                      .astype(np.int64))
    ax1.hist(lengths, bins=edges, color="#4c72b0", edgecolor="white", linewidth=0.4)
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
    for bar, m in zip(bars, modes, strict=True):
        ax3.annotate(f"{report.speedup(m, 'padded'):.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                     ha="center", va="bottom", fontsize=10)
    ax3.set_ylabel("real tokens / s (median pass)")
    ax3.set_title(f"training the same {report['packed'].real_tokens:,} tokens (x = vs random padded)", fontsize=10)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except OSError as exc:
        raise InvalidArgumentError(f"--output {str(path.parent)!r}: {path.name} could not be written ({exc})") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _add_bench(subparsers: Any) -> None:
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
    _add_training_args(p, "bench")
    p.add_argument("--lengths", type=int, metavar="N",
                   help="synthetic lengths to pack (lognormal, median 250, sigma 1; default 1,000,000; "
                        "--quick 100,000)")
    p.add_argument("--no-training", action="store_true", help="measure packing only (no model, no torch)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from padfree.analysis import analyze_lengths
    from padfree.throughput import MODES, sample_sequences

    started = time.perf_counter()
    opts = _training_options(args, "bench")
    n = _optional_positive(args.lengths, "--lengths") or (100_000 if opts.quick else 1_000_000)
    if not args.no_training:
        _require("padfree bench (its training part; --no-training measures packing alone)", "torch", "transformers")
    elif args.data is not None:
        _require("padfree bench --data (it tokenizes the text)", "transformers")
    # what the trl mode imports (padfree.throughput): trl's packing and collator need datasets as well
    trl_missing = None if args.no_training else _import_error("datasets", "trl.data_utils", "trl.trainer.sft_trainer")
    say = _Progress(enabled=not args.quiet)
    rng = np.random.default_rng(opts.seed)
    synthetic = np.clip(np.rint(rng.lognormal(np.log(250), 1.0, n)), 1, opts.capacity).astype(np.int64)
    say(f"packing {n:,} synthetic lengths with every strategy")
    packing = {"synthetic": analyze_lengths(synthetic, opts.capacity, batch_size=opts.rows, repeats=5, seed=opts.seed)}
    data = None
    if not args.no_training or args.data is not None:
        data = _prepare(args, opts, say)
        packing["corpus"] = analyze_lengths(data.lengths, opts.capacity, batch_size=opts.rows, repeats=5,
                                            seed=opts.seed)
    report = model_text = None
    if not args.no_training:
        assert data is not None
        model, model_text = _model(args, opts, data.vocab, data.ids)
        modes = [m for m in MODES if m != "trl" or trl_missing is None]
        sample = sample_sequences(data.ids, opts.tokens, opts.capacity, seed=opts.seed)
        report, _ = _train(model, sample, opts, modes, say)
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
        _note(f"TRL's packing was not measured: {_one_line(trl_missing)}; {_install_hint(name)} adds it")
    return 0


def render_bench(summary: dict[str, Any], packing: dict[str, Any], report: Any) -> str:
    """The ``padfree bench`` report."""
    out = ["padfree bench"]
    for name, a in packing.items():
        what = (f"{a.stats.count:,} synthetic lognormal lengths (median 250, sigma 1)" if name == "synthetic"
                else f"{a.stats.count:,} sequences of {summary['packing']['corpus']['source']}")
        out += ["", f"Packing {what} into rows of {_n(a.capacity)} (median of 5 warm runs)"]
        rows = [[r.name, f"{r.time_ms:.2f}", _n(r.num_bins), _n(r.lower_bound), f"{r.efficiency:.3%}"]
                for r in a.strategies]
        out += _table(["strategy", "ms", "rows", "lower bound", "efficiency"], rows, "lrrrr")
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


#: subcommand name -> function adding its parser; each parser sets ``run`` to the function doing the work
# ==================================================================================================
# padfree verify
# ==================================================================================================


def _add_verify(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify",
        help="prove a model exact on packed rows, on every attention backend available here",
        description=(
            "Configure the model for each attention backend in turn (padfree.configure_packing) and compare one packed "
            "step with one step per sequence (padfree.verify: a few short sequences of different lengths in two "
            "rows): logits, loss and every parameter gradient. Prints the result per backend and the model's row of "
            "the README support table. First it says whether configure_packing accepts the model, and on what "
            "proof (the support table of the sweep, or an on-the-spot certification). Exit status 0: exact on every "
            "backend that ran; 1: refused by configure_packing, a mismatch, or no backend could run here. Needs "
            "torch and transformers."
        ),
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-type", metavar="TYPE",
                       help="the tiny random-weight model the support sweep proves for this transformers model type "
                            "(any causal-LM type, e.g. llama, qwen3_5_text, bloom)")
    which.add_argument("--model", metavar="DIR", help="a local checkpoint directory (save_pretrained), loaded in fp32")
    p.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                   help="check only this backend (repeatable): sdpa, eager, flex_attention, varlen, flash_attention_2, "
                        "auto (default: every backend available on the device)")
    p.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    p.add_argument("--atol", type=float, default=1e-5, help="tolerance on logits, loss and gradients (default: 1e-5)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.set_defaults(run=_run_verify)


def _load_model(args: argparse.Namespace) -> Any:
    if args.model_type is not None:  # the tiny model the support sweep proves for that type
        from padfree.model.shrink import UNBUILDABLE
        from padfree.model.sweep import build_tiny

        if args.model_type in UNBUILDABLE:
            raise UnsupportedModelError(f"--model-type {args.model_type!r}: {UNBUILDABLE[args.model_type]}")
        return build_tiny(args.model_type)
    path = Path(args.model)
    if not (path / "config.json").is_file():
        raise InvalidArgumentError(
            f"--model {args.model!r} is not a checkpoint directory (no config.json); expected a local directory "
            f"written by save_pretrained")
    import torch
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                 local_files_only=True)
    except Exception as exc:  # whatever transformers raises for a bad checkpoint becomes one clear line
        raise InvalidArgumentError(f"--model {args.model!r}: transformers cannot load a causal LM from it: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


def _run_verify(args: argparse.Namespace) -> int:
    if not args.atol >= 0:
        raise InvalidArgumentError(f"--atol must be a number >= 0, got {args.atol}")
    _require("padfree verify", "torch", "transformers")
    device = _torch_device(args.device)
    from padfree.model.configure import check_packing_support
    from padfree.model.support import check_support

    model = _load_model(args).to(device)
    support = check_packing_support(model)  # what configure_packing decides: the support table, or certification
    name = str(getattr(model.config, "model_type", type(model).__name__))
    verdict = (f"{name}: configure_packing accepts it — {support.how}" if support.ok else
               f"{name}: configure_packing refuses it — {support.reason}" + (f" ({support.how})" if support.how
                                                                              else ""))
    if not support.ok:
        if args.json:
            print(json.dumps({"model_type": name, "ok": False, "support": {
                "ok": False, "how": support.how, "reason": support.reason, "module": support.module}}, indent=2))
        else:
            print(verdict)
        return 1
    row = check_support(model, args.backends, atol=args.atol)
    if args.json:
        checks = [{
            "requested": c.requested, "backend": c.backend, "ok": c.ok, "forward_only": c.forward_only,
            "error": c.error,
            **({} if c.report is None else {"max_logit_diff": c.report.max_logit_diff,
                                             "loss_diff": c.report.loss_diff,
                                             "max_grad_diff": c.report.max_grad_diff}),
        } for c in row.checks]
        print(json.dumps({"model_type": row.model_type, "ok": row.ok, "checks": checks, "mixers": row.mixers,
                          "markdown": row.markdown(), "support": {"ok": True, "how": support.how}}, indent=2))
    else:
        print(verdict)
        print(row)
        print()
        print("| model type | " + " | ".join(f"`{c.requested}`" for c in row.checks) + " |")
        print("|---" * (len(row.checks) + 1) + "|")
        print(row.markdown())
    return 0 if row.ok else 1


def _torch_device(name: str) -> Any:
    """``--device`` as a ``torch.device`` this machine can allocate on, or one line saying why not."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgumentError(f"--device {name!r} is not a torch device: {_one_line(exc)}") from exc
    try:
        torch.empty(0, device=device)  # torch.device() only parses: "cuda" on a CPU-only build fails here
    except (AssertionError, RuntimeError) as exc:  # torch asserts for a backend it was built without
        build = f"torch {torch.__version__}" + (", built without CUDA" if device.type == "cuda" and not
                                                torch.version.cuda else "")
        why = _one_line(exc).split(". ")[0]  # torch may append a list of every backend it was built with
        raise BackendUnavailableError(f"--device {name!r} is not available here ({why}; {build}); use --device "
                                      "cpu, or a torch built for that device") from exc
    return device


COMMANDS: dict[str, Callable[[Any], None]] = {
    "analyze": _add_analyze, "pack": _add_pack, "verify": _add_verify, "demo": _add_demo, "bench": _add_bench,
}


if __name__ == "__main__":
    sys.exit(main())
