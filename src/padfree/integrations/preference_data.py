"""The datasets of the preference and RL trainers, checked before TRL reads them, and the rows they drop, counted.

TRL's DPO, reward and GRPO trainers read ``dataset[0]``, join ``prompt + chosen`` and call ``.endswith`` on every
row: a missing column, a None, a number where text belongs or a dataset without rows ends in a KeyError, an
AttributeError or a StopIteration from inside TRL. padfree's :class:`~padfree.DPOTrainer`,
:class:`~padfree.integrations.reward.RewardTrainer` and :class:`~padfree.integrations.grpo.GRPOTrainer` read their
datasets here first, column by column on the Arrow table (:func:`check_dataset`), and every fault is one
:class:`~padfree.errors.InvalidSampleError` (:class:`~padfree.errors.InvalidTokensError` for a token id's value)
naming the trainer, the column, the row and what the trainer accepts:

>>> import datasets
>>> pairs = datasets.Dataset.from_list([{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"},
...                                     {"prompt": "3+3=", "chosen": None, "rejected": " 7"}])
>>> check_dataset(pairs, DPO_DATA)
Traceback (most recent call last):
...
padfree.errors.InvalidSampleError: DPOTrainer: train_dataset[1]['chosen'] is None (1 of 2 rows are); every row \
needs text (str) or a list of {'role', 'content'} messages: filter those rows out first

What each trainer accepts is what TRL 1.16 trains (:data:`DPO_DATA`, :data:`REWARD_DATA`, :data:`GRPO_DATA`): text
or conversational columns (lists of ``{"role", "content"}`` messages), the prompt explicit or — for DPO and the
reward model — implicit; the reward model also takes tokenized ``chosen_ids`` / ``rejected_ids`` (read through
:func:`padfree.samples.read_arrow_chunks`, the front door for token ids). An empty completion (``""``, ``[]``, no
token ids) is refused: TRL fails on it or trains the pair on an EOS alone. A streamed ``IterableDataset`` is checked
on its first row.

The rows a trainer drops by its own rule (the reward model's pairs longer than ``max_length``, DPO's pairs whose
prompt fills ``max_length``) are found on the tokenized columns at once (:func:`drop_counted`), counted into the
trainer's :class:`~padfree.integrations.status.PackingStatus` ``dropped``, and logged once at WARNING with the fix;
when a rule would drop every row, one :class:`~padfree.errors.InvalidArgumentError` says so before training.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from padfree.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidSampleError,
    InvalidTokensError,
    OverlongSequenceError,
    describe,
)
from padfree.samples import read_arrow_chunks

try:
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
except ImportError as exc:  # pragma: no cover - datasets is installed wherever the trainers are used
    raise BackendUnavailableError(
        "padfree.integrations.preference_data needs datasets; pip install 'padfree[trl]'"
    ) from exc

__all__ = ["DPO_DATA", "GRPO_DATA", "REWARD_DATA", "DropRule", "check_dataset", "check_datasets", "dataset_label",
           "drop_counted", "refuse_long_pairs"]

logger = logging.getLogger("padfree")

_MESSAGES_TEXT = "text (str) or a list of {'role', 'content'} messages"
_IDS_TEXT = "a non-empty list of integer token ids"
_SHOWN_ROWS = 8  # row indices quoted in a warning


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What one trainer reads from a dataset row.

    Attributes:
        trainer: the trainer's name in messages.
        unit: what one row is (``"preference pair"``, ``"prompt"``).
        required: text or conversational columns every row needs.
        optional: text or conversational columns read when present.
        may_be_empty: columns whose text may be ``""`` (an implicit prompt can be).
        tokenized: column groups accepted instead of the text columns, all of a group together.
        numbers: optional numeric columns (the reward model's ``margin``).
        accepted: the accepted formats, in words.
        untrainable: tokenized columns the trainer builds itself and cannot train from alone (named when the text
            columns are missing).
    """

    trainer: str
    unit: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    may_be_empty: tuple[str, ...] = ()
    tokenized: tuple[tuple[str, ...], ...] = ()
    numbers: tuple[str, ...] = ()
    accepted: str = ""
    untrainable: tuple[str, ...] = ()


DPO_DATA = DataSpec(
    "DPOTrainer", "preference pair", required=("chosen", "rejected"), optional=("prompt",), may_be_empty=("prompt",),
    accepted="'chosen' and 'rejected' as text (str) or as lists of {'role', 'content'} messages, with an optional "
             "'prompt' of the same kind (without it, the shared start of chosen and rejected is the prompt); TRL's "
             "DPOTrainer tokenizes them itself",
    untrainable=("prompt_ids", "chosen_ids", "rejected_ids"))
REWARD_DATA = DataSpec(
    "RewardTrainer", "preference pair", required=("chosen", "rejected"), optional=("prompt",),
    may_be_empty=("prompt",), tokenized=(("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids")),
    numbers=("margin",),
    accepted="'chosen' and 'rejected' as text (str) or as lists of {'role', 'content'} messages, with an optional "
             "'prompt' of the same kind; or tokenized 'chosen_ids' and 'rejected_ids' (lists of token ids); and an "
             "optional numeric 'margin'")
GRPO_DATA = DataSpec(
    "GRPOTrainer", "prompt", required=("prompt",),
    accepted="'prompt' as text (str) or as a list of {'role', 'content'} messages")


def dataset_label(split: str) -> str:
    """The argument a split of TRL's ``_prepare_dataset`` came from: ``"train"`` -> ``"train_dataset"``,
    ``"eval"`` -> ``"eval_dataset"``, another name -> ``"eval_dataset['name']"``.

    >>> dataset_label("train"), dataset_label("eval"), dataset_label("gsm8k")
    ('train_dataset', 'eval_dataset', "eval_dataset['gsm8k']")
    """
    return {"train": "train_dataset", "eval": "eval_dataset"}.get(split, f"eval_dataset[{split!r}]")


# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


def check_datasets(spec: DataSpec, train_dataset: Any, eval_dataset: Any, *, vocab_size: int | None = None,
                   require: bool = True) -> list[Any]:
    """:func:`check_dataset` on a trainer's ``train_dataset`` and every ``eval_dataset`` (one, or a dict of them);
    returns the datasets checked (a trainer skips them when TRL prepares them later). ``require=False``: no
    ``train_dataset`` is needed and ``spec.required`` columns are optional (GRPO with an ``environment_factory``).

    Raises:
        InvalidArgumentError: no ``train_dataset`` where one is required.
    """
    checked = []
    if train_dataset is None and require:
        raise InvalidArgumentError(f"{spec.trainer}: train_dataset is required (got None); it reads {spec.accepted}")
    if train_dataset is not None:
        check_dataset(train_dataset, spec, "train_dataset", vocab_size=vocab_size, require=require)
        checked.append(train_dataset)
    evals = eval_dataset.items() if isinstance(eval_dataset, Mapping) else [("eval", eval_dataset)]
    for split, dataset in evals:
        if dataset is not None and isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
            check_dataset(dataset, spec, dataset_label(split), vocab_size=vocab_size, require=require)
            checked.append(dataset)
    return checked


def check_dataset(dataset: Any, spec: DataSpec, name: str = "train_dataset", *, vocab_size: int | None = None,
                  require: bool = True) -> str:
    """Check that ``dataset`` holds rows ``spec.trainer`` can train; return its format (``"text"``,
    ``"messages"`` or ``"token ids"``).

    Column-wise on the Arrow table: the columns present, their types, nulls, empty values and, for token ids,
    their values (below ``vocab_size`` when given). A ``datasets.IterableDataset`` is checked on its first row.

    Args:
        dataset: a ``datasets.Dataset`` or ``datasets.IterableDataset``.
        spec: what the trainer reads (:data:`DPO_DATA`, :data:`REWARD_DATA`, :data:`GRPO_DATA`).
        name: the argument in messages (``"train_dataset"``, ``"eval_dataset['x']"``).
        require: False: ``spec.required`` columns are optional (GRPO with an ``environment_factory``, whose
            environment supplies the prompt).

    Raises:
        InvalidSampleError: no rows, a missing column, a None, a value of another type, an empty value.
        InvalidTokensError: a token id that is negative or not below ``vocab_size``.
        InvalidArgumentError: ``dataset`` is not a ``datasets.Dataset`` or ``IterableDataset``.
    """
    table, names = _table(dataset, spec, name)
    columns = set(table.column_names)  # the columns read that are present
    for group in spec.tokenized:
        if set(group) <= columns:
            for column in group:
                _check_ids(table, column, name, spec, vocab_size)
            _check_numbers(table, spec, name)
            return "token ids"
    required = spec.required if require else ()
    missing = [c for c in required if c not in columns]
    if missing:
        _refuse_missing(missing[0], names, spec, name)
    kinds = {c: _check_text(table, c, name, spec) for c in (*spec.required, *spec.optional) if c in columns}
    if len(set(kinds.values())) > 1:
        text = [c for c, k in kinds.items() if k == "text"]
        messages = [c for c, k in kinds.items() if k == "messages"]
        raise InvalidSampleError(
            f"{spec.trainer}: {name} holds text in {text} but lists of messages in {messages}; TRL joins prompt + "
            f"chosen / rejected, so they must all be text or all lists of {{'role', 'content'}} messages")
    _check_numbers(table, spec, name)
    return next(iter(kinds.values()), "text")


def _table(dataset: Any, spec: DataSpec, name: str) -> tuple[pa.Table, list[str]]:
    """The columns ``spec`` reads, as an Arrow table in the dataset's own row order (an IterableDataset: its first
    row), and the names of all the dataset's columns."""
    wanted = [*spec.required, *spec.optional, *spec.numbers, *(c for g in spec.tokenized for c in g)]
    if isinstance(dataset, datasets.Dataset):
        if len(dataset) == 0:
            raise InvalidSampleError(f"{spec.trainer}: {name} has no rows (columns {dataset.column_names}); it needs "
                                     f"at least one {spec.unit}")
        present = [c for c in wanted if c in dataset.column_names]
        return dataset.select_columns(present).with_format("arrow")[:], list(dataset.column_names)
    if isinstance(dataset, datasets.IterableDataset):
        try:
            first = next(iter(dataset))
        except StopIteration:
            raise InvalidSampleError(f"{spec.trainer}: {name} (a streamed IterableDataset) has no rows; it needs at "
                                     f"least one {spec.unit}") from None
        row = {c: first[c] for c in wanted if c in first}
        try:
            table = pa.Table.from_pylist([row])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InvalidSampleError(f"{spec.trainer}: the first row of {name} (a streamed IterableDataset), "
                                     f"{describe(row, 120)}, is not {spec.accepted} ({exc})") from None
        return table, list(first)
    raise InvalidArgumentError(f"{spec.trainer}: {name} must be a datasets.Dataset or datasets.IterableDataset, got "
                               f"{describe(dataset)}")


def _refuse_missing(column: str, present: list[str], spec: DataSpec, name: str) -> None:
    partial = [(g, [c for c in g if c not in present]) for g in spec.tokenized if set(g) & set(present)]
    if partial:
        group, absent = partial[0]
        raise InvalidSampleError(
            f"{spec.trainer}: {name} has {[c for c in group if c in present]} but no {absent[0]!r} column (its "
            f"columns: {present}); tokenized pairs need both of {list(group)}. {spec.trainer} reads {spec.accepted}")
    if set(spec.untrainable) & set(present):
        raise InvalidSampleError(
            f"{spec.trainer}: {name} has no {column!r} column but tokenized ones ({present}); TRL's {spec.trainer} "
            f"tokenizes the text itself and cannot train {list(spec.untrainable)} alone. It reads {spec.accepted}")
    raise InvalidSampleError(f"{spec.trainer}: {name} has no {column!r} column (its columns: {present}); "
                             f"{spec.trainer} reads {spec.accepted}")


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _refuse_nulls(column: Any, where: Callable[[int], str], accepted: str, total: int) -> None:
    if column.null_count:  # a column of nothing but None (Arrow type null) counts every row
        valid = pc.is_valid(column).to_numpy(zero_copy_only=False)
        raise InvalidSampleError(f"{where(_first(~valid))} is None ({int((~valid).sum())} of {total} rows are); "
                                 f"every row needs {accepted}: filter those rows out first")


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _is_text(kind: pa.DataType) -> bool:
    view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or view(kind)


def _check_text(table: pa.Table, column: str, name: str, spec: DataSpec) -> str:
    """A text or conversational column: no None, the right type, messages with a role, nothing empty."""
    col = table.column(column)
    total = len(col)

    def where(i: int) -> str:
        return f"{spec.trainer}: {name}[{i}][{column!r}]"

    _refuse_nulls(col, where, _MESSAGES_TEXT, total)
    kind = col.type
    if _is_text(kind):
        lengths = pc.binary_length(col).to_numpy(zero_copy_only=False)
        found = "text"
    elif _is_list(kind) and (pa.types.is_struct(kind.value_type) or pa.types.is_null(kind.value_type)):
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        found = "messages"
    else:
        raise InvalidSampleError(
            f"{where(0)} = {describe(col[0].as_py())}: {name}[{column!r}] holds Arrow type {kind}; every row needs "
            f"{_MESSAGES_TEXT}. {spec.trainer} reads {spec.accepted}")
    empty = lengths == 0
    if empty.any() and (found == "messages" or column not in spec.may_be_empty):
        what = "an empty string" if found == "text" else "an empty list of messages"
        why = ("TRL fails on an empty prompt" if column == "prompt" else
               "an empty completion fails in TRL or trains the pair on an EOS alone")
        raise InvalidSampleError(
            f"{where(_first(empty))} is {what} ({int(empty.sum())} of {total} rows are); every {column!r} needs "
            f"{'some text' if found == 'text' else 'at least one message'} ({why}): filter those rows out first")
    if found == "messages":
        fields = [] if pa.types.is_null(kind.value_type) else [f.name for f in kind.value_type]
        if "role" not in fields or "content" not in fields:
            raise InvalidSampleError(
                f"{where(0)} = {describe(col[0].as_py())}: the messages of {name}[{column!r}] have the keys {fields}; "
                f"TRL reads messages as {{'role', 'content'}} dicts (convert 'from'/'value' messages first)")
        flat = pc.list_flatten(col)
        if flat.null_count:
            parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
            bad = ~pc.is_valid(flat).to_numpy(zero_copy_only=False)
            row = int(parents[_first(bad)])
            raise InvalidSampleError(f"{where(row)} holds a None message; every message is a {{'role', 'content'}} "
                                     f"dict: filter those rows out first")
    return found


def _check_ids(table: pa.Table, column: str, name: str, spec: DataSpec, vocab_size: int | None) -> None:
    """A tokenized column, through the front door for token ids, then: no empty sequence."""
    col = table.column(column)

    def where(i: int) -> str:
        return f"{spec.trainer}: {name}[{i}][{column!r}]"

    _refuse_nulls(col, where, _IDS_TEXT, len(col))
    try:
        chunks = read_arrow_chunks(col, f"{name}[{column!r}]", vocab_size=vocab_size,
                                   rows=lambda i: f"{name}[{i}][{column!r}]")
    except InvalidTokensError as exc:  # the same fault, said in the trainer's terms
        raise type(exc)(f"{spec.trainer}: {exc}; {spec.trainer} reads {spec.accepted}") from None
    lengths = np.concatenate([c.lengths for c in chunks]) if chunks else np.zeros(0, np.int64)
    empty = lengths == 0
    if empty.any():
        raise InvalidSampleError(f"{where(_first(empty))} is empty ({int(empty.sum())} of {len(col)} rows are); "
                                 f"every row needs {_IDS_TEXT}: filter those rows out first")


def _check_numbers(table: pa.Table, spec: DataSpec, name: str) -> None:
    for column in spec.numbers:
        if column not in table.column_names:
            continue
        col = table.column(column)

        def where(i: int, column: str = column) -> str:
            return f"{spec.trainer}: {name}[{i}][{column!r}]"

        _refuse_nulls(col, where, "a number", len(col))
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise InvalidSampleError(f"{where(0)} = {describe(col[0].as_py())}: {name}[{column!r}] holds Arrow type "
                                     f"{col.type}; {column!r} is one number per row")


# --------------------------------------------------------------------------------------------------
# Rows a trainer drops
# --------------------------------------------------------------------------------------------------


def list_lengths(dataset: datasets.Dataset, column: str) -> np.ndarray:
    """The length of every row's list in ``column``, in the dataset's row order, ``(rows,)`` int64."""
    table = dataset.select_columns([column]).with_format("arrow")[:]
    return pc.list_value_length(table.column(column)).to_numpy(zero_copy_only=False).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class DropRule:
    """A trainer's rule for dropping tokenized rows: a row is dropped when ``needed(lengths)`` (column -> each row's
    token count, ``(rows,)`` arrays) is above ``limit``, the value of the setting ``setting``.

    Attributes:
        reason: the key in :attr:`PackingStatus.dropped` (with the split), e.g. ``"longer than max_length"``.
        why: the rule in words, for the warning and the error.
        fix: what keeps the rows besides raising the setting (``""``: nothing else).
    """

    columns: tuple[str, ...]
    needed: Callable[[dict[str, np.ndarray]], np.ndarray]
    limit: int
    setting: str
    reason: str
    why: str
    fix: str = ""


def drop_counted(dataset: Any, rule: DropRule, *, trainer: str, split: str, dropped: dict[str, int]
                 ) -> tuple[Any, np.ndarray | None]:
    """The rows of tokenized ``dataset`` that ``rule`` keeps; each drop counted into ``dropped`` (``"split:
    reason"`` -> rows) and logged once at WARNING with the fix.

    Returns ``(kept, rows)``: ``rows`` the kept rows' indices in ``dataset`` (None when nothing was dropped, or for
    a streamed dataset, which is filtered — and counted — as it is read).

    Raises:
        InvalidArgumentError: the rule drops every row of a ``datasets.Dataset``.
    """
    key = f"{split}: {rule.reason}"
    label = dataset_label(split)
    fix = f", {rule.fix}" if rule.fix else ""
    if isinstance(dataset, datasets.IterableDataset):
        def keep(row: dict[str, Any]) -> bool:
            need = int(rule.needed({c: np.array([len(row[c])]) for c in rule.columns})[0])
            if need <= rule.limit:
                return True
            if key not in dropped:
                logger.warning("padfree: %s drops the rows of %s (a stream: counted as they are read, in "
                               "packing_status(trainer).dropped) whose %s; the first needs %s=%d; raise %s%s, or "
                               "filter the data", trainer, label, rule.why, rule.setting, need, rule.setting, fix)
            dropped[key] = dropped.get(key, 0) + 1
            return False

        return dataset.filter(keep), None
    needed = rule.needed({c: list_lengths(dataset, c) for c in rule.columns})
    drop = needed > rule.limit
    count = int(drop.sum())
    if count == 0:
        return dataset, None
    if count == len(dataset):
        low, high = int(needed.min()), int(needed.max())
        keep = f"{high} to keep them all" if low == high else f"{low} to keep one, {high} to keep them all"
        raise InvalidArgumentError(
            f"{trainer}: {rule.setting}={rule.limit} drops every one of the {count} rows of {label}: {rule.why}; "
            f"raise {rule.setting} to {keep}{fix}, or filter the data")
    rows = np.flatnonzero(drop)
    shown = ", ".join(map(str, rows[:_SHOWN_ROWS])) + (", ..." if count > _SHOWN_ROWS else "")
    dropped[key] = dropped.get(key, 0) + count
    logger.warning("padfree: %s drops %d of %d rows of %s (rows %s): their %s; raise %s to %d to keep them all%s, or "
                   "filter the data. Counted in packing_status(trainer).dropped", trainer, count, len(dataset), label,
                   shown, rule.why, rule.setting, int(needed.max()), fix)
    kept = np.flatnonzero(~drop)
    return dataset.select(kept), kept


def refuse_long_pairs(chosen: np.ndarray, rejected: np.ndarray, capacity: int, *, setting: str, trainer: str,
                      name: str, rows: np.ndarray | None = None, max_length: int | None = None) -> None:
    """Refuse a pair (``chosen[i] + rejected[i]`` tokens, prompt included in each, ``(pairs,)`` arrays) that does not
    fit one micro-batch of ``capacity`` tokens — the setting ``setting`` — naming the first and counting them all.
    ``rows`` maps a pair to its row in the user's dataset (before dropped rows); ``max_length`` the cut each
    sequence had.

    >>> refuse_long_pairs(np.array([5, 9]), np.array([4, 12]), 16, setting="packing_length", trainer="DPOTrainer",
    ...                   name="train_dataset")
    Traceback (most recent call last):
    ...
    padfree.errors.OverlongSequenceError: DPOTrainer: train_dataset[1] is a pair of 21 tokens (prompt + chosen 9, \
prompt + rejected 12), more than packing_length=16, the tokens of one packed micro-batch (1 of 2 pairs are \
longer); each pair must fit one micro-batch whole: raise packing_length to at least 21, or filter the long pairs out
    """
    total = chosen + rejected
    over = total > capacity
    if not over.any():
        return
    i = _first(over)
    row = int(rows[i]) if rows is not None else i
    cut = f", each cut to max_length={max_length}" if max_length is not None else ""
    lower = ", lower max_length" if max_length is not None else ""
    raise OverlongSequenceError(
        f"{trainer}: {name}[{row}] is a pair of {int(total[i])} tokens (prompt + chosen {int(chosen[i])}, prompt + "
        f"rejected {int(rejected[i])}{cut}), more than {setting}={capacity}, the tokens of one packed micro-batch "
        f"({int(over.sum())} of {total.size} pairs are longer); each pair must fit one micro-batch whole: raise "
        f"{setting} to at least {int(total.max())}{lower}, or filter the long pairs out")
