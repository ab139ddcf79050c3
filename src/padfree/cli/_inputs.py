"""What the commands read: DATA — a file or a saved dataset directory — as an Arrow table with at least one record.

``analyze``, ``pack``, ``demo --data`` and ``bench --data`` read their input here, so a file that ``analyze`` measures
is tokenized by ``pack`` into exactly the tokens that were counted. Every input that cannot be read becomes one
:class:`~padfree.errors.DataLoadError` that names the path, where in it the fault is (the line of a JSON Lines file,
the record of a JSON list, the row of a CSV) and what is accepted; the columns a command then takes are
:mod:`padfree.cli._columns`' business.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from padfree.cli._optional import require
from padfree.errors import DataLoadError, PadfreeError

DATA_FORMATS = ".json (a list of records, or JSON Lines), .jsonl, .parquet, .csv, or a datasets.save_to_disk directory"

#: what each file type must hold, for the errors
_EXPECTED = {
    ".json": 'a JSON list of records such as [{"text": ...}, ...], or JSON Lines (one record per line)',
    ".jsonl": 'JSON Lines: one record such as {"text": ...} per line',
    ".parquet": "a Parquet file (as written by pyarrow.parquet.write_table or Dataset.to_parquet)",
    ".csv": "a CSV file whose first line names the columns",
}
_EXPECTED[".ndjson"] = _EXPECTED[".jsonl"]


def optional_positive(value: int | None, flag: str) -> int | None:
    """An option left out is None; one given must be ``>= 1``."""
    from padfree.packing.inputs import as_positive_int

    # the message need not mention None: it cannot be typed
    return None if value is None else as_positive_int(value, flag)


def read_table(data: str, flag: str = "DATA") -> Any:
    """``data`` as a ``pyarrow.Table`` of at least one record; ``flag`` names the argument in the errors."""
    path = _data_path(data, flag)
    _require_readers(data, path)
    with _reading(data, flag):
        if path.is_dir():
            # save_to_disk writes the selected rows themselves (no indices mapping): the backing table is the data
            table = _load_saved_dataset(path, data, flag).data.table
        else:
            table = _read_file(path, f"{flag} {data!r}")
    _refuse_empty(table, data, flag)
    return table


def read_dataset(data: str, flag: str = "DATA") -> Any:
    """``data`` as a ``datasets.Dataset`` of at least one record: a saved dataset directory memory-mapped, a file
    read into memory."""
    path = _data_path(data, flag)
    _require_readers(data, path)
    require(f"reading {data}", "datasets")
    with _reading(data, flag):
        if path.is_dir():
            dataset = _load_saved_dataset(path, data, flag)
        else:
            import datasets
            from datasets.table import InMemoryTable

            dataset = datasets.Dataset(InMemoryTable(_read_file(path, f"{flag} {data!r}")))
    _refuse_empty(dataset.data, data, flag)
    return dataset


def check_data_path(data: str, flag: str = "DATA") -> Path:
    """The cheap checks of ``data`` — it exists, and a file has a type the readers know — made before a command
    imports its heavy packages (a mistyped path fails in a fraction of a second, not after loading transformers)."""
    path = _data_path(data, flag)
    if not path.is_dir() and path.suffix.lower() not in _EXPECTED:
        raise DataLoadError(f"{flag} {data!r}: unsupported file type {path.suffix or '(none)'!r}; expected "
                            f"{DATA_FORMATS}")
    return path


def is_saved_dataset(path: Path) -> bool:
    """Whether the directory ``path`` was written by ``datasets.Dataset.save_to_disk``."""
    return (path / "dataset_info.json").is_file() or (path / "state.json").is_file()


def _data_path(data: str, flag: str) -> Path:
    path = Path(data).expanduser()
    if not path.exists():
        raise DataLoadError(f"{flag} {data!r}: no such file or directory")
    return path


def _require_readers(data: str, path: Path) -> None:
    # pyarrow reads every file; a save_to_disk directory needs datasets
    require(f"reading {data}", "pyarrow")
    if path.is_dir():
        require(f"reading the saved dataset {data}", "datasets")


def _refuse_empty(table: Any, data: str, flag: str) -> None:
    if table.num_rows == 0:
        columns = f" (its columns: {_describe(table.schema)})" if table.num_columns else ""
        raise DataLoadError(f"{flag} {data!r} holds no records{columns}")


def _describe(schema: Any) -> str:
    return ", ".join(f"{name} ({field.type})" for name, field in zip(schema.names, schema, strict=True))


@contextlib.contextmanager
def _reading(data: str, flag: str) -> Iterator[None]:
    """Turn what pyarrow and datasets raise on an input the checks below did not foresee into one line."""
    import pyarrow as pa

    try:
        yield
    except PadfreeError:
        raise
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise DataLoadError(f"{flag} {data!r} could not be read ({type(exc).__name__}: {_first_line(exc)})") from exc


def _first_line(exc: BaseException) -> str:
    # pyarrow may quote the undecodable bytes it met: never let the message itself fail to print
    text = str(exc).encode("utf-8", "replace").decode("utf-8").strip()
    return (text.splitlines() or [type(exc).__name__])[0]


def _read_file(path: Path, what: str) -> Any:
    suffix = path.suffix.lower()
    if suffix not in _EXPECTED:
        raise DataLoadError(f"{what}: unsupported file type {path.suffix or '(none)'!r}; expected {DATA_FORMATS}")
    if path.stat().st_size == 0:
        raise DataLoadError(f"{what} is an empty file (0 bytes); expected {_EXPECTED[suffix]}")
    if suffix == ".json":
        return _read_json(path, what)
    if suffix in (".jsonl", ".ndjson"):
        return _read_json_lines(path, what, suffix)
    if suffix == ".parquet":
        return _read_parquet(path, what)
    return _read_csv(path, what)


# ---- JSON ------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> Any:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if not head:
        raise DataLoadError(f"{what} holds only whitespace; expected {_EXPECTED['.json']}")
    if head.startswith(b"{"):
        return _read_json_lines(path, what, ".json")  # JSON Lines with a .json name
    value = _parse_json(path.read_bytes(), what)
    if not isinstance(value, list):
        raise DataLoadError(f"{what} holds {_kind(value)}, not a list of records; expected {_EXPECTED['.json']}")
    return _records_table(value, what, lambda i: f"record {i}")


def _parse_json(raw: bytes, what: str) -> Any:
    text = _decode(raw, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataLoadError(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}; "
                            f"expected {_EXPECTED['.json']}") from exc


def _decode(raw: bytes, what: str, first_line: int = 1) -> str:
    """``raw`` as text, or the error naming the line and column of the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw.count(b"\n", 0, exc.start)
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataLoadError(f"{what} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column {column} "
                            "cannot be decoded; save the file as UTF-8") from exc


def _read_json_lines(path: Path, what: str, suffix: str) -> Any:
    import pyarrow as pa
    import pyarrow.json

    try:
        table = pyarrow.json.read_json(path)
        table.validate(full=True)  # pyarrow does not check that the strings it read are UTF-8
    except (pa.ArrowException, ValueError) as exc:
        # the fast reader says little about where (a row of its own blocks): find the first bad line ourselves
        _diagnose_json_lines(path, what, suffix)
        raise DataLoadError(f"{what} could not be read as JSON Lines ({_first_line(exc)}); "
                            f"expected {_EXPECTED[suffix]}") from exc
    if suffix == ".json" and table.num_rows == 1:  # {"a": 1, "b": 2} or {"text": [...]}: not a dataset of records
        raise DataLoadError(f"{what} holds one JSON object (keys {', '.join(map(repr, table.column_names))}), not a "
                            f"list of records; expected {_EXPECTED['.json']} (name a one-line JSON Lines file .jsonl)")
    return table


def _diagnose_json_lines(path: Path, what: str, suffix: str) -> None:
    """Raise the error of the first line of ``path`` that is not UTF-8, not JSON or not a record; or return."""
    if suffix == ".json":  # one object spread over several lines is one JSON document: say what the file is
        try:
            value = _parse_json(path.read_bytes(), what)
        except DataLoadError:
            value = []  # not one document: look at it line by line
        if not isinstance(value, list):
            raise DataLoadError(f"{what} holds {_kind(value)}, not a list of records; expected {_EXPECTED['.json']}")

    def lines() -> Iterator[tuple[int, Any]]:
        with path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                line = _decode(raw, what, first_line=number)
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataLoadError(f"{what}, line {number} is not valid JSON ({exc.msg} at column "
                                        f"{exc.colno}); expected {_EXPECTED[suffix]}") from exc
                yield number, value

    for _ in _check_records(lines(), what, lambda n: f"line {n}", _EXPECTED[suffix]):
        pass


def _records_table(records: list[Any], what: str, name: Any) -> Any:
    import pyarrow as pa

    records = [r for _, r in _check_records(enumerate(records), what, name, _EXPECTED[".json"])]
    # every key of every record, in the order they first appear: pyarrow's from_pylist takes the first record's
    # keys as the columns and would drop a key that only a later record has (a record without it reads as null)
    keys = list(dict.fromkeys(key for record in records for key in record))
    try:
        return pa.Table.from_pydict({key: [record.get(key) for record in records] for key in keys})
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise DataLoadError(f"{what}: its records could not be made into columns ({_first_line(exc)})") from exc


def _check_records(items: Iterable[tuple[int, Any]], what: str, name: Any, expected: str) -> Iterator[tuple[int, Any]]:
    """Pass ``(index, record)`` through; refuse a record that is not an object, or a field whose JSON type differs
    from the same field's in an earlier record (Arrow columns hold one type). ``name(index)`` words the location."""
    seen: dict[str, tuple[str, int]] = {}  # field -> (its kind, where it was first seen)
    for index, record in items:
        if not isinstance(record, dict):
            raise DataLoadError(f"{what}: {name(index)} is {_kind(record)}, not a record; expected {expected}")
        for field, value in record.items():
            kind = _kind(value, article=False)
            if kind in ("null", "array"):  # a missing value, or a list with nothing to type: fits any column
                continue
            first = seen.setdefault(field, (kind, index))
            if first[0] != kind:
                raise DataLoadError(f"{what}: {name(index)} has {field!r} = {_short(value)} ({_a(kind)}), but "
                                    f"{name(first[1])} has {_a(first[0])} there; every record needs the same type "
                                    "in a field")
        yield index, record


def _kind(value: Any, *, article: bool = True) -> str:
    """The JSON type of ``value`` in words; lists say what they hold (``"array of strings"``)."""
    if isinstance(value, bool):
        kind = "boolean"
    elif isinstance(value, (int, float)):
        kind = "number"
    elif isinstance(value, str):
        kind = "string"
    elif isinstance(value, dict):
        kind = "object"
    elif isinstance(value, list):
        inner = next((v for v in value if v is not None), None)
        of = "" if inner is None else _kind(inner, article=False)
        kind = ("array" if not of else f"array of {of.replace('array', 'arrays', 1)}" if of.startswith("array")
                else f"array of {of}s")
    else:
        kind = "null"
    if not article:
        return kind
    return f"a JSON {kind} ({_short(value)})" if kind != "object" else "one JSON object"


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- Parquet, CSV, saved datasets -------------------------------------------------------------------


def _read_parquet(path: Path, what: str) -> Any:
    import pyarrow.parquet

    size = path.stat().st_size
    with path.open("rb") as f:
        start = f.read(4)
        f.seek(max(size - 4, 0))
        end = f.read(4)
    if start != b"PAR1":
        raise DataLoadError(f"{what} is not a Parquet file (it does not start with the Parquet magic bytes PAR1); "
                            f"expected {_EXPECTED['.parquet']}")
    if end != b"PAR1" or size < 12:
        raise DataLoadError(f"{what} is a truncated Parquet file: it starts like one but its {size:,} bytes end "
                            "without the Parquet footer; write it again")
    try:
        return pyarrow.parquet.read_table(path)
    except (OSError, ValueError) as exc:
        raise DataLoadError(f"{what} is a corrupt Parquet file ({_first_line(exc)}); write it again") from exc


def _read_csv(path: Path, what: str) -> Any:
    import pyarrow as pa
    import pyarrow.csv

    table = pyarrow.csv.read_csv(path)
    for name, field in zip(table.column_names, table.schema, strict=True):
        if pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type):  # pyarrow's answer to bad UTF-8
            for row, value in enumerate(table[name].to_pylist()):
                if value is None:
                    continue
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataLoadError(f"{what} is not UTF-8 text: column {name!r}, row {row} holds byte "
                                        f"0x{value[exc.start]:02x} that cannot be decoded; save the file as "
                                        "UTF-8") from exc
    return table


def _load_saved_dataset(path: Path, data: str, flag: str) -> Any:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataLoadError(
            f"{flag} {data!r} is a DatasetDict with splits {splits}; pass one split's directory, e.g. "
            f"{data}/{splits[0]}" if splits else f"{flag} {data!r} is an empty DatasetDict"
        )
    if not is_saved_dataset(path):
        raise DataLoadError(f"{flag} {data!r} is a directory but not one written by datasets' save_to_disk; "
                            f"expected {DATA_FORMATS}")
    import datasets

    return datasets.load_from_disk(str(path))
