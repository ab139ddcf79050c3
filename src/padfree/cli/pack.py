"""``padfree pack [DATA] -o OUT``: pack a dataset into rows of CAPACITY tokens, written as Arrow, Parquet or JSON Lines.

The rows are made by the library's :func:`padfree.pack_dataset`; this command only reads DATA (tokenizing text when
it holds no token ids), writes the result atomically and reports. The output is built in a hidden work directory
beside ``--output`` and renamed into place only when complete (:class:`~padfree.cli._output.AtomicOutput`).

The format follows ``--format``, else the extension of ``--output``: none (a directory) is ``arrow``, ``.parquet``
is ``parquet``, ``.jsonl`` is ``jsonl``; any other extension is refused (``-o out.json`` or ``-o out.csv`` would
otherwise be an Arrow directory under a file's name). A sequence longer than ``--capacity`` under the default
``--overlong error`` is refused in the command's own terms, before the rest is tokenized where the text is
tokenized here.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from padfree.cli._columns import (
    chat_columns,
    describe_columns,
    is_text,
    prompt_completion_text,
    text_columns,
    token_ids_from_column,
)
from padfree.cli._inputs import DATA_FORMATS, check_data_path, is_saved_dataset, optional_positive, read_dataset
from padfree.cli._optional import require
from padfree.cli._output import AtomicOutput, Progress, disk_size, num, progress_bars, size
from padfree.cli._tokens import load_tokenizer, overlong_error, tokenize_dataset
from padfree.data._scratch import with_path
from padfree.errors import DataLoadError, InvalidArgumentError, TokenizerLoadError

if TYPE_CHECKING:  # numpy is imported where it is used: a usage error costs no import
    import numpy as np

PACK_FORMATS = ("arrow", "parquet", "jsonl")
#: the format an extension of --output asks for ("": a directory)
_FORMAT_OF_SUFFIX = {"": "arrow", ".parquet": "parquet", ".jsonl": "jsonl"}
_PADDINGS = ("capacity", "longest", "none")
_MASKS = ("binary", "segments", "none")
_INT32_RANGE = (-(2**31), 2**31 - 1)


def add_parser(subparsers: Any) -> None:
    """Declare ``padfree pack`` and its arguments."""
    p = subparsers.add_parser(
        "pack",
        help="pack a dataset into rows of CAPACITY tokens and write them as Arrow, Parquet or JSON Lines",
        description=(
            "Read token ids (or tokenize text), pack every sequence of the dataset into rows of CAPACITY tokens "
            "with one global plan, and write the rows with the columns of padfree.pack_dataset: a "
            "datasets.save_to_disk directory (--format arrow), one Parquet file or one JSON Lines file. The output "
            "is built beside "
            "--output and renamed into place only when complete: an interrupted run leaves nothing at --output. "
            "Without DATA: the embedded corpus (CPython's standard library and pydoc topics), offline."
        ),
    )
    p.add_argument("data", nargs="?", metavar="DATA", help=f"dataset: {DATA_FORMATS}")
    p.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="where to write the packed dataset: a directory for arrow (a name without an extension), "
                        "NAME.parquet, or NAME.jsonl")

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
    g.add_argument("--chat", action="store_true",
                   help="chat data through the tokenizer's chat template, labels only on the assistant turns: a "
                        "'messages' column (read as chat even without --chat), or 'prompt' and 'completion' columns "
                        "(lists of messages, read as chat even without --chat; or strings: with --chat a user turn "
                        "and the assistant's answer, without it text, the completion the only target)")
    g.add_argument("--tokenizer", metavar="DIR",
                   help="a tokenizer directory (save_pretrained); default: mistral-common's 32k SentencePiece, "
                        "with padfree's chat template (padfree.corpus.CHAT_TEMPLATE)")
    g.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add its special tokens (e.g. BOS) to every text")
    g.add_argument("--append-eos", action="store_true",
                   help="end every text with the tokenizer's EOS token (a target: the model learns to stop)")
    g.add_argument("--num-proc", type=int, metavar="N",
                   help="tokenize in N processes (datasets.map(batched=True, num_proc=N)); default: 1")
    g.add_argument("--limit", type=int, metavar="N", help="pack only the first N records (or documents)")

    g = p.add_argument_group("packing")
    g.add_argument("--capacity", type=int, default=2048, help="tokens per packed row (default: 2048)")
    g.add_argument("--strategy", metavar="NAME",
                   help="packing strategy: {strategies} (default: {default_strategy})")
    g.add_argument("--overlong", default="error", metavar="POLICY",
                   help="sequences longer than CAPACITY: {overlong} — refuse (default), keep "
                        "the first CAPACITY tokens, cut into pieces of CAPACITY (each a sequence of its own), or "
                        "leave out; what is cut or left out is counted in the summary")
    g.add_argument("--seed", type=int, default=0, help="seed of the 'ffs' shuffle (default: 0)")
    g.add_argument("--max-sequences-per-bin", type=int, metavar="K", help="at most K sequences in a row")

    g = p.add_argument_group("output")
    g.add_argument("--format", metavar="FMT",
                   help="arrow (a datasets.save_to_disk directory: datasets.load_from_disk reads it), parquet "
                        "(one file) or jsonl (JSON Lines, one row per line); default: from the extension of "
                        "--output (none: arrow, .parquet, .jsonl; any other is refused)")
    g.add_argument("--columns", metavar="LIST",
                   help="comma-separated columns to write, each COL or COL=NAME to rename it, from {columns} "
                        "(default: {default_columns}); sequence_ids are rows of DATA")
    g.add_argument("--padding", default="capacity", metavar="HOW",
                   help="row length: capacity (default), longest (the longest row), none (each row as long as "
                        "its tokens) or a number of tokens")
    g.add_argument("--attention-mask", default="binary", metavar="KIND",
                   help="binary (1 real, 0 padding; default), segments (1-based index of the sequence in its "
                        "row, 0 on padding) or none")
    g.add_argument("--padding-value", type=int, default=0, metavar="ID",
                   help="token id written on padding (default: 0)")
    g.add_argument("--label-padding-value", type=int, metavar="L",
                   help="label on padding and on the first token of every sequence (default: {ignore_index})")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output (once the new one is complete)")

    g = p.add_argument_group("report")
    g.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


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


def run(args: argparse.Namespace) -> int:
    """Check the arguments, read (and tokenize) DATA, pack it with ``padfree.pack_dataset``, write atomically, report.

    Intermediate files (the tokenized rows, the packed Arrow file) live in the output's work directory, never
    next to the input: a saved dataset given as DATA is only read.
    """
    import padfree

    started = time.perf_counter()
    # every cheap check first: a typo fails before anything is read or tokenized, a missing DATA before the packing
    # engine (numba) is imported
    if args.data is not None:
        check_data_path(args.data)
    opts = _pack_options(args)
    spec = _packing_spec(opts)
    _check_input_args(args)
    require("padfree pack", "pyarrow", "datasets")
    if args.data is None or (args.input_ids_column is None and _text_flags(args)):
        require("padfree pack (it tokenizes the text)", "transformers")
    say = Progress(enabled=not args.quiet)
    with progress_bars(not args.quiet), AtomicOutput(opts.output, replace=args.overwrite) as out:
        packing = _pack_input(args, opts, out.cache, say)
        if spec.refuses_overlong:
            _refuse_overlong(packing, opts, args.data)
        say(f"packing {packing.dataset.num_rows:,} sequences into rows of {opts.capacity:,} tokens ({opts.strategy})")
        try:
            result = padfree.plan_dataset(packing.dataset, spec=spec)
            packed = padfree.pack_dataset_from_result(
                result, packing.dataset, opts.padding_value, opts.label_padding_value, padding=opts.padding,
                attention_mask=opts.attention_mask, columns=opts.columns,
                cache_file_name=str(out.cache / "packed.arrow"),
            )
        except InvalidArgumentError as exc:
            raise _in_flags(exc, opts) from exc
        if packing.kept is not None:
            packed = _records_as_sequence_ids(packed, packing.kept, opts.columns)
        say(f"writing {packed.num_rows:,} rows ({opts.format}) to {opts.output}")
        try:
            if opts.format == "arrow":
                packed.save_to_disk(str(out.staged))
            elif opts.format == "parquet":
                packed.to_parquet(str(out.staged))
            else:
                packed.to_json(str(out.staged), lines=True)
            written = disk_size(out.staged)
            out.commit()
        except OSError as exc:  # a full disk, a size limit: one line naming the file (padfree.cli.main)
            raise with_path(exc, out.staged) from exc
    summary = _summary(args, opts, packing, result, packed.column_names, written, time.perf_counter() - started)
    print(json.dumps(summary, indent=2) if args.json else render_pack_summary(summary, packing))
    return 0


def _in_flags(exc: InvalidArgumentError, opts: _PackOptions) -> InvalidArgumentError:
    """The library's refusal of ``padding=N`` (known only once the rows are planned) said in the command's flags."""
    import re

    found = re.match(rf"padding={opts.padding} is shorter than the longest row \((\d+) tokens\)", str(exc))
    if not isinstance(opts.padding, int) or found is None:
        return exc
    longest = int(found.group(1))
    return InvalidArgumentError(f"--padding {opts.padding} is shorter than the longest packed row ({longest:,} "
                                f"tokens); pass --padding {longest} or more, or --padding longest, capacity or none")


def _packing_spec(opts: _PackOptions) -> Any:
    """The one :class:`~padfree.PackingSpec` of the command, refused in its flags' names."""
    from padfree.packing import PackingSpec

    return PackingSpec.resolve(None, {"capacity": opts.capacity, "strategy": opts.strategy, "seed": opts.seed,
                                      "overlong": opts.overlong, "max_sequences_per_bin": opts.max_sequences_per_bin},
                               names={"capacity": "--capacity", "strategy": "--strategy", "seed": "--seed",
                                      "overlong": "--overlong", "max_sequences_per_bin": "--max-sequences-per-bin"})


def _pack_options(args: argparse.Namespace) -> _PackOptions:
    from padfree.layout import IGNORE_INDEX
    from padfree.packing import DEFAULT_STRATEGY, as_strategy
    from padfree.packing.inputs import OVERLONG_POLICIES, as_capacity, as_choice, as_positive_int, as_seed

    padding: str | int | None = args.padding
    if isinstance(padding, str) and padding.strip().isdigit():
        padding = as_positive_int(int(padding), "--padding")
    elif padding not in _PADDINGS:
        raise InvalidArgumentError(f"--padding must be one of {', '.join(_PADDINGS)} or a number of tokens, "
                                   f"got {padding!r}")
    mask = as_choice(args.attention_mask, "--attention-mask", _MASKS)
    columns = _parse_columns(args.columns, mask)
    output = _check_output(args.output, args.format, args.overwrite, args.data)
    label_padding = IGNORE_INDEX if args.label_padding_value is None else args.label_padding_value
    for value, name in ((args.padding_value, "--padding-value"), (label_padding, "--label-padding-value")):
        if not _INT32_RANGE[0] <= value <= _INT32_RANGE[1]:
            raise InvalidArgumentError(f"{name} must fit int32 ({_INT32_RANGE[0]} to {_INT32_RANGE[1]}), got {value}")
    return _PackOptions(
        output=output[0],
        format=output[1],
        capacity=as_capacity(args.capacity, "--capacity"),
        strategy=DEFAULT_STRATEGY if args.strategy is None else as_strategy(args.strategy, "--strategy"),
        overlong=as_choice(args.overlong, "--overlong", OVERLONG_POLICIES),
        seed=as_seed(args.seed, "--seed"),
        max_sequences_per_bin=optional_positive(args.max_sequences_per_bin, "--max-sequences-per-bin"),
        padding=None if padding == "none" else padding,
        attention_mask=None if mask == "none" else mask,
        columns=columns,
        padding_value=args.padding_value,
        label_padding_value=label_padding,
        limit=optional_positive(args.limit, "--limit"),
        num_proc=optional_positive(args.num_proc, "--num-proc"),
    )


def _parse_columns(text: str | None, mask: str) -> dict[str, str] | None:
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
        fmt = _FORMAT_OF_SUFFIX.get(path.suffix.lower())
        if fmt is None:
            raise InvalidArgumentError(
                f"--output {output!r}: padfree pack writes arrow (a directory: a name without an extension, such as "
                f"packed/), parquet (NAME.parquet) or jsonl (NAME.jsonl); the extension {path.suffix!r} asks for "
                f"none of them. Choose one of those names, or --format {'|'.join(PACK_FORMATS)} to keep this one"
            )
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
                is_saved_dataset(path) or (path / "dataset_dict.json").is_file()):
            raise InvalidArgumentError(f"--output {output!r} is a directory that datasets' save_to_disk did not "
                                       "write; refusing to replace it even with --overwrite: choose another path")
    return path, fmt


def _check_input_args(args: argparse.Namespace) -> None:
    if args.chat:
        for flag, value in (("--add-special-tokens", args.add_special_tokens), ("--append-eos", args.append_eos)):
            if value:
                raise InvalidArgumentError(f"--chat and {flag} exclude each other: the chat template writes the "
                                           "special tokens itself (BOS, and EOS after every assistant turn)")
    if args.data is None:
        for flag, value in (("--field", args.fields), ("--completion-field", args.completion_field),
                            ("--input-ids-column", args.input_ids_column), ("--labels-column", args.labels_column),
                            ("--chat", args.chat)):
            if value:
                raise InvalidArgumentError(f"{flag} needs DATA: the embedded corpus has no columns")
    if args.input_ids_column is not None:
        text_flags = _text_flags(args)
        if text_flags:
            raise InvalidArgumentError(f"--input-ids-column and {text_flags[0]} exclude each other: token ids are "
                                       "either read from a column or made by tokenizing text")


def _text_flags(args: argparse.Namespace) -> list[str]:
    """The tokenizing options that were given (they make no sense when token ids are read from a column)."""
    flags = [("--chat", args.chat), ("--field", args.fields), ("--completion-field", args.completion_field),
             ("--tokenizer", args.tokenizer), ("--add-special-tokens", args.add_special_tokens),
             ("--append-eos", args.append_eos), ("--num-proc", args.num_proc)]
    return [flag for flag, value in flags if value]


def _pack_input(args: argparse.Namespace, opts: _PackOptions, cache: Path, say: Progress) -> _PackInput:
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
        ds = read_dataset(args.data)
        if limit is not None and limit < ds.num_rows:
            ds = ds.select(range(limit))
        source = f"{args.data} ({ds.num_rows:,} records" + (f", --limit {limit})" if limit is not None else ")")

    schema = ds.data.schema
    ids_column = args.input_ids_column
    if (ids_column is None and not args.fields and not args.completion_field and not args.chat
            and "input_ids" in schema.names):
        ids_column = "input_ids"
    if ids_column is not None:
        if args.input_ids_column is None and _text_flags(args):
            raise InvalidArgumentError(
                f"DATA has token ids in column 'input_ids', so nothing is tokenized and {_text_flags(args)[0]} does "
                "not apply; pass --field to tokenize a text column instead"
            )
        tokens, measure = token_ids_from_column(ds, ids_column, args.labels_column,
                                                ids_named=args.input_ids_column is not None)
    else:
        if args.labels_column is not None:
            raise InvalidArgumentError("--labels-column needs token ids (--input-ids-column); labels of tokenized "
                                       "text come from --completion-field")
        tokens, measure = _tokenize(ds, args, opts, cache, say)
    tokens, kept = _drop_empty(tokens)
    if kept is not None and kept.shape[0] == 0:
        raise DataLoadError(f"every one of the {ds.num_rows:,} records has no tokens ({measure}): nothing to pack")
    if ids_column is not None:
        _check_token_ids(tokens, kept, f"DATA {args.data!r}: {ids_column}")
    return _PackInput(tokens, ds.num_rows, kept, source, measure)


def _refuse_overlong(packing: _PackInput, opts: _PackOptions, data: str | None) -> None:
    """Refuse a sequence longer than ``--capacity`` (``--overlong error``) naming its record and the flags, before
    the library would refuse it in its own terms (``capacity=``, ``overlong='truncate'``)."""
    import numpy as np
    import pyarrow.compute as pc

    lengths = pc.list_value_length(packing.dataset.with_format("arrow")["input_ids"]).to_numpy(zero_copy_only=False)
    over = lengths > opts.capacity
    if not over.any():
        return
    i = int(np.argmax(over))
    record = i if packing.kept is None else int(packing.kept[i])
    source = "the embedded corpus" if data is None else f"DATA {data!r}"
    raise overlong_error(source, record, int(lengths[i]), opts.capacity,
                         f"{int(over.sum()):,} of {lengths.size:,} sequences are longer, the longest has "
                         f"{int(lengths.max()):,}")


def _check_token_ids(tokens: Any, kept: np.ndarray | None, name: str) -> None:
    """The library's check of every token id (pack_dataset makes it too), here to name a bad one by its record of
    DATA: ``kept`` maps the rows left after :func:`_drop_empty` back to records."""
    from padfree.samples import read_arrow_chunks

    def row(i: int) -> str:
        return f"{name}[{i if kept is None else int(kept[i])}]"

    read_arrow_chunks(tokens.with_format("arrow")["input_ids"], name, rows=row)


def _tokenize(ds: Any, args: argparse.Namespace, opts: _PackOptions, cache: Path, say: Progress) -> tuple[Any, str]:
    schema = ds.data.schema
    source = "the embedded corpus" if args.data is None else f"DATA {args.data!r}"
    other = "--field" if args.fields else "--completion-field" if args.completion_field else None
    chat = chat_columns(schema, args.chat, other, source=source)
    if chat is not None:
        return _tokenize_chat(ds, chat, args, opts, cache, say, source)
    completion = args.completion_field
    fields = args.fields
    if completion is None and not fields and prompt_completion_text(schema):
        # TRL's prompt-completion layout: the completion is what is trained on, as TRL's completion_only_loss does
        completion, fields = "completion", ["prompt"]
    if completion is not None:
        if completion not in schema.names:
            raise DataLoadError(f"--completion-field {completion!r}: no such column; available columns: "
                                f"{describe_columns(schema)}")
        if not is_text(schema.field(completion).type):
            raise DataLoadError(f"--completion-field {completion!r} has type {schema.field(completion).type}, "
                                "not text")
    instead = "or pass token ids with --input-ids-column"
    if fields and completion is not None:
        # --field names the prompt's columns; naming the completion among them too is natural and harmless
        fields = [f for f in fields if f != completion]
        prompt = text_columns(schema, fields, instead=instead, source=source)[0] if fields else []
    else:
        prompt, note = text_columns(schema, fields, exclude=completion, instead=instead, source=source)
    if completion is not None:
        note = (f"prompt {' + '.join(map(repr, prompt))}, then completion {completion!r} (the only targets), "
                "joined with newlines" if prompt else f"column {completion!r}, every token a target")
    require("padfree pack (it tokenizes the text)", "transformers")
    tokenizer, name = load_tokenizer(args.tokenizer)
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
    refuse = (opts.capacity, source) if _packing_spec(opts).refuses_overlong else None
    tokens = tokenize_dataset(ds, tokenizer, prompt=prompt, completion=completion,
                              add_special_tokens=args.add_special_tokens, eos=eos, num_proc=num_proc, cache=cache,
                              refuse_over=refuse)
    extras = [flag for flag, on in (("special tokens", args.add_special_tokens), ("EOS appended", eos is not None))
              if on]
    return tokens, f"{note}, tokenized by {name}" + (f" ({', '.join(extras)})" if extras else "")


def _tokenize_chat(ds: Any, chat: Any, args: argparse.Namespace, opts: _PackOptions, cache: Path, say: Progress,
                   source: str) -> tuple[Any, str]:
    """Chat data through the tokenizer's chat template: labels on the assistant turns only."""
    require("padfree pack (it tokenizes the text)", "transformers")
    tokenizer, name = load_tokenizer(args.tokenizer)
    num_proc = min(opts.num_proc or 1, ds.num_rows)
    say(f"tokenizing {ds.num_rows:,} conversations with {name}'s chat template"
        + (f" in {num_proc} processes" if num_proc > 1 else ""))
    refuse = (opts.capacity, source) if _packing_spec(opts).refuses_overlong else None
    tokens = tokenize_dataset(ds, tokenizer, prompt=[], completion=None, add_special_tokens=False, eos=None,
                              num_proc=num_proc, cache=cache, refuse_over=refuse, chat=chat)
    return tokens, f"{chat.note}, tokenized by {name}"


def _drop_empty(ds: Any) -> tuple[Any, np.ndarray | None]:
    """``ds`` without its rows of no tokens (nothing to pack or train on), and the rows kept (None: all)."""
    import numpy as np
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
    rows = packed.data.table
    chunks = []
    for chunk in rows[name].chunks:
        offsets = chunk.offsets.to_numpy()
        # flatten() honours a sliced chunk, offsets do not: rebase them to the values flatten() returns
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int32()),
                                               pa.array(kept[chunk.flatten().to_numpy()])))
    rows = rows.set_column(rows.schema.get_field_index(name), name, pa.chunked_array(chunks, pa.list_(pa.int64())))
    return datasets.Dataset(InMemoryTable(rows))


def _summary(args: argparse.Namespace, opts: _PackOptions, packing: _PackInput, result: Any,
             columns: list[str], written: int, seconds: float) -> dict[str, Any]:
    if opts.padding is None:
        slots = result.total_tokens  # every row as long as its tokens
    elif opts.padding == "capacity":
        slots = result.num_bins * result.capacity
    elif opts.padding == "longest":
        slots = result.num_bins * int(result.bin_fill.max(initial=0))
    else:
        slots = result.num_bins * int(opts.padding)
    import numpy as np

    # sequences placed as more than one piece: the overlong ones under --overlong split, and with a strategy that
    # cuts at the rows' edges (wrapped) every sequence that crosses one
    split = 0 if result.piece_starts is None else \
        int((np.bincount(result.order, minlength=result.num_sequences) > 1).sum())
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
        "bytes": written,
        "seconds": round(seconds, 3),
    }


def render_pack_summary(summary: dict[str, Any], packing: _PackInput) -> str:
    """The ``padfree pack`` report (``summary`` is what ``--json`` prints)."""
    from padfree.packing.strategies import STRATEGIES

    s = summary
    out = ["padfree pack"]
    out += textwrap.wrap(packing.source, width=110, initial_indent="  data        ", subsequent_indent=" " * 14)
    out += textwrap.wrap(packing.measure, width=110, initial_indent="  sequences   ", subsequent_indent=" " * 14)
    if s["skipped_empty"]:
        out.append(f"  skipped     {num(s['skipped_empty'])} records with no tokens (nothing to pack)")
    out += [
        "",
        f"  packed      {num(s['sequences'])} sequences, {num(s['input_tokens'])} tokens -> {num(s['bins'])} rows "
        f"of {num(s['capacity'])} tokens (strategy {s['strategy']}; lower bound {num(s['lower_bound'])} rows)",
        f"  efficiency  {s['efficiency']:.2%} ({num(s['padding_tokens'])} padding tokens written)",
    ]
    cap = num(s["capacity"])
    if s["truncated_sequences"]:
        over = (f"{num(s['truncated_sequences'])} sequences longer than {cap} truncated: "
                f"{num(s['truncated_tokens'])} tokens lost")
    elif s["dropped_sequences"]:
        over = (f"{num(s['dropped_sequences'])} sequences longer than {cap} dropped: {num(s['dropped_tokens'])} "
                "tokens lost")
    elif s["split_sequences"] and STRATEGIES[s["strategy"]].cuts_at_row_edges:
        over = (f"{num(s['split_sequences'])} sequences cut at the rows' edges: {num(s['pieces'])} pieces in all, "
                "each its own sequence, no token lost")
    elif s["split_sequences"]:
        over = (f"{num(s['split_sequences'])} sequences longer than {cap} split: {num(s['pieces'])} pieces in all, "
                "no token lost")
    else:
        over = f"none: every sequence fits in {cap} tokens, no token lost"
    out.append(f"  overlong    {over} (--overlong {s['overlong']})")
    what = {"arrow": "a datasets.save_to_disk directory (datasets.load_from_disk)", "parquet": "one Parquet file",
            "jsonl": "one JSON Lines file"}[s["format"]]
    out += textwrap.wrap(f"{s['output']}: {what}, {num(s['bins'])} rows, {size(s['bytes'])}; columns "
                         f"{', '.join(s['columns'])}", width=110, initial_indent="  written     ",
                         subsequent_indent=" " * 14)
    out.append(f"  time        {s['seconds']:.1f} s")
    return "\n".join(out)
