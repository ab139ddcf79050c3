"""What the commands read: DATA files and directories as Arrow tables, and the columns of them a command uses.

``analyze``, ``pack``, ``demo --data`` and ``bench --data`` read their input through these helpers, so a file that
``analyze`` measures is tokenized by ``pack`` into exactly the tokens that were counted. Every unreadable input
becomes one :class:`~padfree.errors.DataLoadError` naming the path and what is accepted.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from padfree.cli._optional import require
from padfree.errors import DataLoadError, InvalidArgumentError, InvalidLengthsError, PadfreeError
from padfree.packing.inputs import as_lengths, as_positive_int

DATA_FORMATS = ".json (a list of records, or JSON Lines), .jsonl, .parquet, .csv, or a datasets.save_to_disk directory"


def optional_positive(value: int | None, flag: str) -> int | None:
    """An option left out is None; one given must be ``>= 1``."""
    # the message need not mention None: it cannot be typed
    return None if value is None else as_positive_int(value, flag)


# ---- files and directories -----------------------------------------------------------------------


def read_table(data: str) -> Any:
    """``data`` as a ``pyarrow.Table``, or a :class:`DataLoadError` naming the path and the accepted formats."""
    path = _data_path(data)
    _require_readers(data, path)
    with _reading(data):
        if path.is_dir():
            # save_to_disk writes the selected rows themselves (no indices mapping): the backing table is the data
            return _load_saved_dataset(path, data).data.table
        return _read_file(path, data)


def read_dataset(data: str) -> Any:
    """``data`` as a ``datasets.Dataset``: a saved dataset directory memory-mapped, a file read into memory."""
    path = _data_path(data)
    _require_readers(data, path)
    require(f"reading {data}", "datasets")
    with _reading(data):
        if path.is_dir():
            return _load_saved_dataset(path, data)
        table = _read_file(path, data)
    import datasets
    from datasets.table import InMemoryTable

    return datasets.Dataset(InMemoryTable(table))


def is_saved_dataset(path: Path) -> bool:
    """Whether the directory ``path`` was written by ``datasets.Dataset.save_to_disk``."""
    return (path / "dataset_info.json").is_file() or (path / "state.json").is_file()


def _data_path(data: str) -> Path:
    path = Path(data).expanduser()
    if not path.exists():
        raise DataLoadError(f"DATA {data!r}: no such file or directory")
    return path


def _require_readers(data: str, path: Path) -> None:
    # pyarrow reads every file; a save_to_disk directory needs datasets
    require(f"reading {data}", "pyarrow")
    if path.is_dir():
        require(f"reading the saved dataset {data}", "datasets")


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


def _load_saved_dataset(path: Path, data: str) -> Any:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataLoadError(
            f"DATA {data!r} is a DatasetDict with splits {splits}; pass one split's directory, e.g. {data}/{splits[0]}"
            if splits else f"DATA {data!r} is an empty DatasetDict"
        )
    if not is_saved_dataset(path):
        raise DataLoadError(f"DATA {data!r} is a directory but not one written by datasets' save_to_disk; "
                            f"expected {DATA_FORMATS}")
    import datasets

    return datasets.load_from_disk(str(path))


# ---- columns -------------------------------------------------------------------------------------


def describe_columns(table: Any) -> str:
    """``name (type), ...`` for every column of a ``pyarrow.Table`` (or schema)."""
    schema = getattr(table, "schema", table)
    return ", ".join(f"{name} ({field.type})" for name, field in zip(schema.names, schema, strict=True))


def is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def is_token_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    return (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and pa.types.is_integer(
        arrow_type.value_type)


def texts_from_columns(table: Any, fields: list[str] | None) -> tuple[list[str], str]:
    """The texts to tokenize (one per row, chosen as :func:`text_columns` says) and the note saying which."""
    columns, note = text_columns(table.schema, fields)
    return join_text(table, columns).to_pylist(), note


def text_columns(schema: Any, fields: list[str] | None, *, exclude: str | None = None,
                 instead: str = "pass precomputed lengths with --lengths-column") -> tuple[list[str], str]:
    """The text columns to tokenize, chosen as ``--field`` says, and a note saying which and why.

    ``fields``: the ``--field`` names (each must be a string column), else ``text`` if it is one, else every string
    column. ``exclude``: a column never chosen by default (``padfree pack --completion-field``); with it, finding no
    other text column is no error. ``instead``: what the errors suggest when there is no text to tokenize.
    """
    names = list(schema.names)

    if fields:
        for name in fields:
            if name not in names:
                raise DataLoadError(f"--field {name!r}: no such column; available columns: {describe_columns(schema)}")
            if not is_text(schema.field(name).type):
                raise DataLoadError(
                    f"--field {name!r} has type {schema.field(name).type}, not text; choose string columns "
                    f"({describe_columns(schema)}) or {instead}"
                )
        columns = list(fields)
        note = "column " + " + ".join(map(repr, columns))
    elif "text" in names and is_text(schema.field("text").type) and exclude != "text":
        columns = ["text"]
        note = "column 'text'"
    else:
        columns = [name for name, field in zip(names, schema, strict=True) if is_text(field.type) and name != exclude]
        if not columns and exclude is None:
            raise DataLoadError(f"no text column to tokenize; available columns: {describe_columns(schema)}; "
                                f"{instead}")
        note = ("no 'text' column, so every string column: " + " + ".join(map(repr, columns))
                + " (choose with --field)")
    if len(columns) > 1:
        note += ", joined with newlines"
    return columns, note


def join_text(table: Any, columns: Sequence[str]) -> Any:
    """``(num_rows,)`` pyarrow strings: the ``columns`` of every row joined with newlines, a missing value as ``""``."""
    import pyarrow.compute as pc

    if len(columns) > 1:
        return pc.binary_join_element_wise(*(table[c] for c in columns), "\n",
                                           null_handling="replace", null_replacement="")
    return pc.fill_null(table[columns[0]], "")


def lengths_from_column(table: Any, column: str) -> tuple[np.ndarray, int]:
    """``(lengths, skipped)``: the positive lengths of ``--lengths-column``, and how many rows were 0."""
    import pyarrow as pa

    if column not in table.column_names:
        raise DataLoadError(f"--lengths-column {column!r}: no such column; available columns: "
                            f"{describe_columns(table)}")
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


def token_ids_from_column(ds: Any, ids_column: str, labels_column: str | None) -> tuple[Any, str]:
    """``ds`` narrowed to what :func:`padfree.pack_dataset` reads — ``input_ids`` and ``labels`` (or TRL's mask
    columns) — renamed from ``--input-ids-column`` / ``--labels-column``, and a note saying where they came from."""
    from padfree.data.hf import LABEL_MASK_COLUMNS

    schema = ds.data.schema
    for flag, name in (("--input-ids-column", ids_column), ("--labels-column", labels_column)):
        if name is None:
            continue
        if name not in schema.names:
            raise DataLoadError(f"{flag} {name!r}: no such column; available columns: {describe_columns(schema)}")
        if not is_token_list(schema.field(name).type):
            raise DataLoadError(f"{flag} {name!r} has type {schema.field(name).type}, not lists of integer token ids")
    if labels_column is None and "labels" in schema.names and ids_column != "labels":
        if not is_token_list(schema.field("labels").type):
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
