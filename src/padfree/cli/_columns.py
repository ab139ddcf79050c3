"""The columns of DATA a command uses: text to tokenize, precomputed lengths, or token ids (and their labels).

Each choice is checked against the table's schema before any work, and refused with the column, its type, the
columns present and what is accepted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from padfree.errors import DataLoadError, InvalidArgumentError, InvalidLengthsError

if TYPE_CHECKING:  # numpy is imported where it is used: a usage error costs no import
    import numpy as np


def describe_columns(table: Any) -> str:
    """``name (type), ...`` for every column of a ``pyarrow.Table`` (or schema)."""
    schema = getattr(table, "schema", table)
    return ", ".join(f"{name} ({field.type})" for name, field in zip(schema.names, schema, strict=True))


def is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def texts_from_columns(table: Any, fields: list[str] | None, source: str = "DATA") -> tuple[list[str], str]:
    """The texts to tokenize (one per row, chosen as :func:`text_columns` says) and the note saying which."""
    columns, note = text_columns(table.schema, fields, source=source)
    return join_text(table, columns).to_pylist(), note


def text_columns(schema: Any, fields: list[str] | None, *, exclude: str | None = None,
                 instead: str = "pass precomputed lengths with --lengths-column",
                 source: str = "DATA") -> tuple[list[str], str]:
    """The text columns to tokenize, chosen as ``--field`` says, and a note saying which and why.

    ``fields``: the ``--field`` names (each must be a string column), else ``text`` if it is one, else every string
    column. ``exclude``: a column never chosen by default (``padfree pack --completion-field``); with it, finding no
    other text column is no error. ``instead``: what the errors suggest when there is no text to tokenize;
    ``source``: the argument that named the data.
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
            why = (f"its column 'text' has type {schema.field('text').type}, not string, and no other column is text"
                   if "text" in names else "no column named 'text', and no column of strings")
            raise DataLoadError(f"{source} has no text column to tokenize ({why}); available columns: "
                                f"{describe_columns(schema)}; {instead}")
        note = ("no 'text' column, so every string column: " + " + ".join(map(repr, columns))
                + " (choose with --field)")
    if len(columns) > 1:
        note += ", joined with newlines"
    return columns, note


#: what ``--chat`` accepts, for the errors
CHAT_LAYOUTS = ("a 'messages' column (a list of {'role', 'content'} messages per record, TRL's conversational "
                "layout), or 'prompt' and 'completion' columns (strings: a user turn and the assistant's answer; or "
                "lists of messages: TRL's conversational prompt-completion)")


@dataclass(frozen=True)
class Chat:
    """Which columns hold chat data: ``messages`` (whole conversations), or ``prompt`` + ``completion`` —
    ``conversational``: lists of messages; else strings, made a user turn and an assistant turn."""

    messages: str | None = None
    prompt: str | None = None
    completion: str | None = None
    conversational: bool = True

    @property
    def note(self) -> str:
        if self.messages is not None:
            return f"conversations of column {self.messages!r} through the tokenizer's chat template, targets: " \
                   "the assistant turns"
        kind = "lists of messages" if self.conversational else "a user turn and the assistant's answer"
        return (f"columns {self.prompt!r} + {self.completion!r} ({kind}) through the tokenizer's chat template, "
                "targets: the completion's assistant turns")

    def conversations(self, table: Any) -> tuple[list[Any], list[Any] | None]:
        """The conversations of ``table``'s rows (a ``pyarrow.Table``), and the prompts among them (None: none)."""
        if self.messages is not None:
            return [m or [] for m in table[self.messages].to_pylist()], None
        prompts = table[self.prompt].to_pylist()
        completions = table[self.completion].to_pylist()
        if self.conversational:
            prompts = [p or [] for p in prompts]
            return [p + (c or []) for p, c in zip(prompts, completions, strict=True)], prompts
        # strings: the prompt is what the user says; its one turn holds no assistant tokens to mask
        return [[{"role": "user", "content": p or ""}, {"role": "assistant", "content": c or ""}]
                for p, c in zip(prompts, completions, strict=True)], None


def chat_columns(schema: Any, chat: bool, other: str | None, source: str = "DATA") -> Chat | None:
    """The chat layout of ``schema``, or None for text.

    ``chat``: ``--chat`` was given (string ``prompt`` / ``completion`` columns are then chat turns; without it they
    are text, the completion the only target). A ``messages`` column of messages, or ``prompt`` / ``completion``
    columns of messages, are chat data whether or not ``--chat`` says so. ``other``: a flag that chose other columns
    (``--field``, ``--completion-field``, ``--input-ids-column``): no chat then, and ``--chat`` with it is refused.
    """
    names = list(schema.names)
    if other is not None:
        if chat:
            raise InvalidArgumentError(f"--chat and {other} exclude each other: --chat reads {CHAT_LAYOUTS}")
        return None
    if "messages" in names and _is_messages(schema.field("messages").type):
        return Chat(messages="messages")
    pair = "prompt" in names and "completion" in names
    if pair and all(_is_messages(schema.field(c).type) for c in ("prompt", "completion")):
        return Chat(prompt="prompt", completion="completion")
    if not chat:
        return None
    if pair and all(is_text(schema.field(c).type) for c in ("prompt", "completion")):
        return Chat(prompt="prompt", completion="completion", conversational=False)
    raise DataLoadError(f"--chat: {source} holds no chat data; expected {CHAT_LAYOUTS}; available columns: "
                        f"{describe_columns(schema)}")


def prompt_completion_text(schema: Any) -> bool:
    """Whether ``schema`` holds TRL's (text) prompt-completion layout: string ``prompt`` and ``completion`` columns."""
    return all(c in schema.names and is_text(schema.field(c).type) for c in ("prompt", "completion"))


def _is_messages(arrow_type: Any) -> bool:
    """A list of structs with a ``role`` and a ``content`` field: a conversation."""
    import pyarrow as pa

    if not _is_list(arrow_type) or not pa.types.is_struct(arrow_type.value_type):
        return False
    fields = {arrow_type.value_type.field(i).name for i in range(arrow_type.value_type.num_fields)}
    return {"role", "content"} <= fields


def join_text(table: Any, columns: Sequence[str]) -> Any:
    """``(num_rows,)`` pyarrow strings: the ``columns`` of every row joined with newlines, a missing value as ``""``."""
    import pyarrow.compute as pc

    if len(columns) > 1:
        return pc.binary_join_element_wise(*(table[c] for c in columns), "\n",
                                           null_handling="replace", null_replacement="")
    return pc.fill_null(table[columns[0]], "")


def lengths_from_column(table: Any, column: str) -> tuple[np.ndarray, int]:
    """``(lengths, skipped)``: the positive lengths of ``--lengths-column``, and how many rows were 0."""
    import numpy as np
    import pyarrow as pa

    from padfree.packing.inputs import as_lengths

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


def token_ids_from_column(ds: Any, ids_column: str, labels_column: str | None, *,
                          ids_named: bool = True) -> tuple[Any, str]:
    """``ds`` narrowed to what :func:`padfree.pack_dataset` reads — ``input_ids`` and ``labels`` (or TRL's mask
    columns) — renamed from ``--input-ids-column`` / ``--labels-column``, plus the other per-token columns it
    carries into the packed rows (``token_type_ids``, the masks, ...), and a note saying where they came from.

    ``ids_named``: whether ``--input-ids-column`` named ``ids_column`` (else it is DATA's own ``input_ids``).
    A per-token column that packed rows cannot hold (floats, strings) is left out with a note on stderr.
    """
    from padfree.data.hf import LABEL_MASK_COLUMNS

    schema = ds.data.schema
    ids_label = f"--input-ids-column {ids_column!r}" if ids_named else f"column {ids_column!r}"
    for label, name in ((ids_label, ids_column), (f"--labels-column {labels_column!r}", labels_column)):
        if name is None:
            continue
        if name not in schema.names:
            raise DataLoadError(f"{label}: no such column; available columns: {describe_columns(schema)}")
        _check_token_lists(ds, name, label)
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
    carried = _per_token_columns(ds, ids_column, [name for name in schema.names if name not in keep])
    keep.update({name: name for name in carried})
    carried = list(dict.fromkeys([*(m for m in keep if m in LABEL_MASK_COLUMNS), *carried]))
    if carried:
        measure += "; carried per token: " + ", ".join(map(repr, carried))
    ds = ds.select_columns(list(keep)).rename_columns({k: v for k, v in keep.items() if k != v})
    return ds, measure


def _per_token_columns(ds: Any, ids_column: str, names: list[str]) -> list[str]:
    """The columns of ``names`` that hold one integer (or boolean) per token of ``ids_column`` — every row as long as
    its ids, null rows aside — which :func:`padfree.pack_dataset` carries into the packed rows; a per-token column
    of any other values gets a note saying it is not written (the command has no other place to put it)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from padfree.cli._output import note
    from padfree.data.hf import NOT_CARRIED

    table = ds.data.table if getattr(ds, "_indices", None) is None else ds.with_format("arrow")[:]
    want = pc.list_value_length(table[ids_column]).to_numpy(zero_copy_only=False)
    carried = []
    for name in names:
        kind = table.schema.field(name).type
        if name in NOT_CARRIED or (not _is_list(kind) and not pa.types.is_fixed_size_list(kind)):
            continue
        lengths = pc.list_value_length(table[name]).to_numpy(zero_copy_only=False)
        present = ~np.isnan(lengths) if lengths.dtype.kind == "f" else np.ones(lengths.shape, bool)
        if not present.any() or not np.array_equal(lengths[present], want[present]):
            continue
        if pa.types.is_integer(kind.value_type) or pa.types.is_boolean(kind.value_type):
            carried.append(name)
        else:
            note(f"column {name!r} holds one {kind.value_type} value per token; packed rows carry only integer or "
                 f"boolean per-token columns, so it is not written")
    return carried


def _is_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _is_token_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    return _is_list(arrow_type) and pa.types.is_integer(arrow_type.value_type)


def _check_token_lists(ds: Any, name: str, label: str) -> None:
    """Refuse a column that is not one list of integers per record, saying what it holds instead."""
    import pyarrow as pa

    kind = ds.data.schema.field(name).type
    if _is_token_list(kind):
        return
    if not _is_list(kind):
        holds = f"one {kind} per record, not a list"
    elif _is_list(kind.value_type):
        holds = "lists of lists, one level too deep,"
    elif pa.types.is_floating(kind.value_type):
        holds = "lists of floating-point numbers"
    elif pa.types.is_string(kind.value_type) or pa.types.is_large_string(kind.value_type):
        holds = "lists of strings"
    else:
        holds = f"lists of {kind.value_type} values"
    sample = json.dumps(ds.data.column(name)[0].as_py(), default=str)
    sample = sample if len(sample) <= 40 else sample[:37] + "..."
    raise DataLoadError(f"{label} holds {holds} (Arrow type {kind}; record 0: {sample}); expected one list of "
                        "integer token ids >= 0 per record, such as [1, 2, 3]")
